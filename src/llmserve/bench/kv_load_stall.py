"""How long a prefix loaded from the disk tier stalls the other streams (docs/disaggregation.md): one stream
decodes while a request whose long prompt was evicted to disk arrives; the stream's inter-token gaps during
that load, and the loading request's time to first token.

    python -m llmserve.bench.kv_load_stall --model DIR --prompt-len 1024

Uses only the offline API (`LLM`, its engine's `add_request`/`step`), so the same file runs against an
older checkout (PYTHONPATH=that/src python path/to/kv_load_stall.py ...) for a side-by-side figure.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from llmserve import LLM, SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m llmserve.bench.kv_load_stall", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--num-kv-blocks", type=int, default=80, help="of 16 tokens; about 1.25 prompts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    return parser.parse_args(argv)


def _add(llm: LLM, request_id: str, prompt: list[int], max_tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for request in llm.processor.process(request_id, prompt, params):
        llm.engine.add_request(request)


def one_load(llm: LLM, rng: random.Random, prompt_len: int, tag: str) -> tuple[list[float], float, int]:
    """(the stream's gaps while the prefix loads, the loading request's TTFT, its cached tokens)."""
    long_prompt = [rng.randrange(3, 500) for _ in range(prompt_len)]
    llm.generate([long_prompt], SamplingParams(max_tokens=1))
    for _ in range(2):  # evict it from the device to disk (a device cache of about 1.25 prompts)
        llm.generate([[rng.randrange(3, 500) for _ in range(prompt_len)]], SamplingParams(max_tokens=1))
    engine = llm.engine
    _add(llm, f"stream{tag}", [5, 6, 7], 60)
    for _ in range(5):
        engine.step()
    _add(llm, f"long{tag}", long_prompt, 1)
    start = last = time.perf_counter()
    gaps, ttft, num_cached = [], 0.0, -1
    while ttft == 0.0:
        outputs = engine.step().outputs
        now = time.perf_counter()
        for out in outputs:
            if out.request_id == f"stream{tag}" and out.new_token_ids:
                gaps.append(now - last)
                last = now
            if out.request_id == f"long{tag}" and out.finish_reason is not None:
                ttft, num_cached = now - start, out.num_cached_tokens
    engine.abort_requests([f"stream{tag}"])
    while engine.has_unfinished_requests():
        engine.step()
    return gaps, ttft, num_cached


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as disk:
        llm = LLM(args.model, dtype=args.dtype, max_model_len=args.prompt_len + 64, num_kv_blocks=args.num_kv_blocks,
                  kv_offload_disk=disk, kv_offload_disk_bytes="8GiB")
        rng = random.Random(0)
        one_load(llm, rng, args.prompt_len, "warm")
        for i in range(args.repeats):
            gaps, ttft, num_cached = one_load(llm, rng, args.prompt_len, str(i))
            print(f"run {i}: stream gaps during the load: max {1e3 * max(gaps):.1f} ms, median "
                  f"{1e3 * statistics.median(gaps):.1f} ms over {len(gaps)}; loading request TTFT "
                  f"{1e3 * ttft:.1f} ms, {num_cached} tokens cached", flush=True)
        llm.engine.shutdown()


if __name__ == "__main__":
    main()
