"""The device side of an engine: the model (and a draft model), the attention backend, the KV cache
sized for the device, CUDA graphs and the model runner over them. The engine core keeps the scheduler
and the step loop; a tensor-parallel engine runs one worker per device (worker/tp_executor.py), each
with its slice of the model and of the KV cache (its KV heads), the block count agreed on by all."""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmserve.config import EngineConfig
from llmserve.config_speculative import EAGLE_METHODS
from llmserve.core.kv_cache_groups import kv_cache_layout
from llmserve.model import cpu_decode_stack, quant
from llmserve.model.attention import select_attention_backend
from llmserve.model.eagle import HUB_PATTERNS as EAGLE_HUB_PATTERNS
from llmserve.model.eagle import load_eagle
from llmserve.model.lora_layers import LoRAContext
from llmserve.model.loader import ModelInfo, load_model, load_model_info, resolve_model_path
from llmserve.model.parallel import TensorParallel
from llmserve.model.quant.token_kinds import step_kinds_of
from llmserve.spec.draft import DraftModelProposer
from llmserve.spec.draft_chain import DraftChain
from llmserve.spec.draft_head import DraftHead, read_token_map
from llmserve.spec.eagle import EagleProposer
from llmserve.spec.eagle_chain import EagleChain, HeadStep
from llmserve.spec.ngram import NgramProposer
from llmserve.spec.policy import SpeculationRule
from llmserve.spec.speculator import Speculator
from llmserve.worker.cpu_threads import apply_num_threads
from llmserve.worker.cuda_graphs import DecodeGraphs
from llmserve.worker.mixed_graphs import MixedGraphs
from llmserve.worker.pooler import Pooler
from llmserve.worker.gpu_profile import kv_budget_from_profile, profile_forward
from llmserve.worker.kv_cache import (allocate_kv_caches, cache_bytes_per_block, layer_kv_caches, needs_gpu_profile,
                                      num_kv_blocks)
from llmserve.worker.lora_manager import LoRAManager
from llmserve.worker.model_runner import ModelRunner

MAX_GRAPH_QUERIES = 16  # a captured row's queries fit one attention tile (triton_kernels.block_q_for)
MAX_DEFAULT_GRAPH_BATCH = 512  # graphs captured up to max_num_seqs, at most this (vLLM's default too)


def resolve_device(device: str) -> torch.device:
    """--device: auto (CUDA when there is one) or a torch device name."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def device_memory(device: torch.device) -> int:
    """Bytes of memory of a CUDA device (0 elsewhere): the scheduler's defaults scale with it."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).total_memory


class Worker:
    def __init__(self, config: EngineConfig, model_info: ModelInfo, path: str, device: torch.device,
                 dtype: torch.dtype, is_served: bool = False, tp: TensorParallel | None = None) -> None:
        """`config` with the device's scheduler defaults resolved; is_served: see cpu_threads;
        tp: this rank of a tensor-parallel engine (torch.distributed initialised), None without."""
        self.config, self.model_info, self.device, self.dtype, self.tp = config, model_info, device, dtype, tp
        self.kv_dtype = quant.kv_cache_torch_dtype(config.cache.kv_cache_dtype, dtype)
        self.kv_layout = kv_cache_layout(model_info.layer_windows, not config.cache.disable_hybrid_kv_cache_manager)
        model = load_model(path, dtype, device, model_info.max_model_len, tp, model_info.quantization,
                           has_lm_head=model_info.pooler is None, load_format=config.model.load_format)
        threads = apply_num_threads(config.model.num_threads, model, device.type, is_served,
                                    tp.size if tp is not None else 1)
        self.num_threads, self.threads_reason = threads.num_threads, threads.reason
        self.draft_info, draft_model = self._load_draft(model)
        lora = self._lora_manager(model)  # its slots allocated before the KV cache takes what memory is left
        for each in (model, None if self.draft_info is None else draft_model):  # once final (LoRA: no stack then)
            if each is not None:
                each.decode_stack = cpu_decode_stack.build(each)
        attn_backend = select_attention_backend(device, config.model.attention_backend, dtype)
        self.num_blocks = self._num_blocks(model, draft_model, attn_backend)
        kv_caches = layer_kv_caches(allocate_kv_caches(model.kv_cache_shape(self.num_blocks, config.cache.block_size),
                                                       self.kv_layout.num_slots, self.kv_dtype, device), self.kv_layout)
        speculator = self._speculator(attn_backend, draft_model)
        max_graph_batch = min(config.model.max_graph_batch or MAX_DEFAULT_GRAPH_BATCH, config.scheduler.max_num_seqs)
        layer_groups = self.kv_layout.layer_groups if self.kv_layout.is_hybrid else None
        lora_context = None if lora is None else lora.context
        graphs = self._decode_graphs(model, attn_backend, kv_caches, max_graph_batch, layer_groups=layer_groups,
                                     lora_context=lora_context)
        self.runner = ModelRunner(model, attn_backend, kv_caches, config.cache.block_size, model_info.vocab_size,
                                  device, config.model.seed, speculator, graphs, config.scheduler.max_num_seqs,
                                  model_info.max_model_len, tp,
                                  None if model_info.pooler is None else Pooler(model_info.pooler), self.kv_layout,
                                  lora)
        self.runner.mixed_graphs = self._mixed_graphs(model, attn_backend, kv_caches, layer_groups, lora_context)
        spec = config.speculative
        if speculator is not None and spec.num_speculative_tokens < MAX_GRAPH_QUERIES:  # verification steps
            self.runner.verify_graphs = self._decode_graphs(
                model, attn_backend, kv_caches, min(spec.speculative_max_batch, config.scheduler.max_num_seqs),
                queries_per_row=spec.num_speculative_tokens + 1, layer_groups=layer_groups, lora_context=lora_context)

    def _lora_manager(self, model: torch.nn.Module) -> LoRAManager | None:
        """--enable-lora: the adapters' slots on the model's projections."""
        lora = self.config.lora
        if not lora.enable_lora:
            return None
        slot_dtype = None if lora.lora_dtype == "auto" else getattr(torch, lora.lora_dtype)
        return LoRAManager(model, lora.max_loras, lora.max_lora_rank, lora.num_cpu_loras,
                           self.config.scheduler.max_num_seqs, self.device, slot_dtype)

    def _load_draft(self, model: torch.nn.Module) -> tuple[ModelInfo | None, torch.nn.Module | None]:
        """The draft model of --speculative draft (same vocabulary as the target, same dtype; with its ModelInfo),
        or the EAGLE head of eagle / eagle3 (no ModelInfo: it shares the target's embedding and tokenizer)."""
        spec = self.config.speculative
        if not spec.has_draft_cache:
            return None, None
        if spec.speculative in EAGLE_METHODS:
            path = resolve_model_path(spec.draft_model, None, EAGLE_HUB_PATTERNS)
            return None, load_eagle(path, spec.speculative, model, self.dtype, self.device,
                                    self.model_info.max_model_len)
        path = resolve_model_path(spec.draft_model, None)
        info = load_model_info(spec.draft_model, path, self.dtype, self.model_info.max_model_len)
        if info.vocab_size != self.model_info.vocab_size:
            raise ValueError(f"draft model vocabulary ({info.vocab_size}) differs from the target's "
                             f"({self.model_info.vocab_size}): it must share the tokenizer")
        if (spec.draft_vocab_size or 0) > info.vocab_size:
            raise ValueError(f"--draft-vocab-size: {spec.draft_vocab_size} is more than the draft model's "
                             f"vocabulary ({info.vocab_size})")
        is_reduced = spec.draft_vocab_size is not None or spec.draft_token_map is not None
        # a reduced head keeps some of the lm_head's rows: they are taken from the plain weight (spec/draft_head)
        return info, load_model(path, self.dtype, self.device, self.model_info.max_model_len, pack_head=not is_reduced)

    def _speculator(self, attn_backend, draft_model: torch.nn.Module | None) -> Speculator | None:
        spec = self.config.speculative
        if not spec.is_enabled:
            return None
        rule = SpeculationRule(spec.speculative_max_batch, spec.num_speculative_tokens, spec.speculative_dynamic,
                               has_windows=(self.config.scheduler.num_scheduler_steps or 1) > 1)
        return Speculator(self._proposer(attn_backend, draft_model), rule)

    def _proposer(self, attn_backend, draft_model: torch.nn.Module | None):
        spec = self.config.speculative
        if spec.speculative == "ngram":
            return NgramProposer(spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max)
        info, block_size = self.draft_info, self.config.cache.block_size
        kv_caches = allocate_kv_caches(draft_model.kv_cache_shape(self.num_blocks, block_size),
                                       draft_model.num_layers, self.kv_dtype, self.device)
        max_batch = min(spec.speculative_max_batch, self.config.scheduler.max_num_seqs)
        if spec.speculative in EAGLE_METHODS:
            step = HeadStep(draft_model, max_batch)
            graphs = self._decode_graphs(step, attn_backend, kv_caches, max_batch)
            return EagleProposer(draft_model, attn_backend, kv_caches, block_size, spec.num_speculative_tokens,
                                 self.model_info.max_model_len, self.device, self.config.model.seed,
                                 self.kv_layout.num_groups,
                                 None if graphs is None else EagleChain(draft_model, step, graphs, block_size,
                                                                        self.device))
        graphs = self._decode_graphs(draft_model, attn_backend, kv_caches, max_batch)
        token_map = None if spec.draft_token_map is None else read_token_map(spec.draft_token_map, info.vocab_size)
        head = DraftHead(draft_model, spec.draft_vocab_size, token_map)
        chain = None
        if graphs is not None:  # and the catch-up after a verification (k + 1 tokens and the bonus a row)
            k, catch_up = spec.num_speculative_tokens, None
            if spec.speculative_queue_drafts and k + 2 <= MAX_GRAPH_QUERIES:
                catch_up = self._decode_graphs(draft_model, attn_backend, kv_caches, max_batch, queries_per_row=k + 2)
            chain = DraftChain(head, graphs, block_size, self.device, catch_up)
        return DraftModelProposer(draft_model, head, attn_backend, kv_caches, block_size, spec.num_speculative_tokens,
                                  self.model_info.max_model_len, self.device, self.config.model.seed, chain,
                                  self.kv_layout.num_groups)

    def _num_blocks(self, model: torch.nn.Module, draft_model: torch.nn.Module | None, attn_backend) -> int:
        """Blocks that fit the budget; a block holds the KV of one group's layers (core/kv_cache_groups.py);
        with a draft model each block also holds the draft's KV."""
        cache, budget = self.config.cache, None
        block_bytes = cache_bytes_per_block(model.kv_cache_shape(1, cache.block_size), self.kv_layout.num_slots,
                                            self.kv_dtype)  # this rank's KV heads (or latents)
        if draft_model is not None:
            block_bytes += cache_bytes_per_block(draft_model.kv_cache_shape(1, cache.block_size),
                                                 draft_model.num_layers, self.kv_dtype)
        if needs_gpu_profile(cache, self.device):
            sched = self.config.scheduler
            profile = profile_forward(model, attn_backend, model.kv_cache_shape(1, cache.block_size),
                                      self.model_info.num_layers, self.kv_dtype, self.device,
                                      min(sched.max_num_batched_tokens, self.model_info.max_model_len),
                                      sched.max_num_seqs)
            budget = kv_budget_from_profile(profile, cache.gpu_memory_utilization)
        max_model_len, sched = self.model_info.max_model_len, self.config.scheduler
        num_blocks = num_kv_blocks(cache, block_bytes, max_model_len, sched.max_num_seqs, budget,
                                   self.kv_layout.num_groups, self.kv_layout.blocks_per_sequence(
                                       max_model_len, cache.block_size, sched.max_num_batched_tokens))
        if self.tp is None:
            return num_blocks
        agreed = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.tp.group)  # every rank holds every block
        return int(agreed.item())

    def _can_capture(self, model: torch.nn.Module, attn_backend) -> bool:
        """CUDA with the Triton backend, unless --enforce-eager, for a model whose forward a graph can hold."""
        if self.device.type != "cuda" or self.config.model.enforce_eager or attn_backend.name != "triton":
            return False
        if self.model_info.pooler is not None:
            return False  # a pooling engine runs prompts only: no decode step to capture
        if self.tp is not None:
            return False  # the all-reduces are not captured yet (untested without 2 GPUs): eager
        return not getattr(model, "has_host_syncs", lambda: False)()  # MoE layers that read expert counts on the host

    def _decode_graphs(self, model: torch.nn.Module, attn_backend, kv_caches: list[torch.Tensor],
                       max_batch: int, queries_per_row: int = 1,
                       layer_groups: tuple[int, ...] | None = None,
                       lora_context: LoRAContext | None = None) -> DecodeGraphs | None:
        """CUDA graphs of `model`'s batches of up to max_batch rows of `queries_per_row` queries, captured now
        (CUDA with the Triton backend, unless --enforce-eager): the target's decode and verification
        steps (with KV cache groups, `layer_groups`: each layer's; with LoRA, `lora_context`: the adapters'
        Triton kernels inside), and a draft model's later forwards."""
        if not self._can_capture(model, attn_backend):
            return None
        graphs = DecodeGraphs(model, attn_backend, kv_caches, max_batch, self._max_blocks(), self.device,
                              queries_per_row=queries_per_row, layer_groups=layer_groups, lora=lora_context)
        graphs.capture()
        return graphs

    def _mixed_graphs(self, model: torch.nn.Module, attn_backend, kv_caches: list[torch.Tensor],
                      layer_groups: tuple[int, ...] | None, lora_context: LoRAContext | None) -> MixedGraphs | None:
        """CUDA graphs of the target's mixed steps (--cudagraph-mode FULL) of up to --max-cudagraph-capture-size
        tokens (default 512, at most the token budget), captured now; none for FP8 layers that route tokens by
        kind on the host."""
        config = self.config
        if config.model.cudagraph_mode != "FULL" or not self._can_capture(model, attn_backend):
            return None
        if step_kinds_of(model) is not None:
            return None
        max_tokens = min(config.model.max_graph_batch or MAX_DEFAULT_GRAPH_BATCH,
                         config.scheduler.max_num_batched_tokens)
        graphs = MixedGraphs(model, attn_backend, kv_caches, max_tokens, config.scheduler.max_num_seqs,
                             self._max_blocks(), config.cache.block_size, self.device, layer_groups=layer_groups,
                             lora=lora_context)
        graphs.capture()
        return graphs

    def _max_blocks(self) -> int:
        """Block-table columns of the longest sequence."""
        return -(-self.model_info.max_model_len // self.config.cache.block_size)
