"""Grammar compilation off the engine's loop: one worker thread, one compile per distinct constraint.

Compiling a JSON schema against a 128k vocabulary takes a few hundred milliseconds on a CPU core, so the
engine never waits for one inside a step: requests whose grammar is not compiled yet wait beside the
queue (core.scheduler) while the steps of the others go on. Compiled grammars are kept by constraint
(StructuredOutputsParams.cache_key), least recently used first out.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from llmserve.messages import GrammarStats
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.structured.grammar import build_grammar

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (each a few MB at most for a large vocabulary)


class GrammarCompiler:
    """Compiles constraints for one tokenizer. `load_tokenizer()` runs on the worker thread at the first
    compile, so engines that never see a structured request never build the tokenizer's tables."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, eos_token_ids: list[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, num_threads: int = 1) -> None:
        """num_threads: xgrammar's threads for one compile (the engine's: worker/cpu_threads.xgrammar_threads)."""
        self.load_tokenizer = load_tokenizer
        self.num_threads = num_threads
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self.cache: OrderedDict[tuple, Future] = OrderedDict()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.stats = GrammarStats()
        self.lock = threading.Lock()  # stats are written by the worker thread too
        self._xgr_compiler = None

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar (done at once on a cache hit)."""
        key = params.cache_key
        future = self.cache.get(key)
        with self.lock:
            self.stats.num_queries += 1
            self.stats.num_hits += future is not None
        if future is None or (future.done() and future.exception() is not None):
            future = self.executor.submit(self._compile, params)
            self.cache[key] = future
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        self.cache.move_to_end(key)
        return future

    def take_stats(self) -> GrammarStats | None:
        """Cache queries, hits and new compiles since the last call; None when there were none (the
        engine asks every step, so an engine without structured requests pays one comparison)."""
        if not self.stats.num_queries and not self.stats.compile_seconds:
            return None
        with self.lock:
            stats, self.stats = self.stats, GrammarStats()
        return stats

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, params: StructuredOutputsParams):
        start = time.perf_counter()
        compiled = self._compiler().compile_grammar(build_grammar(params))
        with self.lock:
            self.stats.compile_seconds.append(time.perf_counter() - start)
        return compiled

    def _compiler(self):
        if self._xgr_compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.load_tokenizer(), vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids)
            self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=self.num_threads, cache_enabled=False)
        return self._xgr_compiler
