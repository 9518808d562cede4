"""`llmserve bench spec`: speculative decoding in-process, side by side with plain decoding.

Random weights make acceptance meaningless, so it is controlled (docs/speculative.md):
- `self`: the target as its own draft (acceptance 1.0: the upper bound on acceptance, at the full
  cost of a target-sized draft);
- `noise=X`: the target with relative weight noise X as draft (real rejection, target-sized);
- `oracle=A`: a cheap draft (the target's first `--draft-layers` layers, run for its cost) whose
  tokens are replaced by the target's greedy continuation, each kept with probability A (Leviathan's
  per-token acceptance α): the speed-up a draft of that cost and acceptance gives. The continuation
  follows the speculative engine's own output (bench/spec_oracle.py), so that A holds in bf16 too; the
  plain engine's time spent re-deriving it is left out of the timings;
- `eagle=A`, `eagle3=A`: the oracle's tokens from a random EAGLE or EAGLE-3 head (one layer over the target's
  hidden states; EAGLE-3's over the 32,000 most frequent ids where the vocabulary is larger, as published heads
  for Llama 3 are), run for its cost: the speed-up such a head gives at acceptance A;
- `ngram`: prompt lookup on prompts that repeat a span (which only a target that copies continues:
  `make-model --copying`, or `--copying` here).
Every configuration runs the same greedy workload at each concurrency, interleaved over `--rounds`
(on CUDA one engine at a time, each freed before the next: a target-sized engine per configuration
does not fit beside the others); the table reports median output tok/s, the ratio to plain decoding
and the measured acceptance, and the milliseconds a step spends in the runner's `finish` (its output and,
speculating, the next drafts: the proposing's cost beside plain decoding's). Output tok/s counts the
prompts' time too, which speculation cannot shorten (the draft even adds its own prefill); the decode-only
figure beside it is the median time per output token after the first (TPOT: a request's first token to
its last, over its other tokens) and plain decoding's TPOT over it.
"""

from __future__ import annotations

import dataclasses
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

from llmserve.bench.command import add_bench_command
from llmserve.bench.spec_oracle import OracleDraft
from llmserve.config import EngineConfig, SpeculativeConfig, engine_kwargs
from llmserve.config_speculative import EAGLE_METHODS

ORACLE_KINDS = ("oracle", *EAGLE_METHODS)  # configurations whose tokens the oracle sets (bench/spec_oracle.py)
EAGLE3_VOCAB = 32000  # EAGLE-3 heads published for Llama 3 keep this many ids


@dataclass(frozen=True)
class SpecBenchConfig:
    """The workload and the configurations; the engine's settings are the engine's own flags (`engine`), as
    `serve`'s: the target (the model), its dtype and quantization, and the speculative flags (k, the
    switch-off cap, the draft's vocabulary...) of every speculating configuration. --configs chooses each
    configuration's method and draft, so --speculative and --draft-model are refused."""

    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"engine": True})
    shape: str = field(default="smollm2-135m", metadata={"help": "shape of the made target (without a model)"})
    copying: bool = field(default=False, metadata={"help": "make the target with copying weights (make-model "
                          "--copying): it continues repeated spans, so n-gram lookup finds drafts it accepts"})
    one_engine_at_a_time: bool | None = field(default=None, metadata={"help": "build, run and free each "
                                              "configuration's engine in turn (default: on CUDA)"})
    configs: str = field(default="none,self,oracle=0.6,oracle=0.9,ngram",
                         metadata={"help": "comma list of: none, self, noise=X, oracle=A, eagle=A, eagle3=A, ngram"})
    concurrency: str = field(default="1", metadata={"help": "comma list of batch sizes (requests at once)"})
    requests_per_slot: int = field(default=2, metadata={"help": "requests per concurrency slot"})
    prompt_len: int = field(default=128, metadata={"help": "prompt tokens"})
    output_len: int = field(default=96, metadata={"help": "output tokens (ignore_eos)"})
    draft_layers: int = field(default=2, metadata={"help": "layers of the cheap draft behind oracle=A"})
    rounds: int = field(default=2, metadata={"help": "interleaved rounds; medians are reported"})
    workload_seed: int = field(default=0, metadata={"help": "seed of the random prompts and of the oracle's "
                                                    "acceptance"})
    out: str | None = field(default=None, metadata={"help": "write the results JSON here"})

    def __post_init__(self) -> None:
        if self.copying and self.engine.model.model is not None:
            raise ValueError("--copying makes the target: give it without a model (or make the model with "
                             "`llmserve make-model --copying`)")
        spec = self.engine.speculative
        if spec.speculative is not None or spec.draft_model is not None:
            raise ValueError("--speculative, --draft-model: bench spec chooses each configuration's method and "
                             "draft (--configs); give them there")
        for name in self.names:
            check_config_name(name)

    @property
    def names(self) -> list[str]:
        return self.configs.split(",")

    @property
    def levels(self) -> list[int]:
        return [int(c) for c in self.concurrency.split(",")]

    def validate(self) -> None:
        """Every configuration's engine checked before a model is made (a placeholder stands for the draft)."""
        for name in ["none", *self.names]:
            configuration_engine(self, name, self.engine.model.model, "draft").validate()


def check_config_name(name: str) -> None:
    kind, _, value = name.partition("=")
    if name in ("none", "self", "ngram") or (kind in ("noise", *ORACLE_KINDS) and _is_float(value)):
        return
    raise ValueError(f"--configs: unknown configuration {name!r} (none, self, noise=X, oracle=A, eagle=A, eagle3=A, "
                     "ngram)")


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def configuration_engine(cfg: SpecBenchConfig, name: str, target: str | None, draft: str | None) -> EngineConfig:
    """One configuration's engine: the engine flags given, the workload's sizes where they left them unset
    (a KV cache just large enough for the top level, as every engine may be alive at once), and the
    configuration's method; plain decoding (`none`) speculates not at all, so no speculative flag applies to it."""
    e = cfg.engine
    max_model_len = _given_or(e.model.max_model_len, cfg.prompt_len + cfg.output_len + 64)
    num_blocks = _given_or(e.cache.num_kv_blocks, max(cfg.levels) * (-(-max_model_len // e.cache.block_size)) + 16)
    spec = SpeculativeConfig()
    if name == "ngram":
        spec = dataclasses.replace(e.speculative, speculative="ngram", draft_vocab_size=None, draft_token_map=None,
                                   speculative_queue_drafts=False)
    elif name != "none":
        kind = name.partition("=")[0]
        method = kind if kind in EAGLE_METHODS else "draft"
        spec = dataclasses.replace(e.speculative, speculative=method, draft_model=draft)
    return dataclasses.replace(
        e, model=dataclasses.replace(e.model, model=target, max_model_len=max_model_len),
        cache=dataclasses.replace(e.cache, num_kv_blocks=num_blocks),
        scheduler=dataclasses.replace(e.scheduler, max_num_seqs=_given_or(e.scheduler.max_num_seqs, 256)),
        speculative=spec)


def _given_or(value: int | None, default: int) -> int:
    """A flag's value where it was given (a bad one is left for the engine's check to refuse), else `default`."""
    return default if value is None else value


def _workload(cfg: SpecBenchConfig, vocab_size: int, num: int, repeating: bool) -> list[list[int]]:
    rng = random.Random(cfg.workload_seed + num)
    prompts = []
    for _ in range(num):
        if repeating:
            span = [rng.randrange(10, vocab_size) for _ in range(16)]
            prompts.append((span * (cfg.prompt_len // 16 + 1))[:cfg.prompt_len])
        else:
            prompts.append([rng.randrange(10, vocab_size) for _ in range(cfg.prompt_len)])
    return prompts


def _dtype(cfg: SpecBenchConfig) -> str:
    """--dtype, auto resolved by the engine's rule (model/loader.resolve_dtype) on the device it will take."""
    if cfg.engine.model.dtype != "auto":
        return cfg.engine.model.dtype
    import torch

    from llmserve.model.loader import resolve_dtype

    return str(resolve_dtype("auto", "cuda" if torch.cuda.is_available() else "cpu")).removeprefix("torch.")


def _make_drafts(cfg: SpecBenchConfig, target: str, names: list[str], scratch: str) -> dict[str, str]:
    from llmserve.testing.draft_maker import derive_draft

    drafts = {}
    for name in names:
        root = tempfile.mkdtemp(prefix="draft-", dir=scratch)
        if name == "self":
            drafts[name] = target
        elif name.startswith("noise="):
            drafts[name] = derive_draft(target, root, None, float(name.split("=")[1]), seed=1)
        elif name.startswith("oracle="):
            drafts[name] = derive_draft(target, root, cfg.draft_layers, 0.0)
        elif name.partition("=")[0] in EAGLE_METHODS:
            drafts[name] = _eagle_head(target, root, name.partition("=")[0])
    return drafts


def _eagle_head(target: str, root: str, method: str) -> str:
    """A random one-layer head of the published shape (EAGLE-3: 32,000 ids at most; on a target of fewer than 4
    layers its features are all layer 1's input)."""
    from llmserve.model.loader import load_hf_config
    from llmserve.testing.eagle_maker import make_eagle_head

    config = load_hf_config(target)
    if method == "eagle":
        return make_eagle_head(target, root, method)
    return make_eagle_head(target, root, method, draft_vocab_size=min(EAGLE3_VOCAB, config.vocab_size),
                           aux_layer_ids=[0, 0, 0] if config.num_hidden_layers < 4 else None)


class SpecCounter:
    """Sums an in-process engine's per-step speculative-decoding stats (wraps its step)."""

    def __init__(self, llm) -> None:
        self.num_draft_tokens = self.num_accepted = self.num_drafts = 0
        step = llm.engine.step

        def counting_step():
            out = step()
            if out.stats is not None and out.stats.spec is not None:
                self.num_drafts += out.stats.spec.num_drafts
                self.num_draft_tokens += out.stats.spec.num_draft_tokens
                self.num_accepted += out.stats.spec.num_accepted_tokens
            return out

        llm.engine.step = counting_step


def _build(cfg: SpecBenchConfig, target: str, name: str, drafts: dict[str, str], reference: dict, engines: dict):
    """One configuration's engine; an oracle's reference is continued by the plain engine of its group
    (built beside it when the group has none)."""
    from llmserve import LLM

    llm = LLM(**_llm_kwargs(cfg, target, name, drafts))
    if name.partition("=")[0] in ORACLE_KINDS:
        if "none" not in engines and "reference" not in engines:
            engines["reference"] = (LLM(**_llm_kwargs(cfg, target, "none", drafts)), None)
        plain = engines.get("none", engines.get("reference"))[0]
        speculator = llm.engine.runner.speculator
        speculator.proposer = OracleDraft(speculator.proposer, reference, float(name.split("=")[1]),
                                          llm.engine.runner.vocab_size, cfg.workload_seed, _greedy(plain),
                                          cfg.output_len)
    return llm, SpecCounter(llm)


def _llm_kwargs(cfg: SpecBenchConfig, target: str, name: str, drafts: dict[str, str]) -> dict:
    """LLM(...)'s arguments for one configuration, in the dtype `auto` resolves to (targets and drafts alike)."""
    return {**engine_kwargs(configuration_engine(cfg, name, target, drafts.get(name))), "dtype": _dtype(cfg)}


def _greedy(llm):
    """(context, num) -> the engine's greedy continuation of context, num tokens."""
    from llmserve import SamplingParams

    def continue_greedy(context: list[int], num: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=num, ignore_eos=True)
        return list(llm.generate([context], params)[0].outputs[0].token_ids)

    return continue_greedy


def _rebase_s(llm) -> float:
    """Seconds an oracle engine spent continuing its reference (0 for the others)."""
    speculator = llm.engine.runner.speculator
    return getattr(speculator.proposer, "rebase_s", 0.0) if speculator is not None else 0.0


def _timed(llm, prompts: list[list[int]], params) -> tuple[float, list[float]]:
    """The wave's seconds, and per request the seconds from its first token to its last (its decode)."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return seconds, [o.metrics["finished_time"] - o.metrics["first_token_time"] for o in outputs]


def run(cfg: SpecBenchConfig) -> dict:
    with tempfile.TemporaryDirectory(prefix="llmserve-bench-") as scratch:  # the models it makes, removed after
        return _run(cfg, scratch)


def _run(cfg: SpecBenchConfig, scratch: str) -> dict:
    from llmserve import SamplingParams
    from llmserve.model.loader import load_hf_config
    from llmserve.testing.maker import make_model

    target = cfg.engine.model.model or make_model("llama", cfg.shape, os.path.join(scratch, "target"), seed=0,
                                     is_copying=cfg.copying)
    vocab_size = load_hf_config(target).vocab_size
    names, levels = cfg.names, cfg.levels
    params = SamplingParams(temperature=0, max_tokens=cfg.output_len, ignore_eos=True)
    drafts = _make_drafts(cfg, target, names, scratch)
    workloads = {(c, rep): _workload(cfg, vocab_size, c * cfg.requests_per_slot, rep)
                 for c in levels for rep in (False, True)}
    reference: dict[tuple[int, ...], list[int]] = {}
    order = ["none"] + [n for n in names if n != "none"]  # plain first: the oracle's reference
    at_once = not (cfg.one_engine_at_a_time if cfg.one_engine_at_a_time is not None else _is_cuda())
    groups = [order] if at_once else [[name] for name in order]
    measured: dict[int, tuple[dict, dict]] = {level: ({}, {}) for level in levels}
    for group in groups:
        engines: dict = {}
        for name in group:
            engines[name] = _build(cfg, target, name, drafts, reference, engines)
        if "none" in engines:
            for prompts in workloads.values():
                for prompt, out in zip(prompts, engines["none"][0].generate(prompts, params)):
                    reference[tuple(prompt)] = list(out.outputs[0].token_ids)
        for level in levels:
            times, counts = _measure(cfg, level, [n for n in group if n in names], engines, workloads, params)
            measured[level][0].update(times)
            measured[level][1].update(counts)
        _free(engines)
    results = {"config": asdict(cfg), "dtype": _dtype(cfg), "levels": {}}
    print(f"target and drafts in {results['dtype']}")
    for level in levels:
        results["levels"][str(level)] = _rows(names, *measured[level])
        _print_level(level, results["levels"][str(level)])
    return results


def _is_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _free(engines: dict) -> None:
    """Drop the engines and give their device memory back before the next ones are built."""
    import gc

    import torch

    engines.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _measure(cfg: SpecBenchConfig, level: int, names: list[str], engines: dict, workloads: dict,
             params) -> tuple[dict, dict]:
    """Per configuration: (output tok/s, median TPOT in seconds) of each round, and (drafts, draft tokens,
    accepted, engine steps, seconds in the runner's `finish`: a step's output and, speculating, the next
    step's drafts) summed (an oracle's reference work left out)."""
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    counts: dict[str, tuple[int, int, int]] = {}
    for _ in range(cfg.rounds):
        for name in names:
            llm, counter = engines[name]
            steps = llm.engine.runner.times
            before = (counter.num_drafts, counter.num_draft_tokens, counter.num_accepted, steps.num_steps,
                      steps.propose)
            prompts = workloads[(level, name == "ngram")]
            seconds, rebase_s, tpots = 0.0, _rebase_s(llm), []
            for i in range(0, len(prompts), level):  # `level` requests at once
                wave_rebase_s = _rebase_s(llm)
                wave_s, decode_s = _timed(llm, prompts[i:i + level], params)
                wave_rebase_s = _rebase_s(llm) - wave_rebase_s  # the wave's requests all decode through it
                seconds += wave_s
                tpots += [max(0.0, d - wave_rebase_s) / max(1, cfg.output_len - 1) for d in decode_s]
            seconds -= _rebase_s(llm) - rebase_s  # an oracle's reference work is not the engine's
            times[name].append((len(prompts) * cfg.output_len / seconds, statistics.median(tpots)))
            after = (counter.num_drafts, counter.num_draft_tokens, counter.num_accepted, steps.num_steps,
                     steps.propose - (_rebase_s(llm) - rebase_s))
            prev = counts.get(name, (0, 0, 0, 0, 0.0))
            counts[name] = tuple(p + a - b for p, a, b in zip(prev, after, before))
    return times, counts


def _rows(names: list[str], times: dict, counts: dict) -> dict:
    plain_tok_s, plain_tpot = (statistics.median(t) for t in zip(*times.get("none") or [(float("nan"),) * 2]))
    rows = {}
    for name in names:
        drafts, draft_tokens, accepted, num_steps, finish_s = counts[name]
        tok_s, tpot = (statistics.median(t) for t in zip(*times[name]))
        rows[name] = {"output_tok_s": tok_s, "ratio_to_none": tok_s / plain_tok_s,
                      "all_tok_s": [t for t, _ in times[name]], "tpot_ms": 1e3 * tpot,
                      "decode_ratio_to_none": plain_tpot / tpot if tpot > 0 else None,
                      "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                      "mean_accepted_length": 1 + accepted / drafts if drafts else None,
                      "finish_ms_per_step": 1e3 * finish_s / num_steps if num_steps else None}
    return rows


def _print_level(level: int, rows: dict) -> None:
    print(f"concurrency {level}")
    print(f"  {'config':<12} {'tok/s':>8} {'ratio':>6} {'TPOT ms':>8} {'decode':>7} {'accept':>7} {'tokens/step':>11}"
          f" {'finish ms/step':>14}")
    for name, r in rows.items():
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        length = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        finish = "-" if r["finish_ms_per_step"] is None else f"{r['finish_ms_per_step']:.2f}"
        decode = "-" if r["decode_ratio_to_none"] is None else f"{r['decode_ratio_to_none']:.2f}x"
        print(f"  {name:<12} {r['output_tok_s']:>8.1f} {r['ratio_to_none']:>5.2f}x {r['tpot_ms']:>8.2f} {decode:>7}"
              f" {acc:>7} {length:>11} {finish:>14}")


def add_bench_spec_parser(subparsers):
    return add_bench_command(subparsers, "spec", "benchmark speculative decoding in-process", SpecBenchConfig, run)
