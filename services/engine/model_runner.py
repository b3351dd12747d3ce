"""Runs one scheduled step: flattens the batch, runs the model, samples.

The whole batch is one sequence with no padding (see kernels/metadata.py). Only the
requests whose computed count reaches their token count this step produce logits.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

import baton.kernels.backend as kernels
from baton.kernels import kv_layout
from baton.kernels.lora import LoraBatch

from ..common.sampling_params import SamplingParams
from ..lora.slots import LayerLora, LoraSlots
from .config import EngineConfig
from .cuda_graphs import CudaGraphRunner
from .forward import Forward, single_prefill_meta, zeros
from .model_config import ModelConfig
from .models import model_class
from .models.sharding import Shard
from .outputs import SampledTokens
from .parallel import TPGroup
from .quantization import apply as quantize_weights
from .quantization import stored_bytes
from .request import Request
from .sampler import Sampler, SamplingRow, to_device
from .scheduler import SchedulerOutput
from .structured_output import BatchMask
from .tp_cache import create as create_shared
from .tp_cache import map_all as map_shared
from .tp_cache import unlink_all as unlink_shared

log = logging.getLogger(__name__)


def kv_bytes_per_block(mc: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    # K and V, every layer, every slot of the block, as stored (`dtype`: the cache's).
    item = torch.empty((), dtype=dtype).element_size()
    return mc.num_layers * kv_layout.block_elements(mc.num_kv_heads, block_size,
                                                    mc.head_dim) * item


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, weights,
                 max_model_len: int, checkpoint: Path | None = None, tp: TPGroup | None = None):
        """`tp`: this rank's tensor-parallel group (None: one rank). Each rank builds its
        own runner over its share of the weights (models/sharding.py); rank 0's `run`
        sends every step to the others, whose `forward` runs it (tp_ranks.follow)."""
        self.config = config
        self.model_config = model_config  # the whole model's
        self.tp = tp
        self.shard = Shard(tp.rank, tp.size, model_config) if tp is not None else None
        # This rank's part of the model: its heads and MLP rows (all of it on one rank).
        self.mc = self.shard.local_config() if self.shard is not None else model_config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.kv_dtype = config.torch_kv_dtype  # the model's dtype, or fp8
        self.block_size = config.block_size
        self.backend = kernels.select_backend(
            self.device, config.attention_backend, block_size=config.block_size,
            head_dim=model_config.head_dim, dtype=self.dtype, kv_dtype=self.kv_dtype)
        cls = model_class(model_config.architecture)
        cuda = self.device.type == "cuda"
        before = torch.cuda.memory_allocated(self.device) if cuda else 0
        # Device memory outside this process's torch now: other processes and engines' own
        # CUDA contexts; what grows beyond it later is this engine's (see profile).
        self.outside_at_start = _outside_torch(self.device) if cuda else 0
        self.model = cls(model_config, max_model_len, self.dtype, self.device, self.backend,
                         self.shard, tp)
        self.model.load_weights(weights)
        if config.quantization is not None:
            if checkpoint is None:
                raise ValueError("quantization needs the checkpoint's path")
            quantize_weights(self.model, config.quantization, checkpoint)
        self.model.prepack_weights()
        self.model.eval()
        self.lora: LoraSlots | None = None
        if config.enable_lora:
            self.lora = LoraSlots(self.mc, config.max_loras, config.max_lora_rank,
                                  config.max_cpu_loras or 4 * config.max_loras, self.dtype,
                                  self.device, self.shard.take_lora if self.shard else None)
            for i, layer in enumerate(self.model.decoder_layers):
                layer.self_attn.lora = layer.mlp.lora = LayerLora(self.lora, i)
        # This engine's weights on the device (other engines in the process not counted).
        self.weight_bytes = torch.cuda.memory_allocated(self.device) - before if cuda else 0
        gen = torch.Generator(device=self.device).manual_seed(config.seed)
        self.sampler = Sampler(gen)
        self.kv_caches: list[torch.Tensor] = []
        self._rank_caches: list[list[torch.Tensor]] = []  # every rank's, where visible
        self.graphs: CudaGraphRunner | None = None
        self.mask = BatchMask(model_config.vocab_size)

    def rank_weight_bytes(self) -> list[int]:
        """Each rank's weights as stored, in rank order (rank 0 asks the others)."""
        if self.tp is None:
            return [stored_bytes(self.model)]
        if self.tp.rank == 0:
            self.tp.send("weights")
        return self.tp.gather_ints(stored_bytes(self.model))

    def profile_num_blocks(self) -> int:
        """How many KV blocks the memory budget holds."""
        per_block = kv_bytes_per_block(self.mc, self.block_size, self.kv_dtype)
        if self.device.type != "cuda":  # kv_cache_gib per rank, as vLLM's budget per GPU
            return int(self.config.kv_cache_gib * (1 << 30)) // per_block
        if self.tp is not None:  # every rank profiles its own device; the least wins
            if self.tp.rank == 0:
                self.tp.send("profile")
            return self.tp.min(self._profile_cuda(per_block))
        return self._profile_cuda(per_block)

    def _profile_cuda(self, per_block: int) -> int:
        # GPU: run the largest batch once without a cache, and sample max_num_seqs rows
        # (top-p's sort is the sampler's largest temporary), to find this engine's peak
        # activation memory. Then, as vLLM reads gpu_memory_utilization (this engine's
        # share of the device, whatever else runs on it):
        #     KV = total * utilization - weights - peak activations - what memory outside
        #          torch grew by since this engine started (cuBLAS workspaces, ...)
        # and never more than can still be allocated, less room for the activations and
        # the CUDA graphs' pool (no larger than the activations: batches <= the profile's).
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.config.max_num_batched_tokens
        one_block = kv_layout.shape(1, self.mc.num_kv_heads, self.block_size, self.mc.head_dim)
        dummy = [torch.zeros(one_block, dtype=self.kv_dtype, device=self.device)
                 for _ in range(self.mc.num_layers)]
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        meta = single_prefill_meta(n, self.block_size, self.device)
        with torch.inference_mode():
            # Positions wrap at the RoPE table's length (max_model_len may be < n).
            positions = torch.arange(n, device=self.device) % self.model.rope.cos.shape[0]
            hidden = self.model(ids, positions, dummy, meta)
            rows = min(n, self.config.max_num_seqs)
            logits = self.model.compute_logits(hidden[:rows])
            if self.tp is None or self.tp.rank == 0:
                params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
                self.sampler.sample(logits, [SamplingRow(params, None, [], [])] * rows)
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - base
        del dummy, hidden, logits
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        outside = max(0, _outside_torch(self.device) - self.outside_at_start)
        own = self.weight_bytes + activations
        budget = int(total * self.config.gpu_memory_utilization) - own - outside
        allocatable = free + reserved - torch.cuda.memory_allocated(self.device)
        budget = min(budget, allocatable - 2 * activations)
        log.info("KV budget %.2f GiB of %.2f GiB: weights %.2f, activations %.2f, new "
                 "outside torch %.2f GiB", budget / 2**30, total / 2**30, self.weight_bytes / 2**30,
                 activations / 2**30, outside / 2**30)
        return max(0, budget // per_block)

    def allocate_kv_cache(self, num_blocks: int, shared: str | None = None) -> None:
        """`shared` (tensor parallelism on one host, CPU): every rank's cache goes into
        a shared-memory file of that name (+ its rank), and rank 0 maps all of them, so
        the KV transfer reads and writes every rank's heads from rank 0's process."""
        if self.tp is not None and self.tp.rank == 0:
            self.tp.send("allocate", num_blocks, shared)
        # One tensor per layer, block-major: [block, K|V, kv head, offset in block, head
        # dim] (kernels/kv_layout.py).
        shape = kv_layout.shape(num_blocks, self.mc.num_kv_heads, self.block_size,
                                self.mc.head_dim)
        if shared is not None and self.tp is not None:
            try:
                self.kv_caches = create_shared(shared, self.tp.rank, shape, self.kv_dtype,
                                               self.mc.num_layers)
                self.tp.barrier()  # every rank's file exists
                if self.tp.rank == 0:
                    self._rank_caches = map_shared(shared, self.shard, num_blocks,
                                                   self.block_size, self.kv_dtype)
                self.tp.barrier()  # rank 0 holds every mapping: the names can go
            except BaseException:  # the files hold their whole size: none left behind
                unlink_shared(shared, self.tp.size)
                raise
            if self.tp.rank == 0:
                unlink_shared(shared, self.tp.size)
        else:
            self.kv_caches = [zeros(shape, self.kv_dtype, self.device)
                              for _ in range(self.mc.num_layers)]
        log.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s)", num_blocks,
                 self.block_size, num_blocks * self.block_size, self.kv_cache_bytes / 2**30,
                 self.kv_dtype)

    @property
    def rank_kv_caches(self) -> list[list[torch.Tensor]]:
        """Every rank's caches, rank-major; ValueError where other ranks' caches are out
        of this process's reach (another host, or GPUs: no shared mapping built)."""
        if self.tp is None:
            return [self.kv_caches]
        if not self._rank_caches:
            raise ValueError("the KV caches of this worker's other tensor-parallel ranks "
                             "are not mapped here (ranks on other hosts, or on GPUs): "
                             "KV transfer and the KV offload tiers need every rank of a "
                             "worker on one host, on CPU")
        return self._rank_caches

    @property
    def kv_cache_bytes(self) -> int:
        """The KV cache's bytes as stored (1 per element for fp8)."""
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    def maybe_capture_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        if self.tp is not None and self.tp.rank == 0:  # every rank captures its own
            self.tp.send("capture", max_num_seqs, max_model_len)
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = CudaGraphRunner(self.model, self.kv_caches, max_num_seqs, max_blocks,
                                      self.device)
        self.graphs.capture()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> dict[str, SampledTokens]:
        """Run the step. A request that reaches its last token samples; with draft
        tokens (run after it), it samples at each draft position too and keeps the
        drafts the model agrees with, plus one token (Sampler.sample)."""
        # One attention row per prefill chunk and per decode token. A decode with k drafts
        # is k + 1 one-token rows over the same blocks, row j at position start + j: the
        # step writes every row's K/V before attention reads, so row j sees the drafts
        # before it and no later one (a causal mask), and takes the batched decode path.
        seqs: list[tuple[Request, int, int]] = []  # (request, first position, tokens)
        for req, n in sched.scheduled:
            start = req.num_computed_tokens
            if req.spec_token_ids:
                seqs += [(req, start + j, 1) for j in range(n)]
            else:
                seqs.append((req, start, n))
        # Decodes first, sorted by length, so the attention kernel pads each group little.
        # With LoRA, each adapter's decodes, and its prompt chunks, sit side by side (one
        # slice each for its LoRA matmuls: kernels/lora.py).
        decodes = sorted((e for e in seqs if e[2] == 1),
                         key=lambda e: (e[0].lora_name or "", e[1]))
        seqs = decodes + sorted((e for e in seqs if e[2] > 1),
                                key=lambda e: e[0].lora_name or "")
        num_decodes = len(decodes)
        ids: list[int] = []
        positions: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        row_at: dict[tuple[str, int], int] = {}  # (request, position) -> its logits row
        for req, start, n in seqs:
            if start < req.num_tokens:
                ids.extend(req.token_ids[start:start + n])
            else:  # a draft's row
                ids.append(req.spec_token_ids[start - req.num_tokens])
            positions.extend(range(start, start + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            tables.append(sched.block_ids[req.request_id])
            if start + n >= req.num_tokens:
                row_at[req.request_id, start + n - 1] = qsl[-1] - 1
        # Rows that sample, per request in schedule order: its last token's, then one
        # per draft.
        sample_rows: list[int] = []
        samplers: list[tuple[Request, int]] = []  # (request, its first row in the logits)
        grammar_jobs = []
        for req, _ in sched.scheduled:
            last = req.num_tokens - 1
            if (req.request_id, last) not in row_at:
                continue
            drafts = req.spec_token_ids
            if req.grammar is not None:
                grammar_jobs.append((req.grammar, len(sample_rows), drafts))
            samplers.append((req, len(sample_rows)))
            sample_rows += [row_at[req.request_id, last + j] for j in range(len(drafts) + 1)]
        # The constraints' masks fill while the model runs.
        pending = self.mask.start(len(sample_rows), grammar_jobs)
        every_row = sample_rows == list(range(len(ids)))
        lora = self._lora_tokens(seqs)
        step = Forward(
            ids, positions, qsl, seq_lens, tables, num_decodes,
            max_query_len=max(n for _, _, n in seqs), rows=None if every_row else sample_rows,
            logits=bool(samplers), lora_tokens=lora,
            lora_writes=self.lora.take_writes() if self.lora is not None else [])
        logits = self.run(step)
        if logits is None:
            return {}
        dead = set(self.mask.apply(logits, pending)) if pending is not None else set()
        rows = []
        for req, _ in samplers:
            drafts = req.spec_token_ids
            outs = req.output_token_ids
            # Under min_tokens, EOS and the stop ids are banned (the sampler counts each
            # row's outputs: a draft's row counts the drafts before it).
            rows += [SamplingRow(req.params, req.generator, req.prompt_token_ids,
                                 outs + drafts[:j], drafts[j] if j < len(drafts) else None,
                                 req.min_tokens_ban, req.bad_words_ids)
                     for j in range(len(drafts) + 1)]
        out = self.sampler(logits, rows)
        return {req.request_id: _emitted(req, first, out, dead) for req, first in samplers}

    def run(self, step: Forward) -> torch.Tensor | None:
        """Rank 0: the step on every rank (sent to the others first); its logits for the
        rows that sample, or None where none does."""
        if self.tp is not None:
            self.tp.send("forward", step.to_wire())
        return self.forward(step)

    @torch.inference_mode()
    def forward(self, f: Forward) -> torch.Tensor | None:
        """The model on this rank's share of the weights, for the step rank 0 built."""
        dev = self.device
        t = f.tensors(self.block_size, pin=dev.type == "cuda")
        # Rows to sample, sent before the forward pass so nothing waits for it.
        rows_t = None if f.rows is None else to_device(f.rows, torch.long, dev)
        lora = self._lora_batch(f)
        if (self.graphs is not None and f.num_decodes == len(f.tables) and lora is None
                and f.num_decodes <= self.graphs.max_batch):
            hidden = self.graphs.run(t.input_ids, t.positions, t.slots, t.seq_lens, t.table)
        else:
            hidden = self.model(t.input_ids.to(dev, non_blocking=True),
                                t.positions.to(dev, non_blocking=True), self.kv_caches,
                                f.metadata(t, self.block_size, dev))
        if self.lora is not None:
            self.lora.batch = None
        if not f.logits:
            return None
        return self.model.compute_logits(hidden if rows_t is None else hidden[rows_t])

    def prompt_logprobs(self, token_ids: list[int], block_ids: list[int],
                        chunk: int) -> torch.Tensor:
        """Teacher forcing: log p(token i | the tokens before it) for i >= 1, [len - 1]
        fp32 on the host. The tokens run as a chunked prefill runs them, `chunk` at a
        time, their K/V written to `block_ids` and read back from there by later chunks,
        so the cache's dtype and the attention kernels show in the result."""
        out = []
        n = len(token_ids) - 1  # the last token is only a target
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            q = end - start
            step = Forward(token_ids[start:end], list(range(start, end)), [0, q], [end],
                           [block_ids], num_decodes=int(q == 1), max_query_len=q)
            logits = self.run(step)
            assert logits is not None
            logp = torch.log_softmax(logits.float(), dim=-1)
            targets = torch.tensor(token_ids[start + 1:end + 1], dtype=torch.long,
                                   device=self.device)
            out.append(logp.gather(1, targets[:, None])[:, 0].cpu())
        return torch.cat(out) if out else torch.empty(0)

    def _lora_tokens(self, seqs: list[tuple[Request, int, int]]) -> list[int] | None:
        """Rank 0: the step's adapters put in their slots, and each token's slot
        (kernels/lora.py); None without any (the captured CUDA graphs, which hold no
        LoRA, may then run)."""
        if self.lora is None or not any(req.lora_name for req, _, _ in seqs):
            return None
        slots = self.lora.prepare([req.lora_name for req, _, _ in seqs])
        return [s for s, (_, _, n) in zip(slots, seqs, strict=True) for _ in range(n)]

    def _lora_batch(self, f: Forward) -> LoraBatch | None:
        if self.lora is None:
            return None
        self.lora.apply_writes(f.lora_writes)  # rank 0 wrote them as it prepared
        self.lora.batch = None
        if f.lora_tokens is None:
            return None
        self.lora.batch = LoraBatch.of(f.lora_tokens, self.device)
        return self.lora.batch


def _emitted(req: Request, first: int, out, dead: set[int]) -> SampledTokens:
    """The tokens a request keeps from its rows: accepted drafts, then the token of the
    first row that did not accept (or the last row). A row whose constraint allowed no
    token ends the walk; at the first row, the request ends ("constraint")."""
    k = len(req.spec_token_ids)
    tokens, logprobs = [], []
    for j in range(first, first + k + 1):
        if j in dead:
            break
        tokens.append(out.token_ids[j])
        if req.params.logprobs is not None and out.logprobs is not None:
            lp = {out.token_ids[j]: out.logprobs[j]}
            lp.update(out.top_logprobs[j] if out.top_logprobs else ())
            logprobs.append(lp)
        if j == first + k or not out.accepted[j]:
            break
    return SampledTokens(tokens, logprobs if req.params.logprobs is not None else None,
                         num_drafts=k, dead=not tokens)


def _outside_torch(device: torch.device) -> int:
    """Bytes in use on the device that this process's torch allocator does not hold."""
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) - torch.cuda.memory_reserved(device)
