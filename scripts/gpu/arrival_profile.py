"""What a new request's arrival costs the streams already running: the engine core as the server runs it, N
requests decoding, then one more request at a time; each arrival's next steps timed one by one, with a host
profile of them. Once without and once with a JSON schema on every request (STEPPROF_SCHEMA, as step_profile.py);
STEPPROF_ARGS: the LLM's keyword arguments as JSON (e.g. {"cudagraph_mode": "FULL_DECODE_ONLY"}: the A/B of mixed-step
graphs).

    python scripts/gpu/arrival_profile.py MODEL [running, default 16] [out file]
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

import msgspec
import numpy as np

from step_profile import OUTPUT_LEN, PROMPT_LEN, StepLog, _sync, _until_decoding

from llmserve import LLM
from llmserve.model.loader import load_hf_config
from llmserve.sampling_params import StructuredOutputsParams

NUM_ARRIVALS, STEPS_AFTER = 4, 6


def _add(llm: LLM, params, rng: np.random.Generator, tag: str) -> None:
    prompt = rng.integers(100, llm.engine.model_info.vocab_size - 100, PROMPT_LEN).tolist()
    for request in llm.processor.process(tag, prompt, params):
        llm.engine.add_request(request)


def run_mode(llm: LLM, params, label: str, num_running: int, out) -> None:
    rng = np.random.default_rng(hash(label) % 1000)
    log = llm._step_log
    for i in range(num_running):
        _add(llm, params, rng, f"{label}-{i}")
    print(f"{label}, {num_running} running:", file=out)
    _until_decoding(llm, log, num_running, out)
    walls = []
    for _ in range(20):
        start = time.perf_counter()
        llm.engine.step()
        walls.append(time.perf_counter() - start)
    print(f"  steady: {np.median(walls) * 1e3:.2f} ms/step median, max {max(walls) * 1e3:.2f}", file=out)
    profiler = cProfile.Profile()
    for k in range(NUM_ARRIVALS):
        _add(llm, params, rng, f"{label}-new{k}")
        first = len(log.steps)
        walls = []
        profiler.enable()
        for _ in range(STEPS_AFTER):
            start = time.perf_counter()
            llm.engine.step()
            walls.append(time.perf_counter() - start)
        _sync()
        profiler.disable()
        print(f"  arrival {k}: steps {log.steps[first:]} walls ms {[round(w * 1e3, 1) for w in walls]}", file=out)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).strip_dirs().sort_stats("tottime").print_stats(16)
    print("\n".join(text.getvalue().splitlines()[4:26]), file=out)
    llm.engine.abort_requests([r for r in list(llm.engine.scheduler.requests)])
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    out.flush()


def main() -> None:
    model = sys.argv[1]
    num_running = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    out = open(sys.argv[3], "w") if len(sys.argv) > 3 else sys.stdout
    extra = msgspec.json.decode(os.environ.get("STEPPROF_ARGS", "{}"))
    llm = LLM(model, max_model_len=min(4096, load_hf_config(model).max_position_embeddings),
              load_format=os.environ.get("LOAD_FORMAT", "auto"), **extra)
    print(f"engine arguments {extra}; mixed-step graphs: {llm.engine.runner.mixed_graphs is not None}", file=out)
    llm._step_log = StepLog(llm)
    sampled = msgspec.structs.replace(llm.get_default_sampling_params(), max_tokens=OUTPUT_LEN, ignore_eos=True)
    run_mode(llm, sampled, "none", num_running, out)
    with open(os.environ.get("STEPPROF_SCHEMA", "scripts/gpu/schema.json")) as f:
        schema = StructuredOutputsParams.from_json_schema(f.read())
    run_mode(llm, msgspec.structs.replace(sampled, structured_outputs=schema), "schema", num_running, out)
    run_mode(llm, sampled, "none-again", num_running, out)


if __name__ == "__main__":
    main()
