"""`llmserve serve`: flags from EngineConfig's and ServerConfig's dataclasses (llmserve/cli.py adds the
subcommand with `add_serve_parser`; the handler is set as `func`)."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import socket
import sys

from llmserve.http.launch import bind_socket, end_process
from llmserve.config import (CommandLineParser, add_dataclass_args, add_engine_args, dataclass_from_args,
                             engine_config_from_args)
from llmserve.preflight import check_before_loading
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
    """Check every value, the model's files and the port before loading anything (torch included): a bad
    one is an argparse-style error, one line naming the flag, exit code 2."""
    try:
        engine_config, server_config = engine_config_from_args(args), server_config_from_args(args)
        check_before_loading(engine_config)
        sock = _bind(server_config)
    except ValueError as e:
        print(f"llmserve serve: error: {e} (see llmserve serve --help)", file=sys.stderr)
        return 2
    from llmserve.server.launcher import run  # torch and the engine load from here on

    end_process(run(engine_config, server_config, sock))


def _bind(config: ServerConfig) -> socket.socket:
    """The server's socket, bound now so that a port in use fails before the model loads."""
    try:
        return bind_socket(config.host, config.port)
    except RuntimeError as e:
        if getattr(e.__cause__, "errno", None) == errno.EADDRINUSE:
            raise ValueError(f"--port: {e} (another process listens there: choose another --port)") from None
        raise ValueError(f"--host: {e}") from None


def main(argv: list[str] | None = None) -> int:
    """`python -m llmserve.server.cli serve ...` (the same command without the top-level CLI's other commands)."""
    parser = CommandLineParser(prog="llmserve")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
