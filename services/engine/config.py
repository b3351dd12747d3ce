"""Engine configuration: frozen, validated on construction. Torch-free (torch loads only
when a property asks for a torch object), so the CLI reads its defaults without it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..lora.names import parse_lora_module

DTYPES = ("auto", "float32", "bfloat16", "float16")
# --quantization (services/engine/quantization.py), and vLLM's names Baton refuses, why.
QUANTIZATIONS = ("int8", "w8a8", "gguf")
QUANTIZATIONS_LATER = {
    "awq": "AWQ checkpoints are not served yet (later: int8, w8a8 and GGUF are)",
    "gptq": "GPTQ checkpoints are not served yet (later: int8, w8a8 and GGUF are)",
}


def check_quantization(method: str | None) -> None:
    """Raise ValueError for a method Baton does not serve, naming why."""
    if method is None or method in QUANTIZATIONS:
        return
    if method in QUANTIZATIONS_LATER:
        raise ValueError(f"quantization {method!r}: {QUANTIZATIONS_LATER[method]}")
    raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {method!r}")
# vLLM's --kv-cache-dtype: "auto" stores the model's dtype; "fp8" is vLLM's alias of e4m3.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (services/engine/spec_decode.py), vLLM's names; method None
    is off. Above `disable_batch_size` running decodes no request drafts."""

    method: str | None = None
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    disable_batch_size: int = 4

    def __post_init__(self) -> None:
        if self.method not in (None, "ngram"):
            raise ValueError(f"speculative method must be 'ngram', got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16], got "
                             f"{self.num_speculative_tokens!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min!r} and "
                             f"{self.ngram_max!r}")
        if self.disable_batch_size < 1:
            raise ValueError("speculative disable_batch_size must be >= 1, got "
                             f"{self.disable_batch_size!r}")


@dataclass(frozen=True)
class EngineConfig:
    """model None means the default model (SmolLM2-135M-Instruct GGUF).

    KV memory: `kv_cache_gib` on CPU; on CUDA, `gpu_memory_utilization` of the device's
    memory minus what the weights and a profiling pass take. `max_model_len` None means
    the model's own limit, capped by what the KV cache can hold.
    """

    model: str | None = None  # a .gguf file, an HF directory or a hub id; None: the default
    tokenizer: str | None = None  # a folder or hub id; None: the model's
    revision: str | None = None  # of a hub id: a branch, tag or commit
    tokenizer_revision: str | None = None  # of a --tokenizer hub id
    chat_template: str | None = None  # a jinja file or inline template; None: the tokenizer's
    # A chat message's text that spells a special token is that control token (vLLM's
    # way); False: plain text (services/common/plain_content.py).
    allow_special_tokens_in_content: bool = False
    served_model_name: str | None = None  # what GetModelInfo and /v1/models call it
    generation_config: str = "auto"  # "auto": the model's defaults; "none"; or a folder
    dtype: str = "auto"  # see resolve_dtype
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_gib: float = 4.0
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    seed: int = 0
    attention_backend: str | None = None  # None: the best for the platform (kernels/)
    load_format: str = "auto"  # "dummy": random weights of the checkpoint's shapes
    # Weights kept quantized: None, "int8" or "gguf" (services/engine/quantization.py).
    quantization: str | None = None
    kv_lease_timeout_s: float = 30.0  # prefill role: held blocks are freed after this
    kv_load_failure_policy: str = "recompute"  # a failed KV load: "recompute" it, or "fail"
    # KV connectors (kv_connector/registry.py): "pd", "offload", or both ("pd,offload");
    # "" stacks what the settings call for. `kv_transfer_config`: vLLM's JSON, read into
    # these fields (kv_connector/transfer_config.py); `kv_role` is the role it names.
    kv_connector: str = ""
    kv_transfer_config: str | None = None
    kv_role: str | None = None
    # Offload tiers (kv_connector/offload.py): a host tier of this many GiB (shared
    # memory every worker on the host reads; `kv_offload_host_path` None: the default
    # one) and a disk tier (files under the path, at most that many GiB).
    kv_offload_gib: float = 0.0
    kv_offload_host_path: str | None = None
    kv_offload_disk_path: str | None = None
    kv_offload_disk_gib: float = 0.0
    speculative: SpecConfig = SpecConfig()  # speculative decoding; off by default
    # Structured output: a grammar compile past this fails its request (INVALID_ARGUMENT).
    grammar_compile_timeout_s: float = 10.0
    grammar_compile_threads: int = 2  # the compiler's own threads
    grammar_compile_queue: int = 16  # compiles queued or running; past it, RESOURCE_EXHAUSTED
    # LoRA (services/lora/adapter.py): adapters in one step at most (device slots), their
    # largest rank, and how many the host keeps loaded (None: 4 * max_loras).
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[str, ...] = ()  # "name=path" (or vLLM's JSON form), loaded at start
    # Where the adapter paths callers send must lie (services/lora/paths.py); None:
    # anywhere the router accepted (a router takes none at run time without its own root).
    lora_root: str | None = None
    # The KV cache's element type (kernels/kv_quant.py): auto, fp8 (= fp8_e4m3), fp8_e5m2.
    kv_cache_dtype: str = "auto"
    # Tensor parallelism (services/engine/tp_ranks.py): ranks per worker, over `nnodes`
    # hosts (this one `node_rank`), meeting at `distributed_init_address` ("host:port";
    # None: torch's MASTER_ADDR/MASTER_PORT, or a local port on one host).
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    distributed_init_address: str | None = None
    # The cluster's shared secret (the worker's --cluster-token, copied in by WorkerConfig):
    # a tensor-parallel rank proves it holds it before it takes a place in the group
    # (parallel.py), and it keys the MAC of the KV tiers' blocks (kv_offload/). Never shown.
    cluster_token: str | None = field(default=None, repr=False)
    # Ranks on several hosts (nnodes > 1) with no cluster token: admitted unauthenticated.
    insecure_no_cluster_auth: bool = False

    def __post_init__(self) -> None:
        if self.speculative is None:
            object.__setattr__(self, "speculative", SpecConfig())
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be a power of two <= 256, got {self.block_size!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        check_quantization(self.quantization)
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        self._check_kv_connectors()
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_load_failure_policy must be 'recompute' or 'fail', got "
                             f"{self.kv_load_failure_policy!r}")
        if self.kv_lease_timeout_s <= 0:
            raise ValueError(f"kv_lease_timeout_s must be > 0, got {self.kv_lease_timeout_s}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError("grammar_compile_timeout_s must be > 0, got "
                             f"{self.grammar_compile_timeout_s!r}")
        for name in ("grammar_compile_threads", "grammar_compile_queue"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got "
                                 f"{getattr(self, name)!r}")
        for name in ("max_loras", "max_lora_rank"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        for spec in self.lora_modules:
            parse_lora_module(spec)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        self._check_parallel()
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")

    @property
    def kv_connector_names(self) -> list[str]:
        return [n.strip() for n in self.kv_connector.split(",") if n.strip()]

    @property
    def kv_offload_enabled(self) -> bool:
        return self.kv_offload_gib > 0 or bool(self.kv_offload_disk_path)

    def _check_kv_connectors(self) -> None:
        if self.kv_transfer_config:
            from .kv_connector.transfer_config import parse
            for name, value in parse(self.kv_transfer_config).items():
                object.__setattr__(self, name, value)
        for name in ("kv_offload_gib", "kv_offload_disk_gib"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if bool(self.kv_offload_disk_path) != (self.kv_offload_disk_gib > 0):
            raise ValueError("the disk tier needs both kv_offload_disk_path and "
                             "kv_offload_disk_gib > 0")
        names = self.kv_connector_names
        if "offload" in names and not self.kv_offload_enabled:
            raise ValueError("kv_connector 'offload' needs a tier: kv_offload_gib > 0 or "
                             "kv_offload_disk_path")
        if self.kv_offload_enabled and names and "offload" not in names:
            raise ValueError(f"kv_connector {self.kv_connector!r} leaves out 'offload', "
                             "but a tier is set")
        if self.kv_offload_enabled and not self.enable_prefix_caching:
            raise ValueError("the KV offload tiers are keyed by the prefix cache's block "
                             "hashes: they need enable_prefix_caching")

    def _check_parallel(self) -> None:
        for name in ("tensor_parallel_size", "nnodes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        tp, nodes = self.tensor_parallel_size, self.nnodes
        if tp % nodes:
            raise ValueError(f"tensor_parallel_size {tp} must be a multiple of nnodes {nodes}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < nodes:
            raise ValueError(f"node_rank must be in [0, {nodes}), got {self.node_rank!r}")
        address = self.distributed_init_address
        if address is not None and (":" not in address
                                    or not address.rsplit(":", 1)[1].isdigit()):
            raise ValueError(f"distributed_init_address must be host:port, got {address!r}")
        if self.kv_offload_enabled and self.nnodes > 1:
            raise ValueError("the KV offload tiers copy every tensor-parallel rank's cache "
                             "from rank 0's process: they need every rank on one host")
        if tp > 1 and self.quantization == "gguf":
            raise ValueError("quantization 'gguf' keeps the file's blocks whole: it is not "
                             "split over tensor-parallel ranks (int8 and w8a8 are)")

    def resolve_dtype(self, checkpoint_dtype: str | None) -> str:
        """`auto`: the checkpoint's dtype, except that fp32 checkpoints run in bf16 (half
        the memory and bandwidth, as vLLM does), and fp16 runs in bf16 on CPU (CPU fp16
        matmuls are slow without AVX512-FP16, and bf16 keeps fp32's range). A GGUF file
        (quantized, dequantized at load) runs in bf16."""
        if self.dtype != "auto":
            return self.dtype
        if self.torch_device.type == "cuda":
            import torch

            # GPUs before Ampere lack bf16 kernels (flash-attn, Triton): fp16 there.
            if checkpoint_dtype == "float16" or not torch.cuda.is_bf16_supported():
                return "float16"
        return "bfloat16"

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def torch_kv_dtype(self):
        """What the KV cache stores: the model's dtype, or an fp8 one."""
        from baton.kernels.kv_quant import cache_dtype

        return cache_dtype(self.kv_cache_dtype, self.torch_dtype)

    @property
    def torch_device(self):
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
