"""The shape shared by the in-process benchmarks (offline, spec, roofline): a config dataclass as flags,
a run function, the results as JSON with --out."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from llmserve.config import add_dataclass_args, dataclass_from_args


def add_bench_command(subparsers, name: str, help_text: str, config_cls: type,
                      run: Callable[[object], dict]) -> argparse.ArgumentParser:
    """`llmserve bench NAME`: flags from config_cls; runs `run(config)`, writes its dict to config.out."""
    parser = subparsers.add_parser(name, help=help_text)
    add_dataclass_args(parser, config_cls)

    def main(args: argparse.Namespace) -> int:
        cfg = dataclass_from_args(config_cls, args)
        results = run(cfg)
        if cfg.out:
            with open(cfg.out, "w") as f:
                json.dump(results, f, indent=2)
        return 0

    parser.set_defaults(func=main)
    return parser
