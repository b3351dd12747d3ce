"""Every flag of every role, in one table (what a flag is: flag_spec.py)."""

from __future__ import annotations

from baton.services.common.limits import TABLE
from baton.services.common.reasoning import REASONING_PARSERS
from baton.services.common.tool_parsers import TOOL_PARSERS
from baton.services.engine.config import DTYPES, KV_CACHE_DTYPES

from .flag_spec import ROLES, ROUTERS, WORKERS, Flag, _f

FLAGS: list[Flag] = [
    # -- every service
    _f("drain-grace", ROLES, "service.drain_grace",
       "on SIGTERM: seconds the work in flight gets to finish", kind=float),
    _f("tls-cert", ROLES, "service.tls_cert",
       "TLS certificate (PEM) of this service's port, shown when it calls a worker too",
       optional=True, aliases=("ssl-certfile",)),
    _f("tls-key", ROLES, "service.tls_key", "the certificate's private key (PEM)",
       optional=True, aliases=("ssl-keyfile",)),
    _f("tls-ca", ROLES, "service.tls_ca",
       "CA certificate (PEM): workers want callers signed by it (mutual TLS), and every "
       "service checks the workers it calls against it (the public API never asks its "
       "callers for one)", optional=True, aliases=("ssl-ca-certs",)),
    _f("tls-server-name", ("router", "decode"), "service.tls_server_name",
       "the name the workers' certificates carry, checked instead of the address dialed "
       "(workers found by dns:/// are dialed by IP)", optional=True),
    _f("cluster-token", ROLES, "service.cluster_token",
       "the secret the router and the workers share: a worker takes calls (health aside) "
       "only with it, a decode worker pulls KV only from prefill workers that prove they "
       "hold it, tensor-parallel ranks on other hosts prove it to join, and it keys the "
       "KV tiers' block MACs (at least 16 characters; prefer the variable or a file)",
       optional=True, secret=True),
    _f("cluster-token-file", ROLES, "service.cluster_token_file",
       "a file holding the cluster token (one line)", optional=True),
    _f("insecure-no-cluster-auth", WORKERS, "worker.insecure_no_cluster_auth",
       "start a worker that listens beyond loopback with neither a cluster token nor "
       "mutual TLS, or whose tensor-parallel ranks span hosts with no cluster token (else "
       "it refuses to): anyone who reaches it can call it, or join its ranks", kind=bool),
    _f("metrics-port", ROLES, "service.metrics_port",
       "Prometheus /metrics on this HTTP port (0: none; the router also serves them on "
       "--http-port), over TLS when the service has --tls-cert", kind=int),
    _f("metrics-host", ROLES, "service.metrics_host",
       "the address /metrics listens on (default: the host of --address)", optional=True),
    _f("otlp-traces-endpoint", ROLES, "service.otlp_traces_endpoint",
       "send OpenTelemetry traces to this OTLP gRPC collector (host:port, over TLS; "
       "default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT)",
       optional=True),
    _f("otlp-insecure", ROLES, "service.otlp_insecure",
       "send traces in plaintext (else TLS, unless an http:// endpoint or "
       "OTEL_EXPORTER_OTLP_[TRACES_]INSECURE=true says otherwise)", kind=bool),
    # -- engines
    _f("model", ROLES, (("engine", "model"), ("router", "model")),
       "a .gguf file, an HF model directory, or a hub id fetched into the HF cache "
       "(default: SmolLM2-135M-Instruct); the router reads its tokenizer", optional=True),
    _f("tokenizer", ROLES, (("engine", "tokenizer"), ("router", "tokenizer")),
       "a tokenizer folder or hub id (default: the model's)", optional=True),
    _f("revision", ROLES, (("engine", "revision"), ("router", "revision")),
       "of a hub id: a branch, tag or commit (default: main)", optional=True),
    _f("tokenizer-revision", ROLES,
       (("engine", "tokenizer_revision"), ("router", "tokenizer_revision")),
       "of a --tokenizer hub id (default: main)", optional=True),
    _f("chat-template", ROLES, (("engine", "chat_template"), ("router", "chat_template")),
       "a jinja chat template (a file, or the template itself) instead of the "
       "tokenizer's; the router renders chats with it", optional=True),
    _f("allow-special-tokens-in-content", ROLES,
       (("engine", "allow_special_tokens_in_content"),
        ("router", "allow_special_tokens_in_content")),
       "text in a chat's messages, tools and template variables that spells a special "
       "token (<|im_end|>, ...) becomes that control token, as in vLLM (default: plain "
       "text, so no message can forge a turn)", kind=bool),
    _f("generation-config", ROLES,
       (("engine", "generation_config"), ("router", "generation_config")),
       "auto: the model's generation_config.json gives EOS ids and the defaults of unset "
       "sampling values (the router checks requests with the same defaults: give it the "
       "workers' value); none: ignore it; or a folder holding one"),
    _f("dtype", WORKERS, "engine.dtype",
       "weights, activations and KV cache; auto: the checkpoint's, in bf16 on CPU and for "
       "fp32 checkpoints", choices=DTYPES),
    _f("kv-cache-dtype", WORKERS, "engine.kv_cache_dtype",
       "the KV cache's element type: auto (the model's dtype), or fp8 (= fp8_e4m3) or "
       "fp8_e5m2, one byte per element, scaled per layer by the checkpoint's k_scale and "
       "v_scale (else 1.0); both workers of a P/D pair must agree", choices=KV_CACHE_DTYPES),
    _f("device", WORKERS, "engine.device", "auto, cpu or cuda[:N]"),
    _f("tensor-parallel-size", WORKERS, "engine.tensor_parallel_size",
       "ranks one worker's model is split over (heads, MLP rows and vocabulary per rank; "
       "one all-reduce after attention and after the MLP): gloo on CPU, NCCL on GPUs; the "
       "worker starts the ranks of its host (baton up: --prefill-/--decode- "
       "tensor-parallel-size per role)", kind=int),
    _f("nnodes", WORKERS, "engine.nnodes",
       "hosts one worker spans (--tensor-parallel-size a multiple of it; "
       "--tensor-parallel-size / nnodes ranks each)", kind=int),
    _f("node-rank", WORKERS, "engine.node_rank",
       "this host's place among --nnodes: 0 serves the API, any other runs only its "
       "ranks", kind=int),
    _f("distributed-init-address", WORKERS, "engine.distributed_init_address",
       "host:port of node 0 where a worker's ranks on several hosts meet (node 0 "
       "listens on that address only; default: MASTER_ADDR and MASTER_PORT). On one host "
       "the ranks meet in a private folder instead", optional=True),
    _f("block-size", WORKERS, "engine.block_size", "tokens per KV block", kind=int),
    _f("kv-cache-gib", WORKERS, "engine.kv_cache_gib", "CPU: KV cache size in GiB",
       kind=float),
    _f("gpu-memory-utilization", WORKERS, "engine.gpu_memory_utilization",
       "CUDA: share of device memory for weights, activations and KV", kind=float),
    _f("max-num-seqs", WORKERS, "engine.max_num_seqs", "requests in one batch", kind=int),
    _f("max-num-batched-tokens", WORKERS, "engine.max_num_batched_tokens",
       "tokens in one step (prefill chunks included)", kind=int),
    _f("max-model-len", WORKERS, "engine.max_model_len",
       "longest prompt + output (default: the model's, capped by the KV cache)", kind=int,
       optional=True),
    _f("enable-prefix-caching", WORKERS, "engine.enable_prefix_caching",
       "reuse the KV of shared prompt prefixes", kind=bool),
    _f("scheduling-policy", WORKERS, "engine.scheduling_policy",
       "fcfs, or priority (a request's `priority`, smaller first)",
       choices=("fcfs", "priority")),
    _f("enforce-eager", WORKERS, "engine.enforce_eager", "CUDA: no CUDA graphs", kind=bool),
    _f("attention-backend", WORKERS, "engine.attention_backend",
       "default: the best that runs (CUDA: flash-attn, Triton, torch)",
       choices=("flash-attn", "triton", "torch"), optional=True),
    _f("load-format", WORKERS, "engine.load_format",
       "dummy: random weights of the model's shapes, for benchmarks",
       choices=("auto", "dummy")),
    _f("quantization", WORKERS, "engine.quantization",
       "keep weights quantized: int8 (per channel, from any checkpoint; weight-only), w8a8 "
       "(the same, activations quantized too) or gguf (a GGUF's Q4_0/Q4_1/Q8_0 as they "
       "are); default: the model dtype", optional=True),
    _f("seed", WORKERS, "engine.seed", "the sampler's seed for unseeded requests", kind=int),
    _f("kv-lease-timeout", ("prefill",), "engine.kv_lease_timeout_s",
       "prefill: seconds a handed-off request's blocks stay held for its decode worker",
       kind=float),
    _f("kv-load-failure-policy", WORKERS, "engine.kv_load_failure_policy",
       "when a KV load fails (a decode worker's pull, a tier's blocks), compute what did "
       "not land (recompute) or fail the request",
       choices=("recompute", "fail")),
    _f("kv-connector", WORKERS, "engine.kv_connector",
       "KV connectors, in order: pd (a decode worker's pull), offload (the tiers); "
       "default: what the other flags call for"),
    _f("kv-transfer-config", WORKERS, "engine.kv_transfer_config",
       "vLLM's KV transfer JSON (kv_connector, kv_role, kv_load_failure_policy, "
       "kv_connector_extra_config); a key Baton does not act on is refused",
       optional=True),
    _f("kv-offload-gib", WORKERS, "engine.kv_offload_gib",
       "a host KV tier of this size, shared by the workers on the host (0: none)",
       kind=float),
    _f("kv-offload-host-path", WORKERS, "engine.kv_offload_host_path",
       "where the host tier lives: shared memory (default: a folder in /dev/shm; "
       "containers share it through a tmpfs volume); the user's own, mode 0700",
       optional=True),
    _f("kv-offload-disk-path", WORKERS, "engine.kv_offload_disk_path",
       "a disk KV tier in this folder (kept across restarts); the user's own, mode 0700",
       optional=True),
    _f("kv-offload-disk-gib", WORKERS, "engine.kv_offload_disk_gib",
       "the disk tier's size in GiB", kind=float),
    _f("speculative-method", WORKERS, "spec.method",
       "speculative decoding: ngram (prompt lookup) drafts, verified in one pass "
       "(decode and colocated; default: off)", choices=("ngram",), optional=True),
    _f("num-speculative-tokens", WORKERS, "spec.num_speculative_tokens",
       "draft tokens per request and step", kind=int),
    _f("ngram-min", WORKERS, "spec.ngram_min", "shortest n-gram the proposer matches",
       kind=int),
    _f("ngram-max", WORKERS, "spec.ngram_max", "longest n-gram the proposer matches",
       kind=int),
    _f("speculative-disable-by-batch-size", WORKERS, "spec.disable_batch_size",
       "no drafts while more requests than this decode (the step is compute-bound)",
       kind=int),
    _f("grammar-compile-timeout", WORKERS, "engine.grammar_compile_timeout_s",
       "structured output: seconds a grammar may take to compile; past it, the request "
       "fails (INVALID_ARGUMENT)", kind=float),
    _f("grammar-compile-threads", WORKERS, "engine.grammar_compile_threads",
       "structured output: threads that compile grammars (never the engine's)", kind=int),
    _f("grammar-compile-queue", WORKERS, "engine.grammar_compile_queue",
       "structured output: grammar compiles queued or running at once; past it, "
       "RESOURCE_EXHAUSTED", kind=int),
    # -- workers
    _f("engine-id", WORKERS, "worker.engine_id",
       "a name for this engine (default: its role); each start adds a random suffix"),
    _f("kv-transport", ("prefill", "decode"), "worker.kv_transport",
       "how KV blocks move: nixl, or grpc (default: nixl when it loads)",
       choices=("nixl", "grpc"), optional=True),
    _f("max-queue", WORKERS, "worker.max_queue",
       "requests that may wait; past it, RESOURCE_EXHAUSTED (default: 4 x max-num-seqs)",
       kind=int, optional=True),
    _f("threads", WORKERS, "worker.threads", "torch intra-op threads (default: torch's)",
       kind=int, optional=True),
    _f("cpus", WORKERS, "worker.cpus",
       "the CPU cores this worker (and its tensor-parallel ranks) may run on, as taskset "
       "lists them (\"0\", \"2-3\", \"0,4-5\"); torch's threads default to their count: "
       "topologies compared on the same cores, each engine on its share", optional=True),
    _f("engine-stall-timeout", WORKERS, "worker.engine_stall_timeout",
       "seconds a step may take before the engine counts as stuck: health NOT_SERVING, "
       "and the router moves its requests on", kind=float),
    _f("inject-kv-failure", ("decode",), "worker.inject_kv_failure",
       "test hook: every KV pull fails with this reason", optional=True, hidden=True),
    # -- routers
    _f("prefill", ("router",), "router.prefill",
       "prefill workers: host:port, or dns:///name:port for every address of a DNS name "
       "(dns://server/name:port asks that server); repeat, or comma-separate", kind=list),
    _f("decode", ("router",), "router.decode",
       "decode workers, as --prefill", kind=list),
    _f("discovery-interval", ("router",), "router.discovery_interval",
       "seconds between lookups of dns:/// names (workers join and leave)", kind=float),
    _f("discovery-grace", ("router",), "router.discovery_grace",
       "seconds a dns:/// name that answers no address (NXDOMAIN, no records) keeps the "
       "workers it had before they retire", kind=float),
    _f("routing", ("router",), "router.routing",
       "kv: weigh each worker's cached prefix (its KV events) against its load; "
       "load: load alone", choices=("kv", "load")),
    _f("kv-overlap-weight", ("router",), "router.kv_overlap_weight",
       "routing cost of each prompt token a worker does not hold", kind=float),
    _f("kv-host-weight", ("router",), "router.kv_host_weight",
       "what a prompt block in a worker's host (shared memory) tier counts for in "
       "routing, against 1 for one in its block pool and 0 for a miss", kind=float),
    _f("kv-disk-weight", ("router",), "router.kv_disk_weight",
       "... and a block in its disk tier", kind=float),
    _f("load-weight", ("router",), "router.load_weight",
       "routing cost of a unit of a worker's load (waiting x 4 + running), in prompt "
       "tokens", kind=float),
    _f("disaggregation", ("router",), "router.disaggregation",
       "where each prompt is computed: auto (per prompt: its uncached length, the "
       "prefill workers' queue), always (on a prefill worker), never (on the decode "
       "worker that streams it)", choices=("auto", "always", "never")),
    _f("local-prefill-tokens", ("router",), "router.local_prefill_tokens",
       "auto: the decode worker prefills a prompt itself when it lacks at most this many "
       "of its tokens (0: off)", kind=int),
    _f("local-prefill-hit", ("router",), "router.local_prefill_hit",
       "... or when it holds at least this share of the prompt's blocks (0: never)",
       kind=float),
    _f("local-prefill-queue", ("router",), "router.local_prefill_queue",
       "... or when the prefill workers' queued prompt tokens exceed the decode worker's "
       "by this many times (1 + its running streams) (0: never)", kind=float),
    _f("slo-ttft-ms", ("router",), "router.slo_ttft_ms",
       "a time-to-first-token target: requests past it are counted "
       "(baton:slo_misses_total{slo=\"ttft\"}; 0: none)", kind=float),
    _f("slo-itl-ms", ("router",), "router.slo_itl_ms",
       "a target for a request's mean time per output token after the first "
       "(baton:slo_misses_total{slo=\"itl\"}; 0: none)", kind=float),
    _f("tool-call-parser", ROUTERS, "router.tool_call_parser",
       "how tool calls are found in a chat's text for tool_choice \"auto\" (the "
       "model's format)", choices=tuple(TOOL_PARSERS), optional=True),
    _f("enable-auto-tool-choice", ROUTERS, "router.enable_auto_tool_choice",
       "serve tool_choice \"auto\" (the default with tools) with --tool-call-parser; "
       "without it such a request is refused", kind=bool),
    _f("reasoning-parser", ROUTERS, "router.reasoning_parser",
       "split a chat's reasoning (reasoning_content) from its answer; structured output "
       "and tool calls apply to the answer", choices=tuple(REASONING_PARSERS),
       optional=True),
    _f("max-inflight", ROUTERS, "router.max_inflight",
       "requests in flight at once; past it, RESOURCE_EXHAUSTED", kind=int),
    _f("request-timeout", ROUTERS, "router.request_timeout",
       "the deadline of a request whose client set none (seconds)", kind=float),
    _f("stream-stall-timeout", ROUTERS, "router.stream_stall_timeout",
       "seconds a client may read nothing of its stream (gRPC or SSE) while its buffers "
       "are full; past it the stream is cut and the request aborted, freeing its blocks",
       kind=float),
    # -- before admission (router and colocated; docs/configuration.md "Limits")
    _f("max-unparsed-bytes", ROUTERS, "router.max_unparsed_bytes",
       "bytes of requests read but not yet parsed (HTTP bodies, gRPC messages), all "
       "callers together; past it, RESOURCE_EXHAUSTED / 429", kind=int),
    _f("max-parses-per-key", ROUTERS, "router.max_parses_per_key",
       "requests of one API key parsed at once; its others wait their turn (without API "
       "keys every caller is one key)", kind=int),
    _f("max-http-connections", ROUTERS, "router.max_http_connections",
       "HTTP connections open at once; past it, a new one gets 503 and is closed "
       "(default: 4 x --max-inflight)", kind=int, optional=True),
    _f("max-grpc-calls", ROUTERS, "router.max_grpc_calls",
       "gRPC calls at once, of any method but a health Check; past it, "
       "RESOURCE_EXHAUSTED with retry-after-ms (default: 4 x --max-inflight)", kind=int,
       optional=True),
    _f("http-header-timeout", ROUTERS, "router.http_header_timeout",
       "seconds an HTTP request's headers may take to arrive; past it, 408 and the "
       "connection is closed", kind=float),
    _f("http-body-timeout", ROUTERS, "router.http_body_timeout",
       "seconds an HTTP request's body may take to arrive once its headers are in; past "
       "it, 408", kind=float),
    # -- the size of one request (router and colocated; docs/configuration.md "Limits")
    *[_f(row.flag, ROUTERS, f"limits.{row.name}", row.help, kind=int) for row in TABLE
      if row.flag],
    _f("poll-interval", ("router",), "router.poll_interval",
       "seconds between stats polls of every worker", kind=float),
    _f("worker-timeout", ("router",), "router.worker_timeout",
       "a worker silent this long is down (dead or frozen); its requests move on",
       kind=float),
    _f("http-port", ROUTERS, "router.http_port",
       "the OpenAI-compatible HTTP API (and /metrics) on this port; 0: none", kind=int,
       aliases=("port",)),
    _f("served-model-name", ROLES,
       (("router", "served_model_name"), ("engine", "served_model_name")),
       "the model's name in GetModelInfo and the OpenAI API (default: the model's hub id, "
       "file or folder name); a router's overrides its workers'", optional=True),
    _f("api-key", ROUTERS, "router.api_keys",
       "callers must send `Authorization: Bearer <key>` (repeat, or comma-separate)",
       kind=list, secret=True, vllm_env="VLLM_API_KEY"),
    _f("api-key-file", ROUTERS, "router.api_key_file",
       "a file of API keys, one a line", optional=True),
    _f("shared-prefix-cache", ROUTERS, "router.shared_prefix_cache",
       "with API keys: one prefix cache for every key's callers (they can then tell from "
       "cached_tokens what others sent); default: one per key", kind=bool),
    # -- LoRA adapters
    _f("enable-lora", ROLES, (("engine", "enable_lora"), ("router", "enable_lora")),
       "serve LoRA adapters: a request names one as its `model`", kind=bool),
    _f("lora-modules", ROLES, (("engine", "lora_modules"), ("router", "lora_modules")),
       "LoRA adapters served from the start: name=path or JSON", kind=list, spaced=True),
    _f("allow-runtime-lora-updating", ROUTERS, "router.allow_runtime_lora_updating",
       "serve /v1/load_lora_adapter, /v1/unload_lora_adapter and their RPCs (needs "
       "--lora-root)", kind=bool),
    _f("lora-root", ROLES, (("engine", "lora_root"), ("router", "lora_root")),
       "the directory a LoRA adapter loaded at run time must lie beneath, symlinks "
       "resolved (--lora-modules may lie anywhere); a worker given it reads the paths the "
       "router sends only beneath it", optional=True),
    _f("max-loras", WORKERS, "engine.max_loras", "LoRA adapters in a step", kind=int),
    _f("max-lora-rank", WORKERS, "engine.max_lora_rank", "largest LoRA rank", kind=int),
    _f("max-cpu-loras", WORKERS, "engine.max_cpu_loras", "LoRA adapters held in host "
       "memory (default: 4 x --max-loras)", kind=int, optional=True),
]
