"""The `llmserve` command: serve, route, serve-ray, generate, make-model, bench {serve, offline, spec}."""

from __future__ import annotations

import argparse
import sys

from llmserve.config import CommandLineParser, add_engine_args, engine_config_from_args
from llmserve.preflight import check_before_loading


def _add_generate_parser(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="offline generation from the command line")
    add_engine_args(parser)
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    import dataclasses

    config = engine_config_from_args(args)
    check_before_loading(config)  # before torch and the engine load
    from llmserve import SamplingParams
    from llmserve.engine.llm import LLM

    # every section: speculative and parallel flags too
    kwargs = {k: v for section in dataclasses.fields(config) for k, v in
              dataclasses.asdict(getattr(config, section.name)).items()}
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    for out in llm.generate(args.prompt, params):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from llmserve.bench.offline import add_bench_offline_parser
    from llmserve.bench.roofline import add_bench_roofline_parser
    from llmserve.bench.serve import add_bench_serve_parser
    from llmserve.bench.spec import add_bench_spec_parser
    from llmserve.testing.maker_cli import add_make_model_parser
    from llmserve.rayserve.cli import add_serve_ray_parser
    from llmserve.router.cli import add_route_parser
    from llmserve.server.cli import add_serve_parser

    from llmserve import __version__

    parser = CommandLineParser(prog="llmserve", description="LLM serving: engine, server, router, benchmark")
    parser.add_argument("--version", action="version", version=f"llmserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_route_parser(sub)
    add_serve_ray_parser(sub)
    _add_generate_parser(sub)
    add_make_model_parser(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    add_bench_serve_parser(bench)
    add_bench_offline_parser(bench)
    add_bench_spec_parser(bench)
    add_bench_roofline_parser(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"llmserve {args.command}: error: {e} (see llmserve {args.command} --help)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
