"""lm-eval's `local-completions` against a real server, as its users run it: no `tokenizer=`, so lm-eval finds
our GET /tokenizer_info and tokenizes through POST /tokenize (vLLM's routes) instead of asking the hub, offline.
A small task of our own from local jsonl files: a multiple-choice part (loglikelihoods, echoed prompt logprobs)
whose accuracy must be the one transformers' logits give, and a generate_until part whose outputs must be
transformers' greedy text cut at the stop string."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmserve.testing.servers import ServerProcess, start_tiny_server

NAME = "tiny-lm-eval"
MAX_LENGTH = 512  # the server's --max-model-len, told to lm-eval too (float32: compared with transformers')
NUM_GEN_TOKENS = 8
STOP = "\n"

MC_DOCS = [
    {"question": "Q: Which is a colour?\nA:", "choices": ["red", "seven", "quickly"], "answer": 0},
    {"question": "Q: Which is a number?\nA:", "choices": ["blue", "twelve", "run"], "answer": 1},
    {"question": "Q: Which one flies?\nA:", "choices": ["stone", "river", "sparrow", "table"], "answer": 2},
    {"question": "Q: Which is a fruit?\nA:", "choices": ["apple", "hammer"], "answer": 0},
    {"question": "Q: Which is cold?\nA:", "choices": ["fire", "sun", "ice"], "answer": 2},
]
GEN_DOCS = [{"prompt": "Once upon a time", "target": "there"},
            {"prompt": "The capital of France is", "target": "Paris"},
            {"prompt": "1, 2, 3,", "target": "4"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProcess:
    server = start_tiny_server(str(tmp_path_factory.mktemp("lm-eval-model")), "--served-model-name", NAME,
                               "--max-model-len", str(MAX_LENGTH), "--dtype", "float32")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def hf(server):
    """transformers' model and tokenizer from the checkpoint the server serves."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = server.args[server.args.index("--model") + 1]
    model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(root)


def _write_tasks(folder: Path) -> None:
    """Two tasks read from jsonl files through datasets' `json` builder (nothing fetched)."""
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    common = {"dataset_path": "json", "test_split": "test"}
    mc = {**common, "task": "llmserve_mc", "dataset_kwargs": {"data_files": {"test": str(folder / "mc.jsonl")}},
          "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
          "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]}
    gen = {**common, "task": "llmserve_gen", "dataset_kwargs": {"data_files": {"test": str(folder / "gen.jsonl")}},
           "output_type": "generate_until", "doc_to_text": "{{prompt}}", "doc_to_target": "{{target}}",
           "generation_kwargs": {"until": [STOP], "max_gen_toks": NUM_GEN_TOKENS, "do_sample": False},
           "metric_list": [{"metric": "exact_match"}]}
    for task in (mc, gen):
        (folder / f"{task['task']}.yaml").write_text(json.dumps(task))  # JSON is YAML


@pytest.fixture(scope="module")
def results(server, tmp_path_factory):
    """One lm-eval run over both tasks, offline, without `tokenizer=`."""
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    _write_tasks(folder)
    with pytest.MonkeyPatch.context() as patch:
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            patch.setenv(var, "1")
        patch.setenv("HF_DATASETS_CACHE", str(folder / "datasets-cache"))
        import datasets
        import huggingface_hub
        import lm_eval
        from lm_eval.api.registry import get_model
        from lm_eval.tasks import TaskManager

        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # in case datasets was imported before
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", folder / "datasets-cache")
        model_args = (f"model={NAME},base_url={server.base_url}/completions,num_concurrent=1,max_retries=1,"
                      f"tokenized_requests=True,max_length={MAX_LENGTH}")
        # What simple_evaluate(model="local-completions", model_args=...) builds, kept to look at afterwards.
        lm = get_model("local-completions").create_from_arg_string(model_args, {"batch_size": 1})
        results = lm_eval.simple_evaluate(
            model=lm, tasks=["llmserve_mc", "llmserve_gen"], log_samples=True, bootstrap_iters=0,
            task_manager=TaskManager(include_path=str(folder), include_defaults=False))
    return lm, results


def test_lm_eval_tokenizes_through_the_server(results, hf):
    """The remote backend auto-detected from /tokenizer_info and /tokenize (else lm-eval asks the hub for
    `tiny-lm-eval`), with the model's special tokens."""
    from lm_eval.utils import RemoteTokenizer

    lm, _ = results
    _, tokenizer = hf
    assert lm.tokenizer_backend == "remote" and isinstance(lm.tokenizer, RemoteTokenizer)
    assert lm.eot_token_id == tokenizer.eos_token_id and lm.eos_string == tokenizer.eos_token
    text = "Q: Which is cold?"
    assert lm.tok_encode(text) == tokenizer(text, add_special_tokens=False).input_ids


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of context and continuation (its `_encode_pair`): trailing spaces move to the
    continuation; the continuation's tokens are the whole text's past the context's."""
    num_spaces = len(context) - len(context.rstrip())
    if num_spaces:
        context, continuation = context[:-num_spaces], context[-num_spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids):]


def _hf_loglikelihood(model, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool]:
    """The continuation's log-probability and whether greedy decoding would have written it."""
    ids = torch.tensor([context_ids + continuation_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # [num_tokens, vocab]
    positions = torch.arange(len(context_ids) - 1, ids.shape[1] - 1)
    target = torch.tensor(continuation_ids)
    is_greedy = bool((logprobs[positions].argmax(dim=-1) == target).all())
    return logprobs[positions, target].sum().item(), is_greedy


def test_multiple_choice_accuracy_is_transformers(results, hf):
    """Each choice's loglikelihood (echoed prompt logprobs) and greediness (top logprobs) as transformers'
    logits give them, and so the accuracy lm-eval reports."""
    _, evaluated = results
    model, tokenizer = hf
    samples = sorted(evaluated["samples"]["llmserve_mc"], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(len(MC_DOCS)))
    num_correct = 0
    for doc, sample in zip(MC_DOCS, samples):
        expected = [_hf_loglikelihood(model, *_encode_pair(tokenizer, doc["question"], " " + choice))
                    for choice in doc["choices"]]
        got = [resp[0] for resp in sample["resps"]]  # one [(loglikelihood, is_greedy)] per choice
        assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in expected], abs=2e-3), doc
        assert [is_greedy for _, is_greedy in got] == [is_greedy for _, is_greedy in expected], doc
        lls = [ll for ll, _ in expected]
        num_correct += int(lls.index(max(lls)) == doc["answer"])
    assert evaluated["results"]["llmserve_mc"]["acc,none"] == pytest.approx(num_correct / len(MC_DOCS))


def _hf_greedy_text(model, tokenizer, prompt: str) -> str:
    """transformers' greedy continuation under the checkpoint's generation_config.json (its repetition penalty
    and EOS ids, which the server applies as vLLM does), cut before the stop string."""
    from transformers import GenerationConfig

    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    config = GenerationConfig.from_pretrained(model.name_or_path)
    config.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), generation_config=config, max_new_tokens=NUM_GEN_TOKENS)
    text = tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
    return text.split(STOP, 1)[0]


def test_generate_until_is_transformers_greedy_text(results, hf):
    _, evaluated = results
    model, tokenizer = hf
    samples = sorted(evaluated["samples"]["llmserve_gen"], key=lambda s: s["doc_id"])
    assert len(samples) == len(GEN_DOCS)
    for doc, sample in zip(GEN_DOCS, samples):
        (generated,) = sample["resps"][0]
        assert STOP not in generated
        assert generated == _hf_greedy_text(model, tokenizer, doc["prompt"]), doc
