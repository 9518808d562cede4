"""Configuration of `llmserve bench serve`: frozen records, each default written once; the CLI is built from them."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field

from llmserve.config import add_dataclass_args, dataclass_from_args

DATASETS = ("random", "shared-prefix", "sharegpt", "jsonl")
ENDPOINTS = ("completions", "chat")
PROMPT_FORMATS = ("auto", "text", "ids")
SLO_NAMES = ("ttft", "tpot", "e2e")
ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class TargetConfig:
    url: str = field(default="http://127.0.0.1:8000", metadata={"help": "base URL of the OpenAI-compatible server"})
    model: str | None = field(default=None, metadata={"help": "model name to send; several, comma-separated (e.g. LoRA adapters): each request names one of them, picked at random by its prompt; unset: the first id /v1/models lists"})
    endpoint: str = field(default="completions", metadata={"help": "completions | chat", "choices": list(ENDPOINTS)})
    compare: str | None = field(default=None, metadata={"help": "base URL of a second server, run on the same requests, interleaved A B, B A, ..."})
    compare_model: str | None = field(default=None, metadata={"help": "model name for --compare; unset: the first id its /v1/models lists"})
    labels: str | None = field(default=None, metadata={"help": "names of the servers in tables and plots, e.g. llmserve,vllm; unset: host:port"})
    stream: bool = field(default=True, metadata={"help": "stream tokens (SSE); --no-stream measures end-to-end latency only"})
    ignore_eos: bool = field(default=True, metadata={"help": "ask for exactly max_tokens tokens (ignore_eos), where the server accepts it"})
    extra_body: str | None = field(default=None, metadata={"help": "JSON object merged into every request body"})
    json_schema: str | None = field(default=None, metadata={"help": "JSON schema file: every request asks for JSON that follows it (chat: response_format json_schema; completions: structured_outputs.json)"})
    timeout: float = field(default=300.0, metadata={"help": "per-request timeout in seconds"})


@dataclass(frozen=True)
class DatasetConfig:
    dataset: str = field(default="random", metadata={"help": "random | shared-prefix | sharegpt | jsonl", "choices": list(DATASETS)})
    dataset_path: str | None = field(default=None, metadata={"help": "file of the sharegpt (JSON) or jsonl dataset"})
    tokenizer: str | None = field(default=None, metadata={"help": "HF tokenizer directory, to build text prompts of exact token lengths"})
    prompt_format: str = field(default="auto", metadata={"help": "auto | text | ids (auto: text with --tokenizer or the chat endpoint, else ids)", "choices": list(PROMPT_FORMATS)})
    vocab_size: int = field(default=256, metadata={"help": "random token ids are drawn below this (without --tokenizer)"})
    input_len: int = field(default=128, metadata={"help": "prompt tokens (random; the unique suffix for shared-prefix)"})
    output_len: int = field(default=128, metadata={"help": "output tokens (max_tokens) of random and shared-prefix requests, and of jsonl lines that give none"})
    range_ratio: float = field(default=0.0, metadata={"help": "lengths drawn uniformly from [len*(1-r), len*(1+r)]"})
    num_prefixes: int = field(default=4, metadata={"help": "distinct system prefixes (shared-prefix)"})
    prefix_len: int = field(default=512, metadata={"help": "tokens of each shared prefix (shared-prefix)"})


@dataclass(frozen=True)
class LoadConfig:
    concurrency: str | None = field(default=None, metadata={"help": "requests in flight: one value or a sweep, e.g. 1,4,16,64; unset: 1 in closed loop, no cap with --request-rate"})
    request_rate: str | None = field(default=None, metadata={"help": "open loop: requests/s, one value or a sweep, e.g. 1,2,4 (--concurrency then caps requests in flight)"})
    burstiness: float = field(default=1.0, metadata={"help": "gamma shape of the arrival gaps (1.0 = Poisson; lower = burstier)"})
    num_requests: int = field(default=100, metadata={"help": "measured requests per load level and server"})
    warmup: int = field(default=2, metadata={"help": "unmeasured requests sent to each server before the first level"})
    rounds: int = field(default=2, metadata={"help": "with --compare: each level's requests are split into this many "
                                             "rounds, run A B, B A, ... (a closed loop's round starts with --concurrency "
                                             "requests at once; 1 = one uninterrupted run per server)"})
    seed: int = field(default=0, metadata={"help": "seed of the datasets and the arrival times"})
    client_processes: int = field(default=0, metadata={"help": "client processes that send each level's requests "
                                                        "(each its share of the concurrency); 0: one per 128 requests "
                                                        "in flight, at most a quarter of the cores"})


@dataclass(frozen=True)
class OutputConfig:
    slo: str | None = field(default=None, metadata={"help": "goodput SLOs in ms, e.g. ttft=500,tpot=50,e2e=5000"})
    out: str | None = field(default=None, metadata={"help": "write the results (with every per-request record) to this JSON file"})
    plot: str | None = field(default=None, metadata={"help": "write PNG plots to this directory"})
    progress: bool = field(default=True, metadata={"help": "show a live progress bar"})


@dataclass(frozen=True)
class Level:
    """One load level: closed loop at `concurrency`, or open loop at `request_rate` (capped by `concurrency`)."""

    concurrency: int | None
    request_rate: float | None

    @property
    def is_open_loop(self) -> bool:
        return self.request_rate is not None

    @property
    def name(self) -> str:
        if not self.is_open_loop:
            return f"c={self.concurrency}"
        cap = f",cap={self.concurrency}" if self.concurrency else ""
        return f"rate={self.request_rate:g}{cap}"


@dataclass(frozen=True)
class BenchServeConfig:
    target: TargetConfig = TargetConfig()
    dataset: DatasetConfig = DatasetConfig()
    load: LoadConfig = LoadConfig()
    output: OutputConfig = OutputConfig()

    def __post_init__(self) -> None:
        validate(self)

    @property
    def levels(self) -> list[Level]:
        return parse_levels(self.load.concurrency, self.load.request_rate)

    @property
    def slo_ms(self) -> dict[str, float]:
        return parse_slo(self.output.slo)

    @property
    def extra_body(self) -> dict:
        return parse_extra_body(self.target.extra_body)

    @property
    def json_schema(self) -> dict | None:
        return load_json_schema(self.target.json_schema)

    @property
    def urls(self) -> list[str]:
        return [normalize_url(u) for u in (self.target.url, self.target.compare) if u]

    @property
    def server_labels(self) -> list[str]:
        return parse_labels(self.target.labels, self.urls)


_SECTIONS = {"target": TargetConfig, "dataset": DatasetConfig, "load": LoadConfig, "output": OutputConfig}


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    for name, cls in _SECTIONS.items():
        add_dataclass_args(parser.add_argument_group(name), cls)


def config_from_args(args: argparse.Namespace) -> BenchServeConfig:
    return BenchServeConfig(**{name: dataclass_from_args(cls, args) for name, cls in _SECTIONS.items()})


def parse_int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name}: expected integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{name}: expected positive integers, got {text!r}")
    return values


def parse_float_list(text: str, name: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--{name}: expected numbers separated by commas, got {text!r}") from None
    if not values or not all(v > 0 and math.isfinite(v) for v in values):
        raise ValueError(f"--{name}: expected positive finite numbers, got {text!r}")
    return values


def parse_levels(concurrency: str | None, request_rate: str | None) -> list[Level]:
    """Closed loop: one level per concurrency. Open loop: one per (rate, cap) pair."""
    caps = parse_int_list(concurrency, "concurrency") if concurrency else None
    if request_rate is None:
        return [Level(c, None) for c in caps or [1]]
    rates = parse_float_list(request_rate, "request-rate")
    return [Level(c, r) for r in rates for c in caps or [None]]


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=500,tpot=50' -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slo: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"--slo: expected NAME=MS with NAME in {SLO_NAMES}, got {item!r}")
        try:
            slo[name] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {name} needs a number of milliseconds, got {value!r}") from None
        if not slo[name] > 0:
            raise ValueError(f"--slo: {name} must be > 0 ms, got {value!r}")
    return slo


def parse_extra_body(text: str | None) -> dict:
    if not text:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body: not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ValueError("--extra-body: expected a JSON object")
    return body


def load_json_schema(path: str | None) -> dict | None:
    """The schema of --json-schema FILE (a JSON object), or None without one."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            schema = json.load(f)
    except OSError as e:
        raise ValueError(f"--json-schema: cannot read {path!r} ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--json-schema: {path!r} is not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema: {path!r} must hold a JSON object (a JSON schema)")
    return schema


def normalize_url(url: str) -> str:
    """'http://h:8000/v1/' -> 'http://h:8000'."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"server URL must start with http:// or https://, got {url!r}")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def parse_labels(text: str | None, urls: list[str]) -> list[str]:
    if text is None:
        labels = [u.split("://", 1)[1] for u in urls]
        return labels if len(set(labels)) == len(labels) else [f"{chr(65 + i)}:{u}" for i, u in enumerate(labels)]
    labels = [v.strip() for v in text.split(",")]
    if len(labels) != len(urls) or not all(labels) or len(set(labels)) != len(labels):
        raise ValueError(f"--labels: expected {len(urls)} distinct names separated by commas, got {text!r}")
    return labels


def validate(cfg: BenchServeConfig) -> None:
    """Raise ValueError naming the first invalid flag."""
    _validate_dataset(cfg.dataset, cfg.target.endpoint)
    _validate_load(cfg.load)
    parse_levels(cfg.load.concurrency, cfg.load.request_rate)
    parse_extra_body(cfg.target.extra_body)
    load_json_schema(cfg.target.json_schema)
    parse_labels(cfg.target.labels, cfg.urls)
    if cfg.target.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {cfg.target.timeout}")
    if not cfg.target.stream and {"ttft", "tpot"} & cfg.slo_ms.keys():
        raise ValueError("--slo ttft/tpot need streaming; drop them or remove --no-stream")


def _validate_dataset(d: DatasetConfig, endpoint: str) -> None:
    if d.dataset in ("sharegpt", "jsonl") and not d.dataset_path:
        raise ValueError(f"--dataset {d.dataset} needs --dataset-path FILE")
    if d.prompt_format == "ids" and endpoint == "chat":
        raise ValueError("--prompt-format ids needs --endpoint completions (chat messages are text)")
    for name in ("vocab_size", "input_len", "output_len", "num_prefixes"):
        if getattr(d, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(d, name)}")
    if d.prefix_len < 0:
        raise ValueError(f"--prefix-len must be >= 0, got {d.prefix_len}")
    if not 0.0 <= d.range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {d.range_ratio}")


def _validate_load(load: LoadConfig) -> None:
    if load.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {load.num_requests}")
    if load.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {load.warmup}")
    if load.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {load.rounds}")
    if load.client_processes < 0:
        raise ValueError(f"--client-processes must be >= 0, got {load.client_processes}")
    if not (load.burstiness > 0 and math.isfinite(load.burstiness)):
        raise ValueError(f"--burstiness must be > 0, got {load.burstiness}")
