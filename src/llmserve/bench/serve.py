"""`llmserve bench serve`: measure an OpenAI-compatible server (or two, side by side) under load."""

from __future__ import annotations

import argparse
import asyncio
import sys

from llmserve.bench.config import BenchServeConfig, add_bench_serve_args, config_from_args
from llmserve.config import CommandLineParser

DESCRIPTION = """\
Measure any OpenAI-compatible server (llmserve, vLLM, SGLang, TGI, llama.cpp's llama-server):
TTFT, TPOT, ITL, E2E latency (mean, median, p90, p99), request and token throughput, goodput.

load shapes:
  closed loop   --concurrency 1,4,16,64      (one level per value; a finished request is replaced at once)
  open loop     --request-rate 2,4 [--burstiness 1.0] [--concurrency CAP]
side by side:   --compare URL2               (same requests, interleaved A B, B A, ... in --rounds slices per level)
structured:     --json-schema FILE           (every request asks for JSON that follows the schema; its output
                                             ends when the JSON is complete, ignore_eos or not; from a server
                                             that exports llmserve's grammar metrics on /metrics, each level
                                             also reports grammar compiles, their time and the cache hit rate)
"""

EPILOG = """\
examples:
  llmserve bench serve --url http://127.0.0.1:8000 --concurrency 1,4,16,64 --input-len 256 --output-len 128
  llmserve bench serve --dataset shared-prefix --num-prefixes 4 --prefix-len 512 --tokenizer DIR
  llmserve bench serve --url http://127.0.0.1:8000 --compare http://127.0.0.1:8080 --labels llmserve,llama.cpp \\
      --concurrency 1,8 --out results.json --plot plots/
  llmserve bench serve --url http://127.0.0.1:8000 --endpoint chat --json-schema schema.json --concurrency 1,8
"""


def add_bench_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `serve` under `llmserve bench`; the handler is `args.func(args) -> exit code`."""
    parser = subparsers.add_parser("serve", help="benchmark a running OpenAI-compatible server",
                                   description=DESCRIPTION, epilog=EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_serve_args(parser)
    parser.set_defaults(func=run_from_args)
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    """0 when every measured request succeeded, 1 when some failed, 2 for a usage or connection error,
    130 when interrupted."""
    try:
        cfg = config_from_args(args)
        return run_bench_serve(cfg)
    except ValueError as e:
        print(f"llmserve bench serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("llmserve bench serve: interrupted", file=sys.stderr)
        return 130


def run_bench_serve(cfg: BenchServeConfig) -> int:
    from llmserve.bench.report import format_result, write_results
    from llmserve.bench.runner import run_benchmark
    from llmserve.bench.tokens import load_tokenizer

    tokenizer = load_tokenizer(cfg.dataset.tokenizer) if cfg.dataset.tokenizer else None
    result = asyncio.run(run_benchmark(cfg, tokenizer))
    print(format_result(result))
    if cfg.output.out:
        write_results(result, cfg.output.out)
        print(f"results: {cfg.output.out}")
    if cfg.output.plot:
        from llmserve.bench.plots import write_plots

        print("plots: " + ", ".join(write_plots(result, cfg.output.plot)))
    return 0 if all(run.metrics.num_failed == 0 for run in result.runs) else 1


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point (`python -m llmserve.bench.serve ...`), until cli.py wires `llmserve bench`."""
    parser = CommandLineParser(prog="llmserve bench")
    add_bench_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
