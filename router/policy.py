"""Which worker gets a request, and whether its prompt needs a prefill worker at all.

A worker's cost for a prompt, in tokens of work:

    cost = kv_weight * (prompt tokens it does not hold)  +  load_weight * load
           (+ load_weight, for a LoRA adapter it does not serve yet: it reads it first)

where "holds" is the leading blocks its prefix cache has (router/kv_index.py) and load
is the registry's score ((waiting + loading + routed since the last poll) * 4 + running).
A prefill worker that holds the prefix computes less; a decode worker that holds it pulls
less.
With kv_weight 0 this is load-only routing. The lowest cost wins; the defaults are
measured on W4 (docs/benchmarks.md).

Conditional disaggregation: the decode worker chosen for a prompt computes it itself
(no prefill worker, no KV moved) when what it lacks is at most `local_prefill_tokens`,
or its KV events say it holds at least `local_prefill_hit` of the blocks it could reuse
(0: never).
"""

from __future__ import annotations

from dataclasses import dataclass

from .kv_index import PromptBlocks


@dataclass(frozen=True)
class Policy:
    kv_weight: float = 1.0
    load_weight: float = 64.0
    local_prefill_tokens: int = 0
    local_prefill_hit: float = 0.9

    @property
    def uses_kv(self) -> bool:
        return self.kv_weight > 0 or self.local_prefill_hit > 0

    def matched(self, worker, prompt: PromptBlocks | None, confirmed: bool = False) -> int:
        """Leading prompt blocks `worker` holds, as far as the router knows (`confirmed`:
        by its own KV events, not by the router's predictions)."""
        if prompt is None or not self.uses_kv:
            return 0
        return worker.index.match(prompt, confirmed=confirmed)

    def uncached(self, worker, prompt: PromptBlocks | None) -> int:
        if prompt is None:
            return 0
        return len(prompt.token_ids) - self.matched(worker, prompt) * worker.index.block_size

    def cost(self, worker, prompt: PromptBlocks | None) -> float:
        kv = self.kv_weight * self.uncached(worker, prompt) if self.kv_weight else 0.0
        load = worker.score + (prompt is not None and bool(prompt.lora)
                               and not _serves(worker, prompt.lora))
        return kv + self.load_weight * load

    def local_prefill(self, worker, prompt: PromptBlocks) -> str | None:
        """Why decode worker `worker` should compute `prompt` itself ("short_prompt",
        "prefix_cached"), or None. Confirmed blocks only: a prefix merely predicted there
        may still be on its way (pulled for the request routed just before), and a decode
        worker must not compute a whole prompt on a guess."""
        bs = worker.index.block_size
        held = self.matched(worker, prompt, confirmed=True)
        if self.local_prefill_tokens and \
                len(prompt.token_ids) - held * bs <= self.local_prefill_tokens:
            return "short_prompt"
        if not self.local_prefill_hit or not bs or not prompt.reusable(bs):
            return None
        return "prefix_cached" if held >= self.local_prefill_hit * prompt.reusable(bs) else None


def _serves(worker, lora: str) -> bool:
    """Whether the worker's last stats list the adapter among those it serves."""
    return worker.stats is not None and lora in worker.stats.lora_adapters
