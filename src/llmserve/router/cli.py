"""`llmserve route`: flags from RouterConfig's and AutoscaleConfig's dataclasses, plus --config and
repeated --backend MODEL=URL (llmserve/cli.py adds the subcommand with `add_route_parser`)."""

from __future__ import annotations

import argparse
import sys

from llmserve.config import CommandLineParser, add_dataclass_args
from llmserve.router.config import AutoscaleConfig, RouterConfig

EXAMPLES = """examples:
  llmserve route --backend tiny=http://127.0.0.1:8001 --backend tiny=http://127.0.0.1:8002 --policy prefix-aware
  llmserve route --config router.yaml --port 8080
  llmserve route --pd-disaggregation --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002
  llmserve route --autoscale --min-replicas 1 --max-replicas 4 --replica-model DIR --replica-pool tiny \\
      --replica-args "--max-model-len 512 --num-kv-blocks 200"
"""


def add_route_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "route", help="router in front of many OpenAI-compatible backends",
        description="One OpenAI-compatible endpoint in front of pools of replicas: routing policies, "
                    "model routing by difficulty, health checks, retries, admission, autoscaling.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="router YAML file (see docs/router.md)")
    parser.add_argument("--backend", action="append", default=[], metavar="MODEL=URL",
                        help="a backend of pool MODEL (repeatable)")
    parser.add_argument("--pd-disaggregation", action="store_true",
                        help="prefill/decode disaggregation: each request's prompt on a --prefill server, which "
                             "sends its KV blocks to a --decode server that streams the answer "
                             "(docs/disaggregation.md); takes --host, --port, --upstream-timeout-s, --log-level")
    parser.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="--pd-disaggregation: a server started with --disaggregation-mode prefill (repeatable)")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="--pd-disaggregation: a server started with --disaggregation-mode decode (repeatable)")
    parser.add_argument("--max-local-prefill-length", type=int, default=0, metavar="N",
                        help="--pd-disaggregation: prompts of at most N tokens skip the prefill servers and are "
                             "computed by the decode server (Dynamo's name); 0 (default): every prompt is "
                             "prefilled on a prefill server")
    parser.add_argument("--prefill-on-idle-decode", action="store_true",
                        help="--pd-disaggregation: a decode server with no request in flight computes a prompt "
                             "itself when every prefill server has one in flight (work conserving: no stream "
                             "decodes there, and the prompt would queue at a prefill server)")
    parser.add_argument("--max-local-prefill-length-if-busy", type=int, default=0, metavar="N",
                        help="--pd-disaggregation: a prompt of at most N tokens is computed by the decode server "
                             "when every prefill server is computing a longer prompt (a chat's TTFT does not wait "
                             "for a long prompt's chunks; longer prompts never go to a decode server by this "
                             "rule); 0 (default): off")
    add_dataclass_args(parser, RouterConfig)
    add_dataclass_args(parser, AutoscaleConfig)
    parser.set_defaults(func=route_command)
    return parser


def route_command(args: argparse.Namespace) -> int:
    from llmserve.http.launch import end_process
    from llmserve.router.loading import setup_from_args
    from llmserve.router.server import run

    if args.pd_disaggregation or args.prefill or args.decode or args.max_local_prefill_length \
            or args.prefill_on_idle_decode or args.max_local_prefill_length_if_busy:
        return _pd_command(args)
    try:
        setup = setup_from_args(args)
    except ValueError as e:
        print(f"llmserve route: error: {e} (see llmserve route --help)", file=sys.stderr)
        return 2
    end_process(run(setup))


def _pd_command(args: argparse.Namespace) -> int:
    from llmserve.http.launch import end_process
    from llmserve.router.pd_server import pd_config_from_args, run_pd

    try:
        config = pd_config_from_args(args)
    except ValueError as e:
        print(f"llmserve route: error: {e} (see llmserve route --help)", file=sys.stderr)
        return 2
    end_process(run_pd(config, args.host, args.port, args.log_level))


def main(argv: list[str] | None = None) -> int:
    """`python -m llmserve.router.cli route ...` (the same command without the top-level CLI's other commands)."""
    parser = CommandLineParser(prog="llmserve")
    add_route_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
