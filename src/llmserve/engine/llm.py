"""Offline inference: `LLM(model=...).generate(prompts, SamplingParams(...))`, the engine in-process."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from tqdm import tqdm

from llmserve.config import (CacheConfig, EngineConfig, KVTransferConfig, LoRAConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig,
                             SpeculativeConfig)
from llmserve.engine.engine_core import EngineCore
from llmserve.engine.output_processor import OutputProcessor, reads_final_only
from llmserve.engine.processor import Processor
from llmserve.messages import KVTierStats, SchedulerStats
from llmserve.model.loader import load_generation_defaults, load_tokenizer
from llmserve.lora_request import LoRARequest
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams


def build_engine_config(**kwargs) -> EngineConfig:
    """An EngineConfig from flat keyword arguments (any field of the model, cache, scheduler, speculative or
    parallel config)."""
    parts = {}
    for key, cls in (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig),
                     ("speculative", SpeculativeConfig), ("parallel", ParallelConfig), ("lora", LoRAConfig),
                     ("kv_transfer", KVTransferConfig)):
        names = {f.name for f in dataclasses.fields(cls)}
        parts[key] = cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
    if kwargs:
        raise ValueError(f"unknown engine arguments: {sorted(kwargs)}")
    return EngineConfig(**parts)


def _per_prompt(lora_request, num_prompts: int) -> list:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if len(lora_request) != num_prompts:
        raise ValueError(f"got {len(lora_request)} lora requests for {num_prompts} prompts")
    return list(lora_request)


class LLM:
    """The engine core driven in-process; outputs in input order."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        config = build_engine_config(model=model, **kwargs)
        self.engine = EngineCore(config)
        info = self.engine.model_info
        self.tokenizer = load_tokenizer(config.model.tokenizer or info.path)
        self.processor = Processor(self.tokenizer, info.vocab_size, info.max_model_len, info.eos_token_ids,
                                   load_generation_defaults(info.path))
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.num_preemptions = 0  # since construction: tests and benchmarks read it
        self.num_prompt_tokens_computed = 0  # likewise: prompt tokens run through the model (not cache hits)
        self.kv_tier_stats = KVTierStats()  # likewise: the KV tiers' counts (hits per tier, blocks offloaded)

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.processor.default_sampling_params()

    def generate(self, prompts: Sequence[str] | Sequence[list[int]] | str,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None, use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """lora_request: the adapter of every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._generate(prompts, sampling_params, priority, use_tqdm, lora_request=lora_request)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = False,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """vLLM's offline chat: each conversation (a list of {"role", "content"} dicts; or one such list)
        rendered by the model's chat template (or `chat_template`), then generated as its text's tokens,
        special tokens as the template wrote them (as the server's /v1/chat/completions does)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [self._render_chat(list(c), chat_template, add_generation_prompt, tools) for c in conversations]
        return self._generate(texts, sampling_params, None, use_tqdm, add_special_tokens=False)

    def embed(self, prompts: Sequence[str] | Sequence[list[int]] | str, use_tqdm: bool = False) -> list[RequestOutput]:
        """vLLM's offline embed (--runner pooling): each prompt pooled into one vector, its final RequestOutput
        (the vector in `.embedding`), in input order."""
        if self.engine.model_info.pooler is None:
            raise ValueError("embed() needs an embedding model: LLM(..., runner='pooling')")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        request_ids = []
        for prompt in prompts:
            request_id = str(next(self._ids))
            token_ids = self.processor.tokenize(prompt)
            request = self.processor.process_pooling(request_id, token_ids)
            self.output_processor.add_request(request_id, prompt if isinstance(prompt, str) else None, token_ids,
                                              request.sampling_params)
            self.engine.add_request(request)
            request_ids.append(request_id)
        finished = self._run(len(request_ids), use_tqdm)
        return [finished[r] for r in request_ids]

    def _render_chat(self, conversation: list[dict], chat_template: str | None, add_generation_prompt: bool,
                     tools: list[dict] | None) -> str:
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template: pass chat_template=, or use generate()")
        return self.tokenizer.apply_chat_template(conversation, chat_template=chat_template, tools=tools,
                                                  add_generation_prompt=add_generation_prompt, tokenize=False)

    def _generate(self, prompts: Sequence[str] | Sequence[list[int]], sampling_params, priority, use_tqdm: bool,
                  add_special_tokens: bool = True, lora_request=None) -> list[RequestOutput]:
        if self.engine.model_info.pooler is not None:
            raise ValueError("this LLM runs an embedding model (runner='pooling'): use embed()")
        params = self._params_per_prompt(len(prompts), sampling_params)
        loras = _per_prompt(lora_request, len(prompts))
        request_ids = [self._add(p, sp, priority[i] if priority else 0, add_special_tokens, loras[i])
                       for i, (p, sp) in enumerate(zip(prompts, params))]
        finished = self._run(len(request_ids), use_tqdm)
        return [finished[r] for r in request_ids]

    def _params_per_prompt(self, num_prompts: int, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        if len(sampling_params) != num_prompts:
            raise ValueError(f"got {len(sampling_params)} sampling params for {num_prompts} prompts")
        return list(sampling_params)

    def _add(self, prompt: str | list[int], params: SamplingParams, priority: int,
             add_special_tokens: bool = True, lora: LoRARequest | None = None) -> str:
        request_id = str(next(self._ids))
        token_ids = self.processor.tokenize(prompt, add_special_tokens)
        requests = self.processor.process(request_id, token_ids, params, priority,
                                          is_final_only=reads_final_only(params, collector=None, is_delta=False),
                                          lora=lora)
        self.output_processor.add_request(request_id, prompt if isinstance(prompt, str) else None, token_ids, params)
        for request in requests:
            self.engine.add_request(request)
        return request_id

    def _add_stats(self, stats: SchedulerStats) -> None:
        self.num_preemptions += stats.num_preemptions
        self.num_prompt_tokens_computed += stats.num_prompt_tokens
        if stats.kv_tiers is not None:
            for name in KVTierStats.__struct_fields__:
                setattr(self.kv_tier_stats, name, getattr(self.kv_tier_stats, name) + getattr(stats.kv_tiers, name))

    def _run(self, num_requests: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=num_requests, desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished_requests() or self.output_processor.has_unfinished_requests():
            outputs = self.engine.step()
            if outputs.stats is not None:
                self._add_stats(outputs.stats)
            processed = self.output_processor.process_outputs(outputs.outputs)
            if processed.reqs_to_abort:
                self.engine.abort_requests(processed.reqs_to_abort)
            for out in processed.request_outputs:
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return finished

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel ranks (a no-op without tensor parallelism)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
