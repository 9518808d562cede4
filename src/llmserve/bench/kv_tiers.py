"""Multi-turn chats whose prefixes outgrow the device's KV cache: time to first token with and without the
KV tiers (docs/disaggregation.md), side by side in one process (the two engines take turns, so both see
the same machine load).

Each of --num-chats chats starts with a --system-len-token prompt; each turn appends a --turn-len-token user
message and asks for one token (so the request's latency is its time to first token), then appends the
answer of --answer-len tokens as the next turn's history. Chats take turns round robin, so by the time a chat
comes back its prefix has been evicted from a device cache that holds a fraction of all chats' prefixes.

    python -m llmserve.bench.kv_tiers --model DIR --num-kv-blocks 160 --kv-offload-memory 1GiB
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from llmserve import LLM, SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m llmserve.bench.kv_tiers", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-chats", type=int, default=8)
    parser.add_argument("--num-turns", type=int, default=5)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--turn-len", type=int, default=64)
    parser.add_argument("--answer-len", type=int, default=64)
    parser.add_argument("--num-kv-blocks", type=int, default=160, help="the device cache of both engines")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-offload-memory", default="1GiB")
    parser.add_argument("--kv-offload-disk", action="store_true", help="a disk tier too (in a temporary directory)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def engine(args: argparse.Namespace, **tiers) -> LLM:
    return LLM(args.model, max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks, **tiers)


def ttft(llm: LLM, prompt: list[int]) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompt], params)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    words = lambda n: [rng.randrange(3, 250) for _ in range(n)]  # noqa: E731 (token ids past the special ones)
    with tempfile.TemporaryDirectory() as disk:
        tiers = {"kv_offload_memory": args.kv_offload_memory}
        if args.kv_offload_disk:
            tiers["kv_offload_disk"] = disk
        plain, tiered = engine(args), engine(args, **tiers)
        chats = [words(args.system_len) for _ in range(args.num_chats)]
        times: dict[str, list[float]] = {"plain": [], "tiered": []}
        for turn in range(args.num_turns):
            for i, history in enumerate(chats):
                prompt = history + words(args.turn_len)
                if len(prompt) + 1 > args.max_model_len:
                    continue
                times["plain"].append(ttft(plain, prompt))
                times["tiered"].append(ttft(tiered, prompt))
                chats[i] = prompt + words(args.answer_len)
        total = sum(len(c) for c in chats)
        print(f"chats {args.num_chats} x {args.num_turns} turns; all prefixes {total} tokens, device cache "
              f"{(args.num_kv_blocks - 1) * 16} tokens; tiers {tiers}")
        for name, values in times.items():
            later = values[args.num_chats:]  # turns after the first: the ones a cache can serve
            print(f"{name:7s} TTFT p50 all {statistics.median(values) * 1e3:8.1f} ms, "
                  f"after the first turn {statistics.median(later) * 1e3:8.1f} ms ({len(values)} requests)")
        print(f"tier hits: {tiered.kv_tier_stats}")
        tiered.engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
