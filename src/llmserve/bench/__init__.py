"""`llmserve bench`: serving benchmarks.

serve.py (CLI of `bench serve`) -> runner.py (probe, warm-up, levels, A/B interleaving) -> load.py (closed and
open loops) -> client.py (one timed request; sse.py parses the stream) -> metrics.py -> report.py, plots.py.
datasets.py and tokens.py make the workloads; hf_baseline.py is the transformers reference for `bench offline`.
"""
