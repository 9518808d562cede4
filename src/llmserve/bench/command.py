"""The shape shared by the in-process benchmarks (offline, spec, roofline): a config dataclass as flags,
a run function, the results as JSON with --out."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import dataclasses

from llmserve.config import add_dataclass_args, add_engine_args, dataclass_from_args, engine_config_from_args


def add_bench_command(subparsers, name: str, help_text: str, config_cls: type,
                      run: Callable[[object], dict]) -> argparse.ArgumentParser:
    """`llmserve bench NAME`: flags from config_cls (and the engine's, for a field marked `engine`); runs
    `run(config)`, writes its dict to config.out. The engine's settings are checked before anything is made:
    by the config's own `validate()` where the benchmark builds several engines from them, else as `serve`'s."""
    parser = subparsers.add_parser(name, help=help_text)
    engine_fields = tuple(f.name for f in dataclasses.fields(config_cls) if f.metadata.get("engine"))
    add_dataclass_args(parser, config_cls, skip=engine_fields)
    if engine_fields:  # the engine's own flags (`serve`'s), not a copy of some of them
        add_engine_args(parser)

    def main(args: argparse.Namespace) -> int:
        cfg = dataclass_from_args(config_cls, args)
        if engine_fields:
            engine = engine_config_from_args(args)
            cfg = dataclasses.replace(cfg, **{engine_fields[0]: engine})
            getattr(cfg, "validate", engine.validate)()
        results = run(cfg)
        if cfg.out:
            with open(cfg.out, "w") as f:
                json.dump(results, f, indent=2)
        return 0

    parser.set_defaults(func=main)
    return parser
