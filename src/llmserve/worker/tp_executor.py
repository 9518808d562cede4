"""Rank 0 of a tensor-parallel engine, in the engine-core process: it spawns ranks 1..N-1, holds its
own Worker, and runs each step after broadcasting it.

Where things run (N = --tensor-parallel-size):
  engine-core process = rank 0: scheduler, step loop, its slice of the model and KV cache, the sampler.
  N - 1 rank processes (worker/tp_worker.py): their slices, no scheduler, no sampler.
A step: the scheduler's output goes to the ranks over the step broadcast (worker/tp_broadcast.py, ZMQ
+ msgspec); every rank runs the forward (two all-reduces per layer, one all-gather of the logits);
rank 0 samples and broadcasts the ids (torch.distributed), which the ranks append to their batches.

The engine core calls the executor where it would call the runner (launch / finish / execute /
drop_finished); with N = 1 there is no executor and the runner is called directly.

Failure: a monitor thread waits on the ranks' process sentinels. A rank that dies makes the next step
raise WorkerDied at once, and a step that fails in a collective is reported as that rank's death; in
the engine-core process `on_failure` also ends the process at once (a collective on NCCL would
otherwise wait for its timeout). Collectives time out after COLLECTIVE_TIMEOUT_S (a hung rank).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
from collections.abc import Callable
from functools import partial

import msgspec
import torch
import torch.distributed as dist
import zmq

from llmserve.config import EngineConfig
from llmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from llmserve.model.loader import ModelInfo
from llmserve.worker.step_handle import StepHandle
from llmserve.worker.tp_broadcast import StepPublisher
from llmserve.worker.tp_worker import init_rank, rank_device, run_tp_worker, store_timeout
from llmserve.worker.worker import Worker

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # ranks load their slices meanwhile
DEATH_GRACE_S = 2.0  # after a failed collective, how long to wait for the rank's exit to show


class WorkerDied(RuntimeError):
    """A tensor-parallel rank's process ended: the engine cannot go on."""


DIED_BEFORE_OUR_CODE = ("it died before running llmserve's code; a spawned rank first imports the main module, "
                        "so a script must create the LLM under `if __name__ == \"__main__\":`")


@contextlib.contextmanager
def hide_missing_main_file():
    """While ranks start: a spawned process re-runs the parent's main module from its file, and from
    `python -` (stdin) or an interactive session that "file" does not exist, so the rank would die before
    running any of our code. The ranks need nothing from the main module (their target is llmserve's):
    such a path is hidden from multiprocessing while they start, then restored."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(main, "__spec__", None) is not None or os.path.isfile(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


class TPExecutor:
    def __init__(self, config: EngineConfig, model_info: ModelInfo, device: torch.device, dtype: torch.dtype,
                 is_served: bool = False) -> None:
        size = config.parallel.tensor_parallel_size
        self.ctx = zmq.Context()
        self.publisher = StepPublisher(self.ctx)
        self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                   timeout=store_timeout())
        self.procs = self._spawn(config, model_info, dtype, size)
        self.on_failure: Callable[[str], None] | None = None  # called from the monitor thread
        self.is_closed = False
        # The monitor thread and the step thread both ask why a rank died; reaping a child (waitpid) from
        # two threads at once leaves one of them without its exit status, so one asks at a time and the
        # first answer is kept.
        self._death_lock = threading.Lock()
        self._death_reason: str | None = None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        try:
            self._wait_joined(size, deadline)
            device = rank_device(device, 0)
            self.tp = init_rank(self.store, 0, config, device)
            self.worker = Worker(config, model_info, model_info.path, device, dtype, is_served, self.tp)
            self.publisher.wait_for_subscribers(size - 1, deadline, self.check_workers)
        except Exception as e:
            reason = self._death(DEATH_GRACE_S)
            self.shutdown()
            if reason is not None:
                raise WorkerDied(reason) from e
            raise
        self.runner = self.worker.runner
        if self.runner.lora is not None:  # the other ranks read an adapter when rank 0 starts to
            self.runner.lora.reader.on_start = self.publisher.read_adapter
        self._monitor_wake, self._monitor_stop = multiprocessing.Pipe(duplex=False)
        threading.Thread(target=self._monitor, daemon=True, name="tp-monitor").start()

    def _spawn(self, config: EngineConfig, model_info: ModelInfo, dtype: torch.dtype,
               size: int) -> list[multiprocessing.process.BaseProcess]:
        ctx = multiprocessing.get_context("spawn")
        args = (msgspec.msgpack.encode(config), msgspec.msgpack.encode(model_info), str(dtype).removeprefix("torch."))
        parent_pid = multiprocessing.current_process().pid
        procs = [ctx.Process(target=run_tp_worker, name=f"llmserve-tp-rank{rank}", daemon=True,
                             args=(*args, rank, self.store.port, self.publisher.address, parent_pid))
                 for rank in range(1, size)]
        with hide_missing_main_file():
            for proc in procs:
                proc.start()
        return procs

    def _wait_joined(self, size: int, deadline: float) -> None:
        """Until every rank is about to join the process group (a rank that dies before is reported now,
        not after the group's timeout)."""
        keys = [f"joined/{rank}" for rank in range(1, size)]
        while not self.store.check(keys):
            self.check_workers()
            if time.monotonic() > deadline:
                raise TimeoutError("tensor-parallel ranks did not start in time")
            time.sleep(0.05)

    # ---- the runner's interface -------------------------------------------------------------------

    def launch(self, sched_out: SchedulerOutput, finishes_at_once: bool = False,
               catch_up: Callable[[], None] | None = None) -> StepHandle:
        self.check_workers()
        self.publisher.execute(sched_out)
        return self._guarded(partial(self.runner.launch, finishes_at_once=finishes_at_once, catch_up=catch_up),
                             sched_out)

    def finish(self, handle: StepHandle) -> ModelRunnerOutput:
        return self._guarded(self.runner.finish, handle)

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """The step on every rank at once (the other ranks run `ModelRunner.execute` too: serve_steps)."""
        self.check_workers()
        self.publisher.execute(sched_out)
        return self._guarded(self.runner.execute, sched_out)

    def drop_finished(self, req_ids: set[str]) -> None:
        if req_ids:
            self.publisher.drop(req_ids)
        self.runner.drop_finished(req_ids)

    def _guarded(self, call, arg):
        """A collective that fails because a rank died says which rank."""
        try:
            return call(arg)
        except Exception as e:
            reason = self._death(DEATH_GRACE_S)
            if reason is not None:
                raise WorkerDied(reason) from e
            raise

    # ---- failure ----------------------------------------------------------------------------------

    def check_workers(self) -> None:
        reason = self._death(0)
        if reason is not None:
            raise WorkerDied(reason)

    def _death(self, timeout: float) -> str | None:
        """Why the first dead rank died (waiting up to `timeout` for one), or None while all live."""
        if self._death_reason is not None:
            return self._death_reason
        dead = multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout)
        with self._death_lock:
            if self._death_reason is None:
                self._death_reason = self._first_death(dead)
            return self._death_reason

    def _first_death(self, dead: list) -> str | None:
        for rank, proc in enumerate(self.procs, start=1):
            if proc.sentinel in dead:
                proc.join(1.0)  # the sentinel closes a moment before the exit status exists
                error = self.store.get(f"error/{rank}").decode() if self.store.check([f"error/{rank}"]) else None
                detail = f": {error}" if error else f": {DIED_BEFORE_OUR_CODE}"
                return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}{detail}"
        return None

    def _monitor(self) -> None:
        sentinels = [p.sentinel for p in self.procs]
        ready = multiprocessing.connection.wait([*sentinels, self._monitor_wake])
        if self._monitor_wake in ready or self.is_closed:
            return
        reason = self._death(0) or "a tensor-parallel rank exited"
        logger.error("%s; the engine stops", reason)
        if self.on_failure is not None:
            self.on_failure(reason)

    # ---- shutdown ---------------------------------------------------------------------------------

    def kill_ranks(self) -> None:
        """The process is about to exit without a clean shutdown (a rank died): end the other ranks now."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the ranks to exit, kill those that do not within `timeout`, leave the process group."""
        if self.is_closed:
            return
        self.is_closed = True
        if hasattr(self, "_monitor_stop"):  # started
            self._monitor_stop.send(None)
        self.publisher.shutdown()
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.publisher.close()
        self.ctx.term()
        if dist.is_initialized():
            dist.destroy_process_group()
