"""Starting the ranks of a tensor-parallel worker, and what the ranks past 0 do.

    node 0 (the worker):  rank 0 (the engine) + ranks 1 .. per_node - 1 (spawned here)
    node k > 0:           ranks k * per_node .. (k + 1) * per_node - 1 (`run_node`)

per_node = tensor_parallel_size / nnodes. Every rank joins the group at its rendezvous
(tp_join.py: a private file store on one host; `distributed_init_address`, or torch's
MASTER_ADDR and MASTER_PORT, and the cluster token across hosts), builds its own runner
over its share of the weights, and follows rank 0's steps until told to stop or until
rank 0 is gone.

A spawned rank reports on a pipe of its own that its code started, or the error that
stopped it; one that exits before it joined fails the join at once with that error (or,
where its code never ran, with what to do), and one that exits later is seen at once (its
process sentinel). A rank anywhere makes the next collective raise (parallel.RankDied):
the worker then stops serving.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing as mp
import multiprocessing.spawn
import os
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from .config import EngineConfig
from .forward import Forward
from .parallel import RankDied, TPGroup
from .tp_join import JoinError, Rendezvous

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0  # an idle rank 0 pings the other ranks this often
SPAWN_ADVICE = ("ranks past 0 are spawned processes, which import the main module again: "
                "start the engine from a script file whose work sits under `if __name__ == "
                "'__main__':`")


def rendezvous(config: EngineConfig) -> Rendezvous:
    """Where this worker's ranks meet: a private one on one host (rank 0 makes it and
    hands it to the ranks it spawns); across hosts, the address every node is given."""
    size = config.tensor_parallel_size
    if config.nnodes == 1:
        return Rendezvous.local(size)
    address = config.distributed_init_address
    if not address and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if not address:
        raise ValueError("--nnodes > 1 needs --distributed-init-address host:port (or "
                         "MASTER_ADDR and MASTER_PORT)")
    if not config.cluster_token and not config.insecure_no_cluster_auth:
        raise ValueError("tensor parallelism over several hosts (nnodes > 1) needs the "
                         "cluster token, which every rank proves before it joins: set "
                         "--cluster-token-file (or BATON_CLUSTER_TOKEN) on every node, or "
                         "start it open anyway with --insecure-no-cluster-auth")
    if not config.cluster_token:
        log.warning("tensor-parallel ranks over %d hosts with no cluster token "
                    "(--insecure-no-cluster-auth): any process that reaches %s can join "
                    "this worker's group", config.nnodes, address)
    return Rendezvous.over_hosts(address, size, config.cluster_token)


def per_node(config: EngineConfig) -> int:
    return config.tensor_parallel_size // config.nnodes


@dataclasses.dataclass
class Spawned:
    """A rank this process started, and the pipe on which it reports."""

    rank: int
    proc: BaseProcess
    reports: Connection
    said: list = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def why(self) -> str:
        """Why it is gone: its exit code and its own error, or what to do where its code
        never ran (the spawn could not import the main module)."""
        with self.lock:
            while not self.reports.closed and self.reports.poll():
                try:
                    self.said.append(self.reports.recv())
                except (EOFError, OSError):
                    self.reports.close()
        errors = [text for kind, text in self.said if kind == "error"]
        head = f"tensor-parallel rank {self.rank} exited with code {self.proc.exitcode}"
        if errors:
            return f"{head}: {errors[-1]}"
        if not any(kind == "started" for kind, _ in self.said):
            return f"{head} before its code ran ({SPAWN_ADVICE}; its error is on stderr)"
        return head


def check_spawnable() -> None:
    """ValueError at once where a spawned rank could not start: the main module was not
    read from a file it can import again (a script piped to python, a notebook's cell)."""
    data = multiprocessing.spawn.get_preparation_data("baton-tp-rank")
    main = data.get("init_main_from_path")
    if main is not None and not os.path.isfile(main):
        raise ValueError(f"tensor_parallel_size > 1 cannot start its ranks from this "
                         f"program (its main module {os.path.basename(main)!r} is no file): "
                         f"{SPAWN_ADVICE}")


def spawn(config: EngineConfig, ranks: range, rdv: Rendezvous) -> list[Spawned]:
    """Processes following rank 0 as `ranks`, started."""
    if not ranks:
        return []
    check_spawnable()
    ctx = mp.get_context("spawn")
    out = []
    for rank in ranks:
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(target=follow, args=(config, rank, rdv, writer), daemon=True,
                        name=f"baton-tp-rank-{rank}")
        p.start()
        writer.close()
        out.append(Spawned(rank, p, reader))
    return out


def check_alive(spawned: list[Spawned]) -> None:
    """JoinError, with its own error, for the first rank of `spawned` that is gone."""
    for s in spawned:
        if not s.proc.is_alive():
            s.proc.join()
            raise JoinError(s.why())


class Ranks:
    """Rank 0's group and the ranks it spawned on its host."""

    def __init__(self, config: EngineConfig):
        rdv = rendezvous(config)
        self.spawned: list[Spawned] = []
        self._stopping = False
        try:
            self.spawned = spawn(config, range(1, per_node(config)), rdv)
            self.group = TPGroup(rdv, 0, config.torch_device,
                                 alive=lambda: check_alive(self.spawned))
            self.group.explain = self._explain
        except BaseException:
            self.stop()
            raise
        finally:
            rdv.remove()  # every rank is past it, or none will use it
        self._last_beat = time.monotonic()
        threading.Thread(target=self._watch, daemon=True, name="tp-rank-watch").start()

    @property
    def procs(self) -> list[BaseProcess]:
        return [s.proc for s in self.spawned]

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
            self.group.send("ping")
        except RankDied:
            pass  # the group is marked dead and its hooks ran

    def _explain(self) -> str | None:
        """A spawned rank's own error, where one has exited (one whose sockets just
        closed is exiting: waited for briefly)."""
        for s in self.spawned:
            s.proc.join(timeout=1.0)
            if not s.proc.is_alive():
                return s.why()
        return None

    def _watch(self) -> None:
        if not self.spawned:
            return
        done = wait([s.proc.sentinel for s in self.spawned])
        if self._stopping:
            return
        gone = next(s for s in self.spawned if s.proc.sentinel in done)
        gone.proc.join()
        why = gone.why()
        log.error("%s: this worker cannot run another step", why)
        self.group.died(why)

    def stop(self) -> None:
        """Tell every rank to leave, and reap the spawned ones (killed if they linger)."""
        if self._stopping:
            return
        self._stopping = True
        group = getattr(self, "group", None)
        if group is not None and self.dead is None:
            try:
                group.send("stop")
            except (RankDied, RuntimeError):  # a rank that failed as it started
                pass
        for s in self.spawned:
            s.proc.join(timeout=10 if group is not None else 0)
            if s.proc.is_alive():
                s.proc.kill()
                s.proc.join()


def follow(config: EngineConfig, rank: int, rdv: Rendezvous,
           reports: Connection | None = None, spawned: bool = True,
           alive=lambda: None) -> None:
    """A rank past 0: join, load its share, then run what rank 0 sends until "stop". A
    spawned rank says on `reports` that it started, and the error that stops it."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(message)s")
    if reports is not None:
        reports.send(("started", ""))
    try:
        _follow(config, rank, rdv, spawned, alive)
    except BaseException as e:
        if reports is not None and not isinstance(e, SystemExit):
            reports.send(("error", "".join(traceback.format_exception_only(e)).strip()))
        raise


def _follow(config: EngineConfig, rank: int, rdv: Rendezvous, spawned: bool,
            alive) -> None:
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

    group = TPGroup(rdv, rank, config.torch_device, alive)
    _, runner, _ = load_runner(config, group)
    try:
        while True:
            kind, args = group.recv()
            if kind == "forward":
                runner.forward(Forward.from_wire(args[0]))
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
                gc.freeze()  # nothing left to collect as the process exits (cli/main.py)
                return
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
    rdv = rendezvous(config)
    spawned = spawn(config, range(first + 1, first + per_node(config)), rdv)
    try:
        follow(config, first, rdv, spawned=False, alive=lambda: check_alive(spawned))
    finally:
        for s in spawned:
            s.proc.join(timeout=10)
            if s.proc.is_alive():
                s.proc.kill()
