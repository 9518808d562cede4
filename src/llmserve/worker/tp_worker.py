"""Ranks 1..N-1 of a tensor-parallel engine: one process each, spawned by rank 0 (worker/tp_executor.py).

A rank joins the process group (NCCL on CUDA, gloo on CPU) through rank 0's TCPStore, builds its Worker
(its slice of the model and its KV heads' cache), subscribes to the step broadcast and runs every step
rank 0 runs: the same inputs, the same forward with its collectives, the sampled ids from rank 0.
A start-up error is written to the store under `error/<rank>`, for rank 0 to report.
"""

from __future__ import annotations

import logging
import os
import signal
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist
import zmq

from llmserve.config import EngineConfig
from llmserve.model.loader import ModelInfo
from llmserve.model.parallel import TensorParallel
from llmserve.worker.model_runner import ModelRunner
from llmserve.worker.tp_broadcast import StepKind, StepSubscriber, scheduler_output

logger = logging.getLogger("llmserve.worker.tp_worker")

COLLECTIVE_TIMEOUT_S = 180  # a collective that waits longer fails (a rank hung); dead ranks are seen sooner


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r runs on cuda:r (CPU ranks share the host)."""
    if device.type != "cuda":
        return device
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def store_timeout() -> timedelta:
    return timedelta(seconds=COLLECTIVE_TIMEOUT_S)


def init_rank(store: dist.Store, rank: int, config: EngineConfig, device: torch.device) -> TensorParallel:
    backend = "nccl" if device.type == "cuda" else "gloo"
    size = config.parallel.tensor_parallel_size
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=store_timeout())
    return TensorParallel(rank, size, is_expert_parallel=config.parallel.enable_expert_parallel,
                          all2all_backend=config.parallel.all2all_backend)


def run_tp_worker(config_bytes: bytes, info_bytes: bytes, dtype: str, rank: int, store_port: int,
                  step_address: str, parent_pid: int) -> None:
    """Entry of a spawned rank. `config_bytes`: the engine's EngineConfig (its scheduler defaults resolved)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when ranks stop
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [tp rank {rank}] %(message)s")
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    info = msgspec.msgpack.decode(info_bytes, type=ModelInfo)
    size = config.parallel.tensor_parallel_size
    store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False, timeout=store_timeout())
    ctx = zmq.Context()
    try:
        runner, subscriber = _start(config, info, getattr(torch, dtype), rank, store, ctx, step_address, parent_pid)
    except Exception as e:  # noqa: BLE001 - rank 0 reports it
        logger.exception("tensor-parallel rank %d failed to start", rank)
        store.set(f"error/{rank}", f"{type(e).__name__}: {e}")
        os._exit(1)
    try:
        serve_steps(runner, subscriber)
    except Exception:  # noqa: BLE001 - a collective failed (another rank died or hung): rank 0 sees us exit
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    subscriber.close()
    dist.destroy_process_group()
    os._exit(0)


def _start(config: EngineConfig, info: ModelInfo, dtype: torch.dtype, rank: int, store: dist.Store,
           ctx: zmq.Context, step_address: str, parent_pid: int) -> tuple[ModelRunner, StepSubscriber]:
    from llmserve.worker.worker import Worker, resolve_device

    device = rank_device(resolve_device(config.model.device), rank)
    store.set(f"joined/{rank}", "1")
    tp = init_rank(store, rank, config, device)
    worker = Worker(config, info, info.path, device, dtype, tp=tp)
    return worker.runner, StepSubscriber(ctx, step_address, parent_pid)


def serve_steps(runner: ModelRunner, subscriber: StepSubscriber) -> None:
    """Run what rank 0 broadcasts until SHUTDOWN (or rank 0's process is gone). A step is launched and
    finished at once: its collectives all happen at launch, in rank 0's order."""
    while True:
        kind, payload = subscriber.receive()
        if kind == StepKind.EXECUTE:
            runner.execute(scheduler_output(payload))
        elif kind == StepKind.DROP:
            runner.drop_finished(set(payload))
        elif kind == StepKind.READ_ADAPTER:
            runner.lora.is_in_memory(payload)  # starts this rank's read unless it holds the adapter already
        else:
            return
