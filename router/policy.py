"""Which worker gets a request, and whether its prompt needs a prefill worker at all.

A worker's cost for a prompt, in tokens of work:

    cost = kv_weight * (prompt tokens it does not hold)  +  load_weight * load
           (+ load_weight, for a LoRA adapter it does not serve yet: it reads it first)

where "holds" is the leading blocks its prefix cache has (router/kv_index.py) and load
is the registry's score ((waiting + loading + routed since the last poll) * 4 + running).
A prefill worker that holds the prefix computes less; a decode worker that holds it pulls
less. Blocks in a worker's offload tiers that continue its pool's run count in part:

    held (blocks) = pool blocks + host_weight * host blocks + disk_weight * disk blocks

each block of that tier run counted by the medium its engine would load it from.

With kv_weight 0 this is load-only routing. The lowest cost wins; the defaults are
measured on W4 (docs/benchmarks.md).

Where a prompt is computed (`disaggregation`): "always" on a prefill worker (a decode
worker only when none can: router/fallback.py's faults), "never" on the decode worker
that streams it, and "auto" per prompt (conditional disaggregation): the decode worker
chosen for it computes it itself (no prefill worker, no KV moved) when

    short_prompt   what it lacks of the prompt is at most `local_prefill_tokens`
    prefix_cached  its KV events say it holds at least `local_prefill_hit` of the blocks
                   it could reuse
    prefill_queue  the least loaded prefill worker's queued prompt tokens (with this
                   prompt's) exceed `local_prefill_queue` x (1 + its streams) times the
                   decode worker's (with this prompt's): the prompt would wait longer
                   there than it and the decode worker's running streams, each stalled
                   while it computes, lose to computing it here

The defaults come from the goodput benchmark's sweep (docs/benchmarks.md, issue 53).
"""

from __future__ import annotations

from dataclasses import dataclass

from .kv_index import PromptBlocks

# What a block found in an offload tier is worth against one in the pool (1) and a miss
# (0): the share of its prefill that loading it saves, 1 - load time / compute time. For
# a 16-token block of an 8B model (2 MB of KV at bf16) on one H100: about 0.4 ms to
# compute, 0.1 ms to copy from pinned host memory at ~25 GB/s, 0.3 ms or more to read
# from an NVMe disk at ~6 GB/s: about 0.75 and 0.1 to 0.25 when loads run at full speed.
# Host's default is lower (a load is one more step the prefill waits on, and the tier's
# events are as old as the last poll); disk's keeps pool > host > disk > miss with room
# between each. On a CPU worker computing is far slower and either tier saves nearly all:
# raise both there. Not yet measured on Baton.
HOST_WEIGHT = 0.5
DISK_WEIGHT = 0.25
DISAGGREGATION = ("auto", "always", "never")
LOCAL_PREFILL_TOKENS = 32  # docs/benchmarks.md, issue 53
LOCAL_PREFILL_QUEUE = 4.0  # docs/benchmarks.md, issue 53


@dataclass(frozen=True)
class Policy:
    kv_weight: float = 1.0
    load_weight: float = 64.0
    host_weight: float = HOST_WEIGHT
    disk_weight: float = DISK_WEIGHT
    disaggregation: str = "auto"
    local_prefill_tokens: int = LOCAL_PREFILL_TOKENS
    local_prefill_hit: float = 0.9
    local_prefill_queue: float = LOCAL_PREFILL_QUEUE

    @property
    def uses_kv(self) -> bool:
        return self.kv_weight > 0 or self.local_prefill_hit > 0

    def matched(self, worker, prompt: PromptBlocks | None, confirmed: bool = False) -> int:
        """Leading prompt blocks `worker`'s pool holds, as far as the router knows
        (`confirmed`: by its own KV events, not by the router's predictions). Its tiers'
        do not count: a response's expected_cached_blocks and conditional disaggregation
        stay the pool's."""
        if prompt is None or not self.uses_kv:
            return 0
        return worker.index.match(prompt, confirmed=confirmed)

    def held(self, worker, prompt: PromptBlocks | None, tiers: bool = True) -> float:
        """The prompt's blocks `worker` holds, those of its tiers weighted (above)."""
        if prompt is None or not self.uses_kv:
            return 0.0
        hit = worker.index.hit(prompt)
        if not tiers:
            return hit.pool
        return hit.pool + self.host_weight * hit.host + self.disk_weight * hit.disk

    def uncached(self, worker, prompt: PromptBlocks | None, tiers: bool = True) -> float:
        if prompt is None:
            return 0
        held = self.held(worker, prompt, tiers)
        return len(prompt.token_ids) - held * worker.index.block_size

    def cost(self, worker, prompt: PromptBlocks | None, tiers: bool = True) -> float:
        """`tiers=False` for a decode worker that pulls the prompt: what its pool holds
        shortens the pull, its tiers do not (a pulled prompt is never loaded from them)."""
        kv = self.kv_weight * self.uncached(worker, prompt, tiers) if self.kv_weight else 0.0
        load = worker.score + (prompt is not None and bool(prompt.lora)
                               and not _serves(worker, prompt.lora))
        return kv + self.load_weight * load

    def local_prefill(self, worker, prompt: PromptBlocks, prefills: list) -> str | None:
        """Why decode worker `worker` should compute `prompt` itself rather than one of
        `prefills` (the prefill workers up), by `disaggregation`; None: a prefill worker
        computes it. Confirmed blocks only: a prefix merely predicted there may still be
        on its way (pulled for the request routed just before), and a decode worker must
        not compute a whole prompt on a guess."""
        if self.disaggregation == "never":
            return "disaggregation_never"
        if self.disaggregation == "always" or not prefills:
            return None
        bs = worker.index.block_size
        held = self.matched(worker, prompt, confirmed=True)
        lacks = len(prompt.token_ids) - held * bs
        if self.local_prefill_tokens and lacks <= self.local_prefill_tokens:
            return "short_prompt"
        if self.local_prefill_hit and bs and prompt.reusable(bs) and \
                held >= self.local_prefill_hit * prompt.reusable(bs):
            return "prefix_cached"
        if self.local_prefill_queue:
            # Tokens of prefill ahead of the prompt, itself included, there and here; here
            # also stalls each stream the decode worker runs for as long as it computes,
            # so each of those weighs as much as the prompt's own wait.
            there = min(p.queued_prefill_tokens + self.uncached(p, prompt) for p in prefills)
            here = worker.queued_prefill_tokens + lacks
            streams = (worker.stats.num_running if worker.stats else 0) + worker.routed
            if there > self.local_prefill_queue * (1 + streams) * here:
                return "prefill_queue"
        return None


def _serves(worker, lora: str) -> bool:
    """Whether the worker's last stats list the adapter among those it serves."""
    return worker.stats is not None and lora in worker.stats.lora_adapters
