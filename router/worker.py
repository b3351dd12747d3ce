"""A worker as the router knows it: its address and client, its state and last stats
(registry.py polls them), its prefix cache as known (kv_index.py), its pairs.

Load score, as vLLM's data-parallel balancer: waiting * 4 + running, from its last stats,
plus the requests routed to it since (counted as waiting), so a burst between two polls
spreads out. Its queued prefill tokens likewise: its last stats', plus the prompt tokens
routed to it to compute since.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.worker.v1 import worker_pb2 as wk

from .clients import WorkerClient
from .kv_index import PrefixIndex


@dataclass
class Worker:
    address: str
    role: str
    client: WorkerClient
    state: str = "unknown"  # "unknown" until its first poll, then up / draining / down
    stats: wk.GetStatsResponse | None = None
    last_seen: float = 0.0  # monotonic time of the last answered poll
    routed: int = 0  # requests sent since the last stats poll
    routed_tokens: int = 0  # prompt tokens sent to compute there since the last poll
    pairs: dict[str, str | None] = field(default_factory=dict)  # prefill engine id -> error
    index: PrefixIndex = field(default_factory=PrefixIndex)  # its prefix cache, as known
    kv_events: bool = True  # it answers GetKvEvents
    target: str = ""  # the --prefill/--decode value that found it ("": given as a client)

    @property
    def engine_id(self) -> str | None:
        return self.stats.engine_id if self.stats is not None else None

    @property
    def score(self) -> int:
        s = self.stats
        waiting = (s.num_waiting + s.num_loading if s else 0) + self.routed
        return waiting * 4 + (s.num_running if s else 0)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens it has yet to compute: its last stats', and those routed since."""
        s = self.stats
        return (s.num_queued_prefill_tokens if s else 0) + self.routed_tokens
