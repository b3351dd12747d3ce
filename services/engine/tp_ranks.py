"""Starting the ranks of a tensor-parallel worker, and what the ranks past 0 do.

    node 0 (the worker):  rank 0 (the engine) + ranks 1 .. per_node - 1 (spawned here)
    node k > 0:           ranks k * per_node .. (k + 1) * per_node - 1 (`run_node`)

per_node = tensor_parallel_size / nnodes. Every rank builds its own runner over its share
of the weights, joins the group at `distributed_init_address` (torch's MASTER_ADDR and
MASTER_PORT where the flag is not given; a free local port on one host), and follows
rank 0's steps until told to stop or until rank 0 is gone.

A spawned rank that exits is seen at once (its process sentinel), and a rank anywhere
makes the next collective raise (parallel.RankDied): the worker then stops serving.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import socket
import threading
import time
import weakref
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from .config import EngineConfig
from .parallel import RankDied, TPGroup

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0  # an idle rank 0 pings the other ranks this often


def init_address(config: EngineConfig) -> str:
    if config.distributed_init_address:
        return config.distributed_init_address
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if config.nnodes > 1:
        raise ValueError("--nnodes > 1 needs --distributed-init-address host:port (or "
                         "MASTER_ADDR and MASTER_PORT)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def per_node(config: EngineConfig) -> int:
    return config.tensor_parallel_size // config.nnodes


def spawn(config: EngineConfig, ranks: range, address: str) -> list[BaseProcess]:
    """Processes following rank 0 as `ranks`, started."""
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = [
        ctx.Process(target=follow, args=(config, rank, address), daemon=True,
                    name=f"baton-tp-rank-{rank}") for rank in ranks]
    for p in procs:
        p.start()
    return procs


class Ranks:
    """Rank 0's group and the ranks it spawned on its host."""

    def __init__(self, config: EngineConfig):
        address = init_address(config)
        self.procs = spawn(config, range(1, per_node(config)), address)
        self.group = TPGroup(address, 0, config.tensor_parallel_size, config.torch_device)
        self._stopping = False
        self._last_beat = time.monotonic()
        threading.Thread(target=self._watch, daemon=True, name="tp-rank-watch").start()

    @staticmethod
    def start(config: EngineConfig, owner: object) -> Ranks | None:
        """Rank 0's group with the ranks on its host started, stopped when `owner` (the
        engine) is collected; None on one rank."""
        if config.node_rank != 0:
            raise ValueError("an engine runs on node 0; a node past 0 runs only its ranks "
                             "(`baton worker --node-rank k` without a role)")
        if config.tensor_parallel_size == 1:
            return None
        ranks = Ranks(config)
        weakref.finalize(owner, ranks.stop)
        return ranks

    @property
    def dead(self) -> str | None:
        return self.group.dead

    def heartbeat(self) -> None:
        """Between steps (the engine thread, idle): a no-op message at most every
        HEARTBEAT_S, so a rank on another host that died is seen while no step runs (a
        send to its closed socket fails; the group then calls its on_death hooks)."""
        now = time.monotonic()
        if self.dead is not None or now - self._last_beat < HEARTBEAT_S:
            return
        self._last_beat = now
        try:
            self.group.send(("ping",))
        except RankDied:
            pass  # the group is marked dead and its hooks ran

    def _watch(self) -> None:
        if not self.procs:
            return
        done = wait([p.sentinel for p in self.procs])
        if self._stopping:
            return
        p = next(p for p in self.procs if p.sentinel in done)
        p.join()
        log.error("tensor-parallel %s exited with code %s: this worker cannot run another "
                  "step", p.name, p.exitcode)
        self.group.died(f"{p.name} exited with code {p.exitcode}")

    def stop(self) -> None:
        """Tell every rank to leave, and reap the spawned ones (killed if they linger)."""
        if self._stopping:
            return
        self._stopping = True
        if self.dead is None:
            try:
                self.group.send(("stop",))
            except (RankDied, RuntimeError):  # a rank that failed as it started
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def follow(config: EngineConfig, rank: int, address: str, spawned: bool = True) -> None:
    """A rank past 0: load its share, then run what rank 0 sends until "stop"."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(message)s")
    if spawned:
        _exit_with(os.getppid())
    import torch

    from .build import load_runner  # the model's modules: only in the rank's process

    if config.torch_device.type == "cuda":  # one GPU per rank of a host
        local = rank % per_node(config)
        config = dataclasses.replace(config, device=f"cuda:{local}")
        torch.cuda.set_device(local)
    elif "OMP_NUM_THREADS" not in os.environ:
        # The host's cores shared among its ranks (rank 0 keeps its process's setting,
        # --threads): more threads than cores make every rank wait for the slowest.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // per_node(config)))

    group = TPGroup(address, rank, config.tensor_parallel_size, config.torch_device)
    _, runner, _ = load_runner(config, group)
    try:
        while True:
            kind, *args = group.recv()
            if kind == "forward":
                runner.forward(args[0])
            elif kind == "allocate":
                runner.allocate_kv_cache(*args)
            elif kind == "ping":
                continue
            elif kind == "weights":
                runner.rank_weight_bytes()
            elif kind == "profile":
                runner.profile_num_blocks()
            elif kind == "capture":
                runner.maybe_capture_graphs(*args)
            elif kind == "stop":
                return
            else:
                raise ValueError(f"unknown tensor-parallel message {kind!r}")
    except RankDied as e:
        log.error("rank %d: %s; leaving", rank, e)
        os._exit(1)


def _exit_with(parent: int) -> None:
    """Leave when the process that started this rank is gone (killed: no stop came)."""
    if parent <= 1:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="tp-parent-watch").start()


def run_node(config: EngineConfig) -> None:
    """A node past 0 (`--node-rank k`): its ranks, until rank 0 stops them."""
    first = config.node_rank * per_node(config)
    address = init_address(config)
    procs = spawn(config, range(first + 1, first + per_node(config)), address)
    try:
        follow(config, first, address, spawned=False)
    finally:
        for p in procs:
            p.join(timeout=10)
