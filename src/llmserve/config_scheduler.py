"""The scheduler's settings (core/scheduler.py) and their defaults a device."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from llmserve.config_checks import check, check_field_choices, check_min

LARGE_GPU_MEMORY = 70 * 2**30  # an 80 GB card (H100, A100-80G) and up: vLLM's larger defaults
CPU_SCHEDULER_STEPS = 64  # decode forwards a CPU engine step may run (SchedulerConfig.num_scheduler_steps)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int | None = field(default=None, metadata={"help": "most requests running at once (default: 128 on "
                                     "CPU; on CUDA 1024 with 70 GiB of device memory or more, else 256)"})
    max_num_batched_tokens: int | None = field(default=None, metadata={"help": "token budget of one engine step "
                                               "(default: on CUDA 8192 with 70 GiB of device memory or more, else 2048; "
                                               "512 on CPU, where 2,048 tokens are seconds of compute: shorter steps "
                                               "give earlier first tokens, shorter stalls)"})
    enable_chunked_prefill: bool = field(default=True, metadata={"help": "split long prompts across steps"})
    max_prefill_tokens_while_decoding: int | None = field(default=None, metadata={"help": "while requests decode, at most this many prompt tokens per step: bounds inter-token latency (default: the whole token budget)"})
    max_num_partial_prefills: int = field(default=1, metadata={"help": "with chunked prefill, the most prompts "
                                          "prefilled in one step, sharing its token budget (1: a running long prompt "
                                          "takes the whole budget and shorter ones wait for its last chunk)"})
    max_long_partial_prefills: int = field(default=1, metadata={"help": "with chunked prefill, the most prompts "
                                           "longer than --long-prefill-token-threshold prefilled at once; below "
                                           "--max-num-partial-prefills, shorter prompts go ahead of waiting long ones"})
    long_prefill_token_threshold: int = field(default=0, metadata={"help": "with chunked prefill, a prompt with more "
                                              "tokens than this left is long, and its chunks are at most this many "
                                              "tokens (0: none is long, or with --max-num-partial-prefills > 1, 4%% of "
                                              "--max-model-len)"})
    policy: str = field(default="fcfs", metadata={"help": "fcfs | priority", "choices": ["fcfs", "priority"],
                                                  "flag": "scheduling-policy", "aliases": ["policy"]})
    async_scheduling: bool | None = field(default=None, metadata={"help": "schedule and prepare step N+1 while the "
                                          "device runs step N (default: on for CUDA, off on CPU, where the host is "
                                          "the device and nothing overlaps)"})
    num_scheduler_steps: int | None = field(default=None, metadata={"help": "decode forwards one engine step may "
                                            "run back to back when no request watches its tokens one by one (every "
                                            "running request reports only its final output, as offline generate's "
                                            "do; the server reads every token), none waits for a free seat and none "
                                            "has drafts or a grammar: scheduling, bookkeeping and outputs once per "
                                            f"this many tokens (default: {CPU_SCHEDULER_STEPS} on CPU, where that host work "
                                            "competes with the forward; 1, off, with async scheduling, which "
                                            "overlaps it instead)"})

    def validate(self) -> None:
        check_field_choices(self)
        check_min("max-num-seqs", self.max_num_seqs, 1)
        check_min("num-scheduler-steps", self.num_scheduler_steps, 1)
        check(not (self.async_scheduling and (self.num_scheduler_steps or 1) > 1), "num-scheduler-steps",
              f"{self.num_scheduler_steps} runs without async scheduling: add --no-async-scheduling")
        check_min("max-num-batched-tokens", self.max_num_batched_tokens, 1)
        check_min("max-prefill-tokens-while-decoding", self.max_prefill_tokens_while_decoding, 1)
        self._validate_partial_prefills()

    def _validate_partial_prefills(self) -> None:
        check_min("max-num-partial-prefills", self.max_num_partial_prefills, 1)
        check(1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills, "max-long-partial-prefills",
              f"must be between 1 and --max-num-partial-prefills ({self.max_num_partial_prefills}), "
              f"got {self.max_long_partial_prefills}")
        check_min("long-prefill-token-threshold", self.long_prefill_token_threshold, 0)
        for flag, is_set in (("max-num-partial-prefills", self.max_num_partial_prefills > 1),
                             ("long-prefill-token-threshold", self.long_prefill_token_threshold > 0)):
            check(self.enable_chunked_prefill or not is_set, flag, "needs chunked prefill (--enable-chunked-prefill)")

    def for_device(self, device_type: str, device_memory: int = 0) -> SchedulerConfig:
        """This config with the device's defaults filled in (`device_memory`: bytes of a CUDA device)."""
        is_big_gpu = device_type == "cuda" and device_memory >= LARGE_GPU_MEMORY
        defaults = {"max_num_seqs": 128 if device_type != "cuda" else 1024 if is_big_gpu else 256,
                    "max_num_batched_tokens": 512 if device_type != "cuda" else 8192 if is_big_gpu else 2048,
                    "async_scheduling": device_type == "cuda" and (self.num_scheduler_steps or 1) == 1}
        is_async = defaults["async_scheduling"] if self.async_scheduling is None else self.async_scheduling
        defaults["num_scheduler_steps"] = 1 if is_async or device_type == "cuda" else CPU_SCHEDULER_STEPS
        unset = {name: value for name, value in defaults.items() if getattr(self, name) is None}
        return dataclasses.replace(self, **unset) if unset else self
