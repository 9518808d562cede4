"""Speculative decoding's settings (spec/), from its flags or vLLM's --speculative-config JSON."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from llmserve.config_checks import check, check_field_choices, check_min
from llmserve.json_flags import parse_json_object_flag


EAGLE_METHODS = ("eagle", "eagle3")  # draft heads over the target's hidden states (model/eagle.py)
CUDA_MAX_BATCH = 8  # the default cap on CUDA
CPU_VERIFY_ROWS_F32, CPU_VERIFY_ROWS_16BIT = 10, 8  # CPU: a verification's rows (requests x (k + 1)) that still pay


@dataclass(frozen=True)
class SpeculativeConfig:
    speculative: str | None = field(default=None, metadata={"help": "speculative decoding: ngram (prompt lookup) | draft (a smaller model) | eagle, eagle3 (an EAGLE or EAGLE-3 draft head over the target's hidden states: docs/speculative.md); default off", "choices": ["ngram", "draft", "eagle", "eagle3"]})
    num_speculative_tokens: int = field(default=4, metadata={"help": "draft tokens proposed per request and step (k)"})
    draft_model: str | None = field(default=None, metadata={"help": "HF directory or hub id of the draft model (--speculative draft; same tokenizer as the target) or of the EAGLE head (eagle, eagle3)"})
    ngram_max: int = field(default=4, metadata={"help": "ngram: longest suffix matched against the prompt and output so far"})
    ngram_min: int = field(default=1, metadata={"help": "ngram: shortest suffix matched"})
    speculative_max_batch: int | None = field(default=None, metadata={"help": "switch speculation off for a step "
                                              "when more requests than this run (default: 8 on CUDA; on CPU as many "
                                              "requests as verify within 10 rows in float32, 8 in 16-bit types, "
                                              "k + 1 rows a request, at least 1: measured, docs/speculative.md)"})
    speculative_dynamic: bool = field(default=False, metadata={"help": "speculate, per step and request, only where the measured cost of drafting and verifying buys more tokens per second than plain decoding, from each request's running acceptance (docs/speculative.md; experimental: on CPU it matches the cap alone at batch 1-8 within noise and beats always speculating above it, docs/benchmarks.md); off: every request speculates up to --speculative-max-batch"})
    draft_vocab_size: int | None = field(default=None, metadata={"help": "--speculative draft: the draft's "
                                         "head keeps only the first N token ids (the most frequent in BPE and "
                                         "SentencePiece vocabularies; EAGLE-3 and FR-Spec reduce the draft's "
                                         "vocabulary so): a cheaper draft forward, still exact; default: the "
                                         "whole vocabulary"})
    draft_token_map: str | None = field(default=None, metadata={"help": "--speculative draft: a JSON list of token "
                                        "ids, most frequent first (FR-Spec's frequency-ranked vocabulary): the "
                                        "draft's head keeps these (the first --draft-vocab-size of them when "
                                        "given) instead of the first ids"})
    speculative_queue_drafts: bool = field(default=False, metadata={"help": "draft model on CUDA with graphs: queue the next step's proposal on the device behind each verification whose rows all carried k drafts, so the host waits once for both (experimental: measured slower on an H100, docs/benchmarks.md)"})

    def for_device(self, device_type: str, is_float32: bool) -> SpeculativeConfig:
        """This config with the device's default cap filled in. On CPU a verification of R rows streams the weights
        about as fast as one row while R stays within what the one-row kernels take at once (the bf16 GEMV: 8
        rows); past that it costs more than the tokens it buys (docs/benchmarks.md, speculation on CPU)."""
        if self.speculative_max_batch is not None:
            return self
        if device_type == "cuda":
            return dataclasses.replace(self, speculative_max_batch=CUDA_MAX_BATCH)
        max_rows = CPU_VERIFY_ROWS_F32 if is_float32 else CPU_VERIFY_ROWS_16BIT
        return dataclasses.replace(self, speculative_max_batch=max(1, max_rows // (self.num_speculative_tokens + 1)))

    @property
    def is_enabled(self) -> bool:
        return self.speculative is not None

    @property
    def has_draft_cache(self) -> bool:
        """A draft model or an EAGLE head: its own KV cache in the target's blocks (spec/draft.py)."""
        return self.speculative == "draft" or self.speculative in EAGLE_METHODS

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots past the scheduled tokens that the draft model writes while it proposes."""
        return self.num_speculative_tokens if self.has_draft_cache else 0

    def validate(self) -> None:
        check_field_choices(self)
        check_min("num-speculative-tokens", self.num_speculative_tokens, 1)
        check_min("ngram-min", self.ngram_min, 1)
        check(self.ngram_min <= self.ngram_max, "ngram-max",
              f"must be >= --ngram-min ({self.ngram_min}), got {self.ngram_max}")
        check_min("speculative-max-batch", self.speculative_max_batch, 1)
        check(isinstance(self.speculative_dynamic, bool), "speculative-dynamic",
              f"must be true or false, got {self.speculative_dynamic!r}")
        check(isinstance(self.speculative_queue_drafts, bool), "speculative-queue-drafts",
              f"must be true or false, got {self.speculative_queue_drafts!r}")
        check(self.has_draft_cache == (self.draft_model is not None), "draft-model",
              "required with --speculative draft, eagle or eagle3, and only then")
        check_min("draft-vocab-size", self.draft_vocab_size, 1)
        check(self.draft_vocab_size is None or self.speculative == "draft", "draft-vocab-size",
              "only with --speculative draft")
        check(self.draft_token_map is None or self.speculative == "draft", "draft-token-map",
              "only with --speculative draft")


# --speculative-config's keys (vLLM's names) -> SpeculativeConfig's fields
SPECULATIVE_CONFIG_KEYS = {"method": "speculative", "model": "draft_model",
                           "num_speculative_tokens": "num_speculative_tokens", "prompt_lookup_max": "ngram_max",
                           "prompt_lookup_min": "ngram_min", "disable_by_batch_size": "speculative_max_batch",
                           "draft_vocab_size": "draft_vocab_size"}
SPECULATIVE_METHODS = {"ngram": "ngram", "draft_model": "draft", "draft": "draft", "eagle": "eagle", "eagle3": "eagle3"}


def take_speculative_config(args: argparse.Namespace) -> None:
    """--speculative-config's JSON onto the speculative flags; a setting given both ways is refused."""
    text = getattr(args, "speculative_config", None)
    if text is None:
        return
    settings = parse_json_object_flag("speculative-config", text, SPECULATIVE_CONFIG_KEYS)
    if "model" in settings and "method" not in settings:
        settings["method"] = "draft_model"  # as vLLM infers it
    defaults = {f.name: f.default for f in dataclasses.fields(SpeculativeConfig)}
    for key, value in settings.items():
        name = SPECULATIVE_CONFIG_KEYS[key]
        if key == "method":
            if value not in SPECULATIVE_METHODS:
                raise ValueError(f"--speculative-config: method {value!r} is not supported; supported: "
                                 f"{', '.join(SPECULATIVE_METHODS)}")
            value = SPECULATIVE_METHODS[value]
        if getattr(args, name) not in (defaults[name], value):
            raise ValueError(f"--speculative-config: {key} is also given by its own flag "
                             f"(--{name.replace('_', '-')}); give it once")
        setattr(args, name, value)
