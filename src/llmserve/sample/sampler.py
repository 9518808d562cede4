"""The sampler: processed logits -> one token per row, plus logprobs of the raw distribution.

Order: logit_bias and min_tokens masking, penalties; greedy rows take the argmax of those
processed logits; random rows apply temperature, top-k / top-p / min-p, then the exponential race. Rows all with
a top-k draw from their candidates alone; on CUDA, top-p without top-k races inside each row's nucleus without
sorting the vocabulary (sample/triton_nucleus.py); on CPU the other rows draw in one op over the whole row
(csrc/sampling_rows.cpp).
Logprobs come from log_softmax of the unprocessed logits (vLLM's default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.model import cpu_kernels
from llmserve.sample import ops
from llmserve.sample.metadata import SamplingMetadata


@dataclass
class LogprobsTensors:
    """Per row: the sampled token first, then the top-k (k = the batch's largest `logprobs`).

    Rows that asked for fewer (or none) are sliced by the caller.
    """

    token_ids: torch.Tensor  # [B, k + 1] int64
    logprobs: torch.Tensor  # [B, k + 1] float32
    sampled_ranks: torch.Tensor  # [B] int64, 1 = the most likely token


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None
    probs: torch.Tensor | None = None  # [B, V] the processed distribution, when asked (keep_probs)


MAX_CANDIDATES = 1024  # rows' top-k up to this: sampling works on the candidates only
NUM_ROUNDS = 64  # the CPU rows path's draws a row at most (top-p redraws above a token outside the nucleus)


class Sampler:
    """Samples a batch in a few batched ops; only rows with their own generator loop (one draw each).

    `generator` serves the unseeded rows (None: torch's default generator). `nucleus_kernel`: top-p alone
    through the sort-free Triton kernel (None: on CUDA where it compiles; True elsewhere runs Triton's
    interpreter, for tests).
    """

    def __init__(self, generator: torch.Generator | None = None, nucleus_kernel: bool | None = None) -> None:
        self.generator = generator
        self.nucleus_kernel = nucleus_kernel

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata, keep_probs: bool = False) -> SamplerOutput:
        """logits [B, V] float32 are scratch: they are modified in place. `keep_probs` also returns
        the distribution the random rows sample from (speculative decoding's target p)."""
        assert logits.shape[1] == meta.vocab_size, "metadata built for another vocabulary size"
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)  # [B, V]
        process_logits(logits, meta)
        sampled, probs = self._sample(logits, meta, keep_probs)  # [B], [B, V] | None
        if raw_logprobs is None:
            return SamplerOutput(sampled, None, probs)
        return SamplerOutput(sampled, gather_logprobs(raw_logprobs, meta.max_num_logprobs, sampled), probs)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata,
                keep_probs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        greedy = None if meta.all_random else ops.argmax_rows(logits)  # [B]
        if meta.all_greedy:
            return greedy, None
        if not keep_probs and meta.is_top_k_everywhere and meta.max_top_k <= MAX_CANDIDATES:
            sampled, kept = self._sample_candidates(logits, meta), None  # [B]
        elif not keep_probs and meta.no_top_k and not meta.no_top_p and self._has_nucleus_kernel(logits):
            sampled, kept = self._sample_nucleus(logits, meta), None  # [B]
        elif not keep_probs and cpu_kernels.samples_on_cpu(logits):
            sampled, kept = self._sample_rows_on_cpu(logits, meta), None  # [B]
        else:
            probs = self.probs(logits, meta)  # [B, V]
            kept = probs.clone() if keep_probs else None
            sampled = ops.exponential_race(probs, meta.generators, self.generator)  # [B]
        if greedy is None:
            return sampled, kept
        return torch.where(meta.is_greedy, greedy, sampled), kept

    def _sample_candidates(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The same draw as `probs` + `exponential_race`, on each row's max_top_k best tokens only.

        Every random row keeps at most max_top_k tokens, so the others have probability 0 either way.
        Everything after the top-k is [B, K] instead of [B, V], the race's noise too, except for seeded
        rows, which draw their full-vocabulary noise so that they give the same tokens on both paths.
        On CPU the filters, softmax and race are one C++ op (model/csrc/sampling_ops.cpp): a dozen ATen ops
        cost tens of microseconds each between two decode steps' weight streams.
        """
        cand_logits, cand_ids = ops.top_k(logits, meta.max_top_k)  # [B, K] each, descending
        noise = ops.candidate_noise(cand_ids, meta.vocab_size, meta.generators, self.generator)  # [B, K]
        if cpu_kernels.samples_on_cpu(cand_logits):
            return cpu_kernels.sample_candidates(cand_logits, cand_ids, noise, meta.temperature, meta.top_k,
                                                 meta.top_p, meta.min_p)
        cand_logits.div_(meta.temperature.unsqueeze(1))
        ops.apply_top_k_sorted(cand_logits, meta.top_k)
        if meta.top_p is not None:
            ops.apply_top_p_sorted(cand_logits, meta.top_p)
        if meta.min_p is not None:
            ops.apply_min_p(cand_logits, meta.min_p)
        probs = cand_logits.softmax(dim=-1)  # [B, K]
        return ops.exponential_race_on_candidates(probs, cand_ids, noise)

    def _has_nucleus_kernel(self, logits: torch.Tensor) -> bool:
        if self.nucleus_kernel is None:
            self.nucleus_kernel = logits.device.type == "cuda" and _nucleus_kernel_compiles(logits.device)
        return self.nucleus_kernel

    def _sample_nucleus(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The same draw as `probs` + `exponential_race` with top-p alone (the same noise, so the same tokens but
        for ties at a nucleus' edge), without sorting the vocabulary."""
        from llmserve.sample.triton_nucleus import nucleus_race  # Triton only where this path runs

        logits.div_(meta.temperature.unsqueeze(1))
        noise = ops.uniform_noise(logits.shape, logits.device, meta.generators, self.generator)  # [B, V]
        return nucleus_race(logits, noise, meta.top_p, meta.min_p)

    def _sample_rows_on_cpu(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The distribution of `probs` + `exponential_race` in one C++ op over whole rows (csrc/sampling_rows.cpp):
        top-p without a sort, and unseeded rows drawn by inverse CDF, with no noise over the vocabulary. Seeded rows
        race on their generator's noise as the other paths do, so their tokens do not depend on their batch."""
        if meta.top_k is not None:  # some random rows have no top-k (else the candidates path ran)
            ops.apply_top_k_only(logits, meta.top_k, meta.max_top_k)  # before the temperature: the same tokens
        uniforms = torch.empty(logits.shape[0], NUM_ROUNDS).uniform_(generator=self.generator)  # [B, R]
        race_noise, is_race = ops.seeded_noise(logits.shape, logits.device, meta.generators)  # [B, V], [B]
        return cpu_kernels.sample_rows(logits, meta.temperature, meta.top_p, meta.min_p, uniforms, race_noise,
                                       is_race, meta.is_greedy)

    @staticmethod
    def probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Processed logits [B, V] -> the random rows' distribution: temperature, top-k / top-p, min-p."""
        assert meta.temperature is not None
        logits.div_(meta.temperature.unsqueeze(1))
        logits = ops.apply_top_k_top_p(logits, meta.top_k, meta.max_top_k, meta.top_p)
        if meta.min_p is not None:
            ops.apply_min_p(logits, meta.min_p)
        return logits.softmax(dim=-1)


def _nucleus_kernel_compiles(device: torch.device) -> bool:
    from llmserve.sample import triton_nucleus  # Triton only where this path runs

    return triton_nucleus.compiles_on(device)


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """In place: logit_bias and min_tokens masks (one sparse add), then penalties."""
    if meta.sparse_bias_indices is not None:
        ops.apply_sparse_bias(logits, meta.sparse_bias_indices, meta.sparse_bias_values)
    if meta.penalties is not None:
        ops.apply_penalties(logits, meta.penalties)


LOGPROB_FLOOR = -9999.0


def gather_logprobs(raw_logprobs: torch.Tensor, num_logprobs: int, sampled: torch.Tensor) -> LogprobsTensors:
    """raw_logprobs [B, V], sampled [B] -> the sampled token's logprob and rank, then the top-k."""
    top_logprobs, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)  # [B, k] each
    sampled_ids = sampled.unsqueeze(1)  # [B, 1]
    sampled_logprobs = raw_logprobs.gather(1, sampled_ids)  # [B, 1]
    ranks = (raw_logprobs > sampled_logprobs).sum(dim=-1) + 1  # [B]
    return LogprobsTensors(
        token_ids=torch.cat([sampled_ids, top_ids], dim=1),
        # a token a grammar forbids has logprob -inf; JSON has no -inf, so report vLLM's floor instead
        logprobs=torch.cat([sampled_logprobs, top_logprobs], dim=1).clamp_(min=LOGPROB_FLOOR),
        sampled_ranks=ranks,
    )
