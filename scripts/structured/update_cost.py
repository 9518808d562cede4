"""What the scheduler's update costs a step whose rows all carry a grammar: N requests held open by a long
`minLength` string on a random model (dummy weights), `update_from_output` timed over the steps that carry every row.

    python scripts/structured/update_cost.py MODEL ROWS
"""

import sys, time, json
import numpy as np
from llmserve import LLM, SamplingParams
from llmserve.sampling_params import StructuredOutputsParams
model, rows = sys.argv[1], int(sys.argv[2])
llm = LLM(model, max_model_len=512, load_format="dummy", max_num_seqs=rows, max_num_batched_tokens=8192,
          num_kv_blocks=rows * 12 + 64, async_scheduling=True)
schema = StructuredOutputsParams.from_json_schema({"type": "string", "minLength": 400})
params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, structured_outputs=schema)
rng = np.random.default_rng(0)
for i in range(rows):
    for r in llm.processor.process(f"r{i}", rng.integers(10, 400, 16).tolist(), params):
        llm.engine.add_request(r)
sched = llm.engine.scheduler
orig = sched.update_from_output
times = []
def timed(*a, **k):
    t = time.perf_counter(); out = orig(*a, **k); times.append((time.perf_counter() - t, len(a[1].req_ids) if len(a) > 1 else 0)); return out
sched.update_from_output = timed
for _ in range(60):
    llm.engine.step()
steady = [t for t, n in times[-40:] if n == rows]
print(f"{rows} rows: update_from_output median {np.median(steady) * 1e3:.2f} ms over {len(steady)} full steps; running {len(sched.running)}")
