"""`llmserve serve`: flags from EngineConfig's and ServerConfig's dataclasses.

The lead's llmserve/cli.py calls `add_serve_parser(subparsers)`; the handler is set as `func`.
"""

from __future__ import annotations

import argparse
import dataclasses

from llmserve.config import add_dataclass_args, add_engine_args, dataclass_from_args, engine_config_from_args
from llmserve.server.config import ServerConfig, resolve_api_key


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                                   description="Serve a model over an OpenAI-compatible (and TGI) HTTP API.")
    add_engine_args(parser)
    add_dataclass_args(parser, ServerConfig)
    parser.set_defaults(func=serve_command)
    return parser


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    config = dataclass_from_args(ServerConfig, args)
    return dataclasses.replace(config, api_key=resolve_api_key(config.api_key))


def serve_command(args: argparse.Namespace) -> int:
    """Check every value before starting anything: a bad one is an argparse-style error, exit code 2."""
    import sys

    from llmserve.aio import end_process
    from llmserve.server.launcher import run

    try:
        engine_config, server_config = engine_config_from_args(args), server_config_from_args(args)
        engine_config.validate()
    except ValueError as e:
        print(f"llmserve serve: error: {e} (see llmserve serve --help)", file=sys.stderr)
        return 2
    end_process(run(engine_config, server_config))


def main(argv: list[str] | None = None) -> int:
    """`python -m llmserve.server.cli serve ...` (the same command without the lead's top-level CLI)."""
    parser = argparse.ArgumentParser(prog="llmserve")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
