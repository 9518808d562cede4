"""Build a RouterSetup from the YAML file and the command line (see docs/router.md for the file format)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import yaml

from llmserve.config import dataclass_from_args
from llmserve.router.classifier import AutoRouteConfig, DifficultyRule
from llmserve.router.config import (AutoscaleConfig, BackendSpec, PoolSpec, RouterConfig, RouterSetup,
                                    build_record)
from llmserve.router.ratelimit import RateLimit

SECTIONS = ("router", "pools", "auto", "rate_limits", "autoscale")


def load_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
    except OSError as e:
        raise ValueError(f"cannot read the router config {path!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: the top level must be a mapping")
    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {', '.join(unknown)} (known: {', '.join(SECTIONS)})")
    return doc


def _backend(item: Any, where: str) -> BackendSpec:
    if isinstance(item, str):
        return BackendSpec(_check_url(item, where))
    if isinstance(item, dict):
        spec = build_record(BackendSpec, item, where)
        return dataclasses.replace(spec, url=_check_url(spec.url, where))
    raise ValueError(f"{where}: a backend is a URL or a mapping with `url`")


def _check_url(url: str, where: str) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{where}: backend URL must start with http:// or https://, got {url!r}")
    return url.rstrip("/")


def parse_pools(section: dict[str, Any]) -> list[PoolSpec]:
    pools = []
    for name, body in (section or {}).items():
        body = dict(body or {})
        backends = tuple(_backend(b, f"pools.{name}") for b in body.pop("backends", []) or [])
        pools.append(build_record(PoolSpec, {"name": str(name), "backends": backends, **body}, f"pools.{name}"))
    return pools


def parse_backend_flags(flags: list[str]) -> list[PoolSpec]:
    """Repeated `--backend MODEL=URL`, grouped into pools in order of first appearance."""
    urls: dict[str, list[BackendSpec]] = {}
    for flag in flags:
        model, sep, url = flag.partition("=")
        if not sep or not model:
            raise ValueError(f"--backend takes MODEL=URL, got {flag!r}")
        urls.setdefault(model, []).append(BackendSpec(_check_url(url, "--backend")))
    return [PoolSpec(name, tuple(specs)) for name, specs in urls.items()]


def merge_pools(pools: list[PoolSpec]) -> tuple[PoolSpec, ...]:
    merged: dict[str, PoolSpec] = {}
    for pool in pools:
        if pool.name in merged:
            old = merged[pool.name]
            pool = dataclasses.replace(old, backends=old.backends + pool.backends)
        merged[pool.name] = pool
    return tuple(merged.values())


def parse_auto(section: dict[str, Any] | None, model: str) -> AutoRouteConfig:
    values = dict(section or {})
    rules = tuple(build_record(DifficultyRule, r, f"auto.rules[{i}]") for i, r in enumerate(values.pop("rules", [])))
    values.setdefault("model", model)
    return build_record(AutoRouteConfig, {**values, "rules": rules}, "auto")


def parse_rate_limits(section: dict[str, Any] | None) -> tuple[RateLimit | None, dict[str, RateLimit]]:
    section = dict(section or {})
    default = section.get("default")
    keys = {str(k): build_record(RateLimit, v, f"rate_limits.keys.{k}") for k, v in (section.get("keys") or {}).items()}
    return (build_record(RateLimit, default, "rate_limits.default") if default else None), keys


def _merged(cls: type, args: argparse.Namespace, yaml_values: dict[str, Any] | None, where: str):
    """CLI values that differ from the defaults win over the YAML section's."""
    from_cli = dataclass_from_args(cls, args)
    base = build_record(cls, dict(yaml_values or {}), where)
    overrides = {f.name: getattr(from_cli, f.name) for f in dataclasses.fields(cls)
                 if getattr(from_cli, f.name) != f.default}
    return dataclasses.replace(base, **overrides)


def setup_from_args(args: argparse.Namespace) -> RouterSetup:
    doc = load_yaml(args.config) if args.config else {}
    router = _merged(RouterConfig, args, doc.get("router"), "router")
    autoscale = _merged(AutoscaleConfig, args, doc.get("autoscale"), "autoscale")
    default_limit, key_limits = parse_rate_limits(doc.get("rate_limits"))
    if default_limit is not None and router.rate_limit_rps == 0:
        router = dataclasses.replace(router, rate_limit_rps=default_limit.rate, rate_limit_burst=default_limit.burst)
    pools = merge_pools(parse_pools(doc.get("pools") or {}) + parse_backend_flags(args.backend or []))
    return check_setup(RouterSetup(router, pools, parse_auto(doc.get("auto"), router.auto_model), autoscale,
                                   key_limits))


def check_setup(setup: RouterSetup) -> RouterSetup:
    names = {p.name for p in setup.pools}
    setup.autoscale.validate()
    if setup.autoscale.autoscale:
        names.add(setup.autoscale.replica_pool)
    if not names:
        raise ValueError("no backends: give --config FILE with a `pools:` section, --backend MODEL=URL, or --autoscale")
    for pool in (setup.auto.small_pool, setup.auto.large_pool):
        if pool is not None and pool not in names:
            raise ValueError(f"auto: pool {pool!r} is not configured (pools: {', '.join(sorted(names))})")
    for rule in setup.auto.rules:
        if rule.pool not in names:
            raise ValueError(f"auto rule {rule.name!r}: pool {rule.pool!r} is not configured")
    if setup.auto.is_enabled and setup.auto.model in names:
        raise ValueError(f"the auto model name {setup.auto.model!r} is also a pool's name")
    return setup
