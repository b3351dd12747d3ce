"""A worker's settings beyond its engine's (the CLI's flag table fills them; defaults live
here and in EngineConfig only). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..engine.config import EngineConfig
from ..rpc.config import ServiceConfig


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    service: ServiceConfig = field(default_factory=lambda: ServiceConfig("127.0.0.1:50061"))
    engine_id: str = ""  # unique per process start: the CLI adds a random suffix
    kv_transport: str | None = None  # "nixl" or "grpc"; the CLI picks NIXL when it loads
    max_queue: int | None = None  # waiting requests; default 4 x max_num_seqs
    threads: int | None = None  # torch intra-op threads; default torch's choice, or len(cpus)
    cpus: str | None = None  # the cores it runs on, as taskset lists them ("0", "2-3,6")
    inject_kv_failure: str | None = None  # test hook: every KV pull fails with this
    # A step (or call) on the engine thread that has not ended after this many seconds
    # means a hung kernel or a stuck lock: health NOT_SERVING until it ends. Long enough
    # for a legitimate slow step: a first decode may build the CPU kernel.
    engine_stall_timeout: float = 120.0
    # Start a prefill or decode worker that listens beyond loopback with nothing to tell
    # its cluster from strangers (check_cluster_auth): a dev setup on a trusted network.
    insecure_no_cluster_auth: bool = False

    def __post_init__(self) -> None:
        # The engine's copy of the cluster secret and of the opt-out (tensor parallelism
        # across hosts, the KV tiers' MAC): one setting, read where the service reads it.
        engine = replace(self.engine,
                         cluster_token=self.service.cluster_secret() or self.engine.cluster_token,
                         insecure_no_cluster_auth=self.insecure_no_cluster_auth
                         or self.engine.insecure_no_cluster_auth)
        if engine != self.engine:
            object.__setattr__(self, "engine", engine)
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue!r}")
        if self.engine_stall_timeout <= 0:
            raise ValueError(f"engine_stall_timeout must be > 0, got "
                             f"{self.engine_stall_timeout!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads!r}")
        if self.cpus is not None:
            parse_cpus(self.cpus)  # ValueError now, not once the model has loaded

    @property
    def cpu_set(self) -> set[int] | None:
        """`cpus` as a set of core numbers; None where unset."""
        return None if self.cpus is None else parse_cpus(self.cpus)

    def check_cluster_auth(self) -> None:
        """For a prefill or decode worker (the colocated role has no cluster): ValueError
        when it would listen beyond loopback with neither a cluster token nor mutual TLS,
        where anyone who reaches it could load adapters from any path, read its KV events
        and blocks, or make it pull KV from an address of their choice."""
        svc = self.service
        if svc.local_only or svc.checks_callers or self.insecure_no_cluster_auth:
            return
        raise ValueError(
            f"this worker would listen on {svc.host} (beyond this machine) with neither a "
            "cluster token nor mutual TLS, so anyone who reaches it could call it: set "
            "--cluster-token-file (or BATON_CLUSTER_TOKEN), or --tls-ca with --tls-cert "
            "and --tls-key; or listen on loopback (--host 127.0.0.1); or start it open "
            "anyway with --insecure-no-cluster-auth")

    @property
    def max_waiting(self) -> int:
        return self.max_queue if self.max_queue is not None else 4 * self.engine.max_num_seqs


def parse_cpus(text: str) -> set[int]:
    """A CPU list as taskset and /sys write it ("0", "2-3", "0,4-6") -> its cores;
    ValueError naming the list where it does not parse."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or int(high or low) < int(low):
            raise ValueError(f"cpus {text!r}: want a list such as 0, 2-3 or 0,4-5")
        cores.update(range(int(low), int(high or low) + 1))
    return cores
