"""What tests and benchmarks use and serving does not: random-weight checkpoint makers (`maker`, `copying`,
`draft_maker`, the `make-model` command in `maker_cli`), a toy tokenizer, a paged-batch builder, test servers
and routers, and the step gate that holds an engine process at a step boundary.

The engine's packages never import it, except where a user feature rests on it: the embedded demo model
(model/demo.py: a random checkpoint of the "demo" shape), benchmarks on random shapes (bench/), and the step
gate, loaded only when LLMSERVE_STEP_GATE is set.
"""
