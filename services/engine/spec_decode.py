"""Speculative decoding with an n-gram (prompt lookup) proposer.

Before each step, every running request in decode proposes up to k draft tokens: the
tokens that followed the latest earlier occurrence of its last n tokens (n from ngram_max
down to ngram_min), in its prompt or output. The step runs the drafts after the request's
last token, so the model yields logits at k + 1 positions in one pass; the sampler then
keeps the longest prefix of drafts the target model agrees with, plus one token of its
own (sampler.py: `verify`). Greedy output is exactly the output without drafts.

    token_ids:  ... a b c d e ... a b c     last n = 3 tokens: "a b c"
                        ^^^^^ follower: d e ...  -> drafts [d, e, ...]

Per request, an index (ngram_index.py) finds the follower in O(max_n).

Speculation pays when a step is bound by fixed costs (weights read, Python, kernel
launches) rather than by the tokens it computes: at small batches. Above
`disable_batch_size` running decodes the step is compute-bound, k + 1 positions cost
nearly k + 1 times as much, and no request drafts (see docs/benchmarks.md, W5).
"""

from __future__ import annotations

from .config import SpecConfig
from .ngram_index import NgramIndex
from .request import Request


class NgramProposer:
    def __init__(self, config: SpecConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.num_drafts = 0  # request-steps that verified drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def propose(self, running: list[Request]) -> None:
        """Set `spec_token_ids` on each running request in decode (empty where there is
        no match, or where speculation does not pay)."""
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        if len(decoding) > self.config.disable_batch_size:
            for req in decoding:
                req.spec_token_ids = []
            return
        c = self.config
        for req in decoding:
            req.spec_token_ids = []
            p = req.params
            # A seeded random request keeps its generator's stream exactly as without
            # speculation (one draw per token, as migrations replay it): it never drafts.
            if req.kv_hold or (p.seed is not None and not p.greedy):
                continue
            # Room for the drafts and one more token, within max_tokens and the context.
            k = min(c.num_speculative_tokens, p.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens - 1)
            if k <= 0:
                continue
            if req.ngram_index is None:
                req.ngram_index = NgramIndex(c.ngram_min, c.ngram_max)
            drafts = req.ngram_index.propose(req.token_ids, k)
            if drafts and req.grammar is not None:
                drafts = req.grammar.valid_prefix(drafts)
            req.spec_token_ids = drafts

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            self.num_drafts += 1
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_accepted
