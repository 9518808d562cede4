"""The pure-decode step time of a closed-loop `llmserve bench serve --out FILE` run, per round and server. NEVER RUN
IN CI.

usage: python scripts/cpu/served_decode_stretch.py FILE [CONCURRENCY]
  CONCURRENCY (default 16): the requests of one round (`--rounds` slices, run A B, B A, ...). In each round, the
  stretch from the moment every request has its first token to the first one's last token holds decode steps of
  all CONCURRENCY rows and no prompt: its length over the tokens a request got in it is the step time, free of
  the prompts' prefill that TPOT and ITL carry at long context (docs/benchmarks.md, "Served decode at 8k tokens").
"""
import itertools
import json
import statistics
import sys


def arrivals(record: dict) -> list[float]:
    """A request's token arrival times (s from the run's start): the first token, then each inter-token gap."""
    return list(itertools.accumulate(record["itl_s"], initial=record["start_s"] + record["ttft_s"]))


def decode_stretch(records: list[dict]) -> tuple[float, float]:
    """-> (stretch seconds, mean tokens a request in it)."""
    times = [arrivals(r) for r in records]
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    return end - start, statistics.mean(sum(start < x <= end for x in t) for t in times)


def main() -> None:
    results = json.load(open(sys.argv[1]))
    concurrency = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    for run in results["runs"]:
        records = sorted(run["records"], key=lambda r: r["start_s"])
        for i in range(0, len(records), concurrency):
            rows = records[i:i + concurrency]
            seconds, tokens = decode_stretch(rows)
            tpot = statistics.median((r["e2e_s"] - r["ttft_s"]) / (r["num_output_tokens"] - 1) for r in rows)
            print(f"{run['server']:>14} round {i // concurrency + 1}: decode-only stretch {seconds:6.1f} s, "
                  f"{tokens:5.1f} tokens a request -> {1e3 * seconds / tokens:6.1f} ms a step; "
                  f"TPOT p50 {1e3 * tpot:6.1f} ms")


if __name__ == "__main__":
    main()
