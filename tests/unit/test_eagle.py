"""EAGLE and EAGLE-3 draft heads (--speculative eagle | eagle3): the engine's drafts against a reference written
from the method's definition over transformers' hidden states, exact greedy outputs, sampled drafts' q, refusals.
On the CPU even where a GPU is (exact draft equality; tests/gpu/test_gpu_eagle.py runs the heads on CUDA)."""

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.config_speculative import SpeculativeConfig
from llmserve.model.eagle import eagle_shape
from llmserve.testing.eagle_maker import make_eagle_head
from llmserve.testing.maker import make_model

import graph_buffers
from eagle_reference import check_drafts, record_rows
from spec_cases import repeating_prompts


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """4 layers: EAGLE-3's default feature layers (2, 2, 1) exist."""
    return make_model("llama", "demo", str(tmp_path_factory.mktemp("target")), seed=2)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {"eagle": make_eagle_head(target, str(root / "eagle"), "eagle", seed=1, num_layers=2),
            "eagle3": make_eagle_head(target, str(root / "eagle3"), "eagle3", seed=1, draft_vocab_size=1024),
            "eagle3-ids": make_eagle_head(target, str(root / "eagle3-ids"), "eagle3", seed=3,
                                          aux_layer_ids=[0, 1, 2])}


@pytest.fixture(scope="module")
def hf_target(target):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


def _llm(target: str, head: str, method: str, **kwargs) -> LLM:
    kwargs = {"num_kv_blocks": 400, "speculative_max_batch": 8, **kwargs}  # every request speculates
    return LLM(target, device="cpu", dtype="float32", max_model_len=256, speculative=method, draft_model=head,
               num_speculative_tokens=3, speculative_dynamic=False, **kwargs)


@pytest.mark.parametrize("head", ["eagle", "eagle3", "eagle3-ids"])
def test_drafts_are_the_reference_heads_after_prompts_in_chunks_and_rejections(target, heads, hf_target, head):
    """Chunked prompts (features kept across steps) and mostly rejected drafts (features of rejected positions
    dropped): every proposal equals the reference's greedy drafts for the tokens the row held."""
    method = head.split("-")[0]
    llm = _llm(target, heads[head], method, max_num_batched_tokens=32, enable_prefix_caching=False)
    calls = record_rows(llm)
    prompts = repeating_prompts(3, seed=4)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert len(calls) >= 3 * 5 and all(len(drafts) == 3 for _, drafts in calls)
    for tokens, drafts in calls:
        check_drafts(method, heads[head], hf_target, tokens, drafts)
    assert llm.engine.runner.speculator.proposer.num_skipped == 0
    llm.engine.check_integrity()


def test_features_of_plain_windows_reach_the_head(target, heads, hf_target):
    """Proposals that find no drafts make the engine back off into multi-step windows (core/spec_stats.py); the
    windows' forwards hand their features over too, so later proposals still equal the reference."""
    llm = _llm(target, heads["eagle"], "eagle", num_scheduler_steps=4)
    proposer, runner = llm.engine.runner.speculator.proposer, llm.engine.runner
    calls, num_empty, num_window_forwards = record_rows(llm), [4], [0]
    recorded = proposer.propose

    def propose(rows):  # the first few proposals find nothing (and the head catches up later)
        if num_empty[0] > 0:
            num_empty[0] -= 1
            return [[] for _ in rows], [None] * len(rows)
        return recorded(rows)

    def decode_forward(*args, forward=runner.decode_forward):
        num_window_forwards[0] += 1
        return forward(*args)

    proposer.propose, runner.decode_forward = propose, decode_forward
    prompts = repeating_prompts(2, seed=6)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert num_window_forwards[0] > 0 and calls
    assert min(len(tokens) for tokens, _ in calls) > min(len(p) for p in prompts) + 4  # after the windows
    for tokens, drafts in calls:
        check_drafts("eagle", heads["eagle"], hf_target, tokens, drafts)
    llm.engine.check_integrity()


def test_a_step_of_more_rows_than_may_speculate_keeps_no_features(target, heads, plain):
    """Past --speculative-max-batch no row proposes, so none keeps features (no copies, no memory); once rows
    finish, the others speculate again with heads that missed those positions: outputs stay exact."""
    llm = _llm(target, heads["eagle"], "eagle", speculative_max_batch=2)
    proposer = llm.engine.runner.speculator.proposer
    sizes = []
    take = proposer.take_features
    proposer.take_features = lambda rows, *args: sizes.append(len(rows)) or take(rows, *args)
    prompts = repeating_prompts(4, seed=9)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 6, 30, 30)]
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    assert got == [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params)]
    assert sizes and max(sizes) <= 2  # the steps of 3 and 4 rows handed nothing over
    assert proposer.num_skipped == 0 and llm.engine.runner.speculator.rule.max_batch == 2
    llm.engine.check_integrity()


@pytest.fixture(scope="module")
def plain(target):
    return LLM(target, device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=400)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_outputs_are_plain_decodings_with_preemption_prefix_hits_and_n2(target, heads, plain, method):
    prompts = repeating_prompts(10, seed=3)
    prompts += [prompts[0][:40] + [7, 8, 9], prompts[0][:40] + [9, 8, 7]]  # prefix hits on prompt 0's blocks
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2)
    llm = _llm(target, heads[method], method, num_kv_blocks=24, max_num_batched_tokens=64, speculative_max_batch=16)
    got = [list(c.token_ids) for o in llm.generate(prompts, params) for c in o.outputs]
    assert llm.num_preemptions > 0, "the small pool was meant to force preemption"
    assert got == [list(c.token_ids) for o in plain.generate(prompts, params) for c in o.outputs]
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks() == llm.engine.scheduler.kv.pool.num_usable_blocks
    assert set(llm.engine.runner.speculator.proposer.features) <= set(llm.engine.runner.states)  # none leaked


def test_sampled_drafts_carry_q_over_the_heads_ids_only(target, heads):
    """EAGLE-3 with 1,024 of the 2,048 ids: sampled drafts draw from a q that is zero past its ids."""
    llm = _llm(target, heads["eagle3"], "eagle3")
    proposer = llm.engine.runner.speculator.proposer
    kept = proposer.head.target_ids()
    calls, original = [], proposer.propose
    proposer.propose = lambda rows: calls.append(original(rows)) or calls[-1]
    llm.generate(repeating_prompts(3, seed=8), SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True))
    q = [p for _, probs in calls for p in probs if p is not None]  # [k, V] each
    outside = torch.ones(2048, dtype=torch.bool).index_fill_(0, kept, False)
    assert q and all(torch.allclose(p.sum(dim=1), torch.ones(len(p))) and p[:, outside].sum() == 0 for p in q)
    assert all(set(drafts) <= set(kept.tolist()) for d, _ in calls for drafts in d)


def _config(**fields):
    base = {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 1}
    return type("Config", (), {**base, **fields})()


@pytest.mark.parametrize("method, fields, message", [
    ("eagle", {"vocab_size": 32000}, "vocab_size \\(32000\\) differs"),
    ("eagle", {"hidden_size": 128}, "hidden_size \\(128\\) differs"),
    ("eagle", {"add_para_norm": True}, "add_para_norm"),
    ("eagle3", {"num_hidden_layers": 2}, "num_hidden_layers must be 1"),
    ("eagle3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}, "eagle_aux_hidden_state_layer_ids"),
    ("eagle3", {"eagle_config": {"use_aux_hidden_state": False}}, "eagle_config.use_aux_hidden_state"),
    ("eagle3", {"target_hidden_size": 512}, "target_hidden_size \\(512\\)"),
])
def test_a_head_config_field_it_cannot_serve_is_refused_by_name(method, fields, message):
    target = _config(num_hidden_layers=4)
    with pytest.raises(ValueError, match=f"--speculative {method}: the head's config field {message}"):
        eagle_shape(method, _config(**fields), target)


def test_a_checkpoint_tensor_with_no_place_is_refused(target, heads, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil
    shutil.copytree(heads["eagle3"], tmp_path / "head")
    tensors = load_file(str(tmp_path / "head" / "model.safetensors"))
    tensors["midlayer.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "head" / "model.safetensors"))
    with pytest.raises(ValueError, match="'midlayer.extra.weight' has no place in the eagle3 head"):
        _llm(target, str(tmp_path / "head"), "eagle3")
    del tensors["midlayer.extra.weight"], tensors["norm.weight"]
    save_file(tensors, str(tmp_path / "head" / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 tensors, e.g. \\['norm.weight'\\]"):
        _llm(target, str(tmp_path / "head"), "eagle3")


def test_the_head_is_required_and_speculative_config_names_the_methods():
    with pytest.raises(ValueError, match="--draft-model: required with --speculative draft, eagle or eagle3"):
        SpeculativeConfig(speculative="eagle3").validate()
    import argparse
    from llmserve.config_speculative import take_speculative_config
    args = argparse.Namespace(speculative_config='{"method": "eagle3", "model": "h", "num_speculative_tokens": 5}',
                              speculative=None, draft_model=None, num_speculative_tokens=4)
    take_speculative_config(args)
    assert (args.speculative, args.draft_model, args.num_speculative_tokens) == ("eagle3", "h", 5)


def test_eagle3_features_come_through_the_graph_buffers(target, heads, hf_target):
    """The Triton backend's graph buffers, run eagerly on CPU (CUDA replays the same tensors): verification steps
    padded to the captured size, and prompts in the mixed-step buffers, hand the head the kept layers' inputs of
    their real tokens only."""
    pytest.importorskip("triton")
    from llmserve.worker.cuda_graphs import DecodeGraphs
    llm = _llm(target, heads["eagle3"], "eagle3", attention_backend="triton", enforce_eager=True,
               enable_prefix_caching=False)
    runner, runs = llm.engine.runner, []
    for queries, name in ((1, "graphs"), (4, "verify_graphs")):
        graphs = DecodeGraphs(runner.model, runner.attn_backend, runner.kv_caches, max_batch=4, max_blocks=16,
                              device=torch.device("cpu"), use_graphs=False, queries_per_row=queries)
        graphs.run = lambda inputs, run=graphs.run, queries=queries: runs.append(queries) or run(inputs)
        setattr(runner, name, graphs)
    mixed_runs = graph_buffers.attach(runner, "mixed", max_blocks=16, max_tokens=256, max_rows=4)
    calls = record_rows(llm)
    llm.generate(repeating_prompts(3, seed=4), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert 4 in runs  # 3 rows of k + 1 tokens padded to 4 rows
    assert mixed_runs  # the prompts padded to a multiple of 32 tokens
    for tokens, drafts in calls:
        check_drafts("eagle3", heads["eagle3"], hf_target, tokens, drafts)
    llm.engine.check_integrity()


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_the_heads_later_forwards_through_its_graph_buffers_draft_the_reference(target, heads, hf_target, method):
    """Plain greedy rows chain the head's k - 1 later forwards on the device (spec/eagle_chain.py): its decode-graph
    buffers, run eagerly on CPU, padded from 3 rows to 4."""
    pytest.importorskip("triton")
    from llmserve.spec.eagle_chain import EagleChain, HeadStep
    from llmserve.worker.cuda_graphs import DecodeGraphs
    llm = _llm(target, heads[method], method, attention_backend="triton", enforce_eager=True,
               enable_prefix_caching=False)
    proposer = llm.engine.runner.speculator.proposer
    step = HeadStep(proposer.head, 4)
    graphs = DecodeGraphs(step, proposer.attn_backend, proposer.kv_caches, max_batch=4, max_blocks=16,
                          device=torch.device("cpu"), use_graphs=False)
    proposer.chain = EagleChain(proposer.head, step, graphs, proposer.block_size, torch.device("cpu"))
    calls = record_rows(llm)
    llm.generate(repeating_prompts(3, seed=4), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert proposer.num_chained >= 3
    for tokens, drafts in calls:
        check_drafts(method, heads[method], hf_target, tokens, drafts)
    llm.engine.check_integrity()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eagle3_reads_its_layer_inputs_out_of_the_cpus_decoder_stack(target, heads, hf_target, monkeypatch, dtype):
    """The target's CPU steps in the C++ decoder stack (model/cpu_decode_stack.py) keep the three layers' inputs;
    float32: the same drafts as the reference; bfloat16 (the GEMV, where the CPU has it): greedy outputs exact."""
    from llmserve.model import cpu_kernels, cpu_isa, linear
    if not cpu_kernels.available() or cpu_isa.linear_path() == "onednn":
        pytest.skip("no C++ decoder stack here")
    if dtype == "bfloat16" and not cpu_kernels.has_bf16_gemv():
        pytest.skip("no AVX512-BF16 GEMV")
    monkeypatch.setattr(linear, "MIN_ONEDNN_WEIGHT", 1)  # the demo shape's small linears packed: the stack takes it
    llm = LLM(target, device="cpu", dtype=dtype, max_model_len=256, num_kv_blocks=400, speculative="eagle3",
              draft_model=heads["eagle3"], num_speculative_tokens=3, speculative_dynamic=False,
              enable_prefix_caching=False, speculative_max_batch=8)
    stack = llm.engine.runner.model.decode_stack
    assert stack is not None and stack.kept_layers == (2, 2, 1)
    calls = record_rows(llm)
    prompts = repeating_prompts(3, seed=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    if dtype == "float32":
        for tokens, drafts in calls:
            check_drafts("eagle3", heads["eagle3"], hf_target, tokens, drafts)
    else:
        plain = LLM(target, device="cpu", dtype=dtype, max_model_len=256, num_kv_blocks=400)
        assert got == [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params)]
    llm.engine.check_integrity()


def test_a_head_shipped_as_pytorch_model_bin_loads_as_its_safetensors(target, heads, tmp_path):
    """Many published heads ship pytorch_model.bin: read with weights_only, the same tensors as the safetensors."""
    import shutil
    from safetensors.torch import load_file
    from llmserve.model.eagle import head_weights
    shutil.copytree(heads["eagle3"], tmp_path / "head")
    tensors = load_file(str(tmp_path / "head" / "model.safetensors"))
    (tmp_path / "head" / "model.safetensors").unlink()
    torch.save({f"model.{name}" if name == "fc.weight" else name: t for name, t in tensors.items()},
               str(tmp_path / "head" / "pytorch_model.bin"))
    loaded = head_weights(str(tmp_path / "head"))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[n], tensors[n]) for n in tensors)
    prompts, params = repeating_prompts(2, seed=1), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    drafts = []
    for head in (heads["eagle3"], str(tmp_path / "head")):
        llm = _llm(target, head, "eagle3", enable_prefix_caching=False)
        calls = record_rows(llm)
        llm.generate(prompts, params)
        drafts.append([d for _, d in calls])
    assert drafts[0] and drafts[0] == drafts[1]
    (tmp_path / "head" / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors or pytorch_model\\*.bin weights"):
        _llm(target, str(tmp_path / "head"), "eagle3")


def test_make_model_writes_a_head_the_engine_serves(target, plain, tmp_path):
    """`llmserve make-model --eagle-head-of TARGET`: a random head in the published layout, served exactly."""
    import argparse
    from llmserve.testing.maker_cli import add_make_model_parser
    parser = argparse.ArgumentParser()
    add_make_model_parser(parser.add_subparsers())
    args = parser.parse_args(["make-model", "--eagle-head-of", target, "--eagle-method", "eagle3",
                              "--draft-vocab-size", "512", "--out", str(tmp_path / "head")])
    assert args.func(args) == 0
    from safetensors import safe_open
    with safe_open(str(tmp_path / "head" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("d2t").shape == (512,) and "midlayer.hidden_norm.weight" in f.keys()
    llm = _llm(target, str(tmp_path / "head"), "eagle3")
    prompts, params = repeating_prompts(2, seed=2), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
