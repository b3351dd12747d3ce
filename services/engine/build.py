"""What an engine is built from, before it takes a request: the model's weights and
tokenizer, its generation defaults, the model runner, and the size of the KV cache (the
blocks the memory budget holds, and the longest request that fits them alone), with the
KV layout its transfers are checked against. engine.py drives what this builds."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from baton.kv_transfer.base import KVLayout

from ..common import model_source
from ..common.generation_config import read_generation_config
from ..common.tokenizer import load_tokenizer, read_chat_template
from .config import EngineConfig
from .loader import load_checkpoint, resolve_model_path
from .model_config import ModelConfig
from .model_runner import ModelRunner
from .parallel import TPGroup
from .quantization import stored_bytes
from .tp_cache import new_name as new_shared_name

log = logging.getLogger(__name__)


@dataclass
class Built:
    config: EngineConfig  # its dtype resolved against the checkpoint's
    model_name: str  # the same on every host
    tokenizer: PreTrainedTokenizerBase
    model_config: ModelConfig  # its EOS ids joined with generation_config's
    sampling_defaults: dict
    runner: ModelRunner  # its KV cache allocated
    num_blocks: int
    max_model_len: int
    kv_layout: KVLayout
    weights: str  # model_source.weights_identity: the offload tiers' keys carry it


def load_runner(config: EngineConfig, tp: TPGroup | None = None
                ) -> tuple[EngineConfig, ModelRunner, int]:
    """The checkpoint's weights in a runner (this rank's share of them, with `tp`): the
    config with its dtype resolved, the runner, and the model's longest length."""
    path = resolve_model_path(config.model, config.revision)
    model_config, weights = load_checkpoint(path, config.load_format, config.seed)
    config = dataclasses.replace(config, dtype=config.resolve_dtype(model_config.dtype))
    limit = model_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                         f"max_position_embeddings {limit}")
    max_len = config.max_model_len or limit
    t1 = time.monotonic()
    runner = ModelRunner(config, model_config, weights, max_len, checkpoint=path, tp=tp)
    log.info("loaded %s (%s, %s, quantization %s, rank %d of %d: weights %.0f MiB) in "
             "%.1fs", path.name, model_config.architecture, config.dtype,
             config.quantization, tp.rank if tp else 0, tp.size if tp else 1,
             stored_bytes(runner.model) / 2**20, time.monotonic() - t1)
    return config, runner, max_len


def load(config: EngineConfig, tp: TPGroup | None = None) -> Built:
    """`tp`: the tensor-parallel group this engine leads as rank 0 (its ranks started)."""
    path = resolve_model_path(config.model, config.revision)
    name = model_source.model_name(config.model, path)  # the same on every host
    tokenizer = load_tokenizer(model_source.resolve_tokenizer(
        config.tokenizer, path, config.revision, config.tokenizer_revision))
    if config.chat_template:
        tokenizer.chat_template = read_chat_template(config.chat_template)
    config, runner, max_len = load_runner(config, tp)
    extra_eos, sampling_defaults = read_generation_config(config.generation_config, path)
    model_config = runner.model_config
    model_config = dataclasses.replace(model_config, eos_token_ids=tuple(dict.fromkeys(
        model_config.eos_token_ids + extra_eos)))
    if tp is not None:  # each rank holds its share: nothing gathered on rank 0
        log.info("weights per tensor-parallel rank: %s MiB", ", ".join(
            f"{b / 2**20:.1f}" for b in runner.rank_weight_bytes()))
    num_blocks = runner.profile_num_blocks()
    # One request must always fit alone, or it could never finish.
    capacity = (num_blocks - 1) * config.block_size
    if capacity < 2:
        raise ValueError(f"the KV budget holds only {num_blocks} blocks; raise kv_cache_gib "
                         "or gpu_memory_utilization")
    if config.max_model_len is not None and config.max_model_len > capacity:
        raise ValueError(f"max_model_len {config.max_model_len} does not fit in the KV "
                         f"cache ({capacity} tokens); raise the KV budget")
    max_model_len = min(max_len, capacity)
    # Every rank's cache where rank 0 can map it (one host, CPU), for the KV transfer.
    local = config.nnodes == 1 and runner.device.type == "cpu"
    runner.allocate_kv_cache(num_blocks, new_shared_name() if tp and local else None)
    # Workers pair only over the same weights: a hub model's commit is in its name here.
    commit = model_source.model_commit(path)
    # KV computed with quantized weights differs from KV of the dense ones: not a pair.
    quantized = f"+{config.quantization}" if config.quantization else ""
    # The dtype as stored (fp8 or the model's), and an fp8 cache's scales: a peer that
    # stores or scales otherwise is refused at the handshake, never served.
    kv_layout = KVLayout(model=name + (f"@{commit}" if commit else "") + quantized,
                         dtype=str(runner.kv_dtype).removeprefix("torch."),
                         block_size=config.block_size, num_layers=model_config.num_layers,
                         num_kv_heads=model_config.num_kv_heads,
                         head_dim=model_config.head_dim, kv_scales=kv_scales_text(runner),
                         tp_size=config.tensor_parallel_size)
    weights = model_source.weights_identity(path, config.load_format, config.seed)
    return Built(config, name, tokenizer, model_config, sampling_defaults, runner,
                 num_blocks, max_model_len, kv_layout, weights)


def kv_scales_text(runner: ModelRunner) -> str:
    """An fp8 cache's k_scale and v_scale of every layer, for the layout: "1" when all
    are 1.0, else 16 hex digits of SHA-256 over them; "" for a cache that has none."""
    if runner.kv_dtype == runner.dtype:
        return ""
    scales = [(layer.self_attn.k_scale, layer.self_attn.v_scale)
              for layer in runner.model.decoder_layers]
    if all(s == 1.0 for pair in scales for s in pair):
        return "1"
    return hashlib.sha256(repr(scales).encode()).hexdigest()[:16]
