"""One flag table for every role. Each flag says which roles take it and which config
field it fills; its default is that field's default (defined once, in the config
dataclass), its environment variable is `BATON_` + its name, and `--help` shows both.

    --kv-cache-gib     prefill decode colocated   fills EngineConfig.kv_cache_gib

A bad value, on the command line or in a variable, gets one line naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass

from baton.router.config import RouterConfig
from baton.services.common.limits import Limits
from baton.services.common.reasoning import REASONING_PARSERS
from baton.services.common.tool_parsers import TOOL_PARSERS
from baton.services.engine.config import DTYPES, EngineConfig, SpecConfig
from baton.services.rpc.config import ServiceConfig
from baton.services.worker.config import WorkerConfig

ROLES = ("router", "prefill", "decode", "colocated")
WORKERS = ("prefill", "decode", "colocated")
ROUTERS = ("router", "colocated")
CLUSTER = ("router", "prefill", "decode")  # the roles that call or serve workers
DEFAULT_PORTS = {"router": 50051, "prefill": 50061, "decode": 50071, "colocated": 50051}
CONFIGS = {"engine": EngineConfig, "worker": WorkerConfig, "router": RouterConfig,
           "service": ServiceConfig, "spec": SpecConfig, "limits": Limits}
# The roles that build each config: a flag fills only the configs its role builds.
BUILT_BY = {"engine": WORKERS, "worker": WORKERS, "spec": WORKERS, "router": ROUTERS,
            "limits": ROUTERS, "service": ROLES}


@dataclass(frozen=True)
class Flag:
    name: str  # without dashes: "kv-cache-gib"
    roles: tuple[str, ...]
    fills: tuple[tuple[str, str], ...]  # (config, field) per target; the first gives the default
    help: str
    kind: type = str  # str, int, float, bool or list (of addresses)
    choices: tuple[str, ...] | None = None
    optional: bool = False  # None is a value (unset)
    hidden: bool = False
    secret: bool = False  # never in --help or in a child's argv (baton up: env instead)
    aliases: tuple[str, ...] = ()  # other names of the flag (vLLM's), without dashes
    spaced: bool = False  # a list given as `--flag a b` (vLLM's nargs), never comma-split

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return "BATON_" + self.dest.upper()

    @property
    def default(self):
        config, name = self.fills[0]
        field = next(f for f in dataclasses.fields(CONFIGS[config]) if f.name == name)
        value = field.default
        return list(value) if isinstance(value, tuple) else value

    def parse(self, raw: str):
        """A value from its text (an environment variable): ValueError says why not."""
        if self.kind is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError("not a boolean (true/false, 1/0, yes/no, on/off)")
        if self.kind is list:
            return raw.split() if self.spaced else [a.strip() for a in raw.split(",")
                                                    if a.strip()]
        if self.optional and raw.strip() in ("", "none", "None"):
            return None
        try:
            value = self.kind(raw)
        except ValueError:
            raise ValueError(f"not {'an integer' if self.kind is int else 'a number'}"
                             if self.kind in (int, float) else "bad value") from None
        if self.choices and value not in self.choices:
            raise ValueError(f"not one of {', '.join(self.choices)}")
        return value


def _f(name, roles, fills, help, **kw) -> Flag:
    if isinstance(fills, str):
        fills = (tuple(fills.split(".")),)
    return Flag(name, tuple(roles), tuple(fills), help, **kw)


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
    _f("cluster-token", CLUSTER, "service.cluster_token",
       "the secret the router and the workers share: a worker takes calls (health aside) "
       "only with it, and a decode worker pulls KV only from prefill workers that prove "
       "they hold it (at least 16 characters; prefer the variable or a file)",
       optional=True, secret=True),
    _f("cluster-token-file", CLUSTER, "service.cluster_token_file",
       "a file holding the cluster token (one line)", optional=True),
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
    _f("generation-config", WORKERS, "engine.generation_config",
       "auto: the model's generation_config.json gives EOS ids and the defaults of unset "
       "sampling values; none: ignore it; or a folder holding one"),
    _f("dtype", WORKERS, "engine.dtype",
       "weights, activations and KV cache; auto: the checkpoint's, in bf16 on CPU and for "
       "fp32 checkpoints", choices=DTYPES),
    _f("device", WORKERS, "engine.device", "auto, cpu or cuda[:N]"),
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
    _f("seed", WORKERS, "engine.seed", "the sampler's seed for unseeded requests", kind=int),
    _f("kv-lease-timeout", ("prefill",), "engine.kv_lease_timeout_s",
       "prefill: seconds a handed-off request's blocks stay held for its decode worker",
       kind=float),
    _f("kv-load-failure-policy", ("decode",), "engine.kv_load_failure_policy",
       "decode: when a KV pull fails, prefill locally (recompute) or fail the request",
       choices=("recompute", "fail")),
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
    _f("load-weight", ("router",), "router.load_weight",
       "routing cost of a unit of a worker's load (waiting x 4 + running), in prompt "
       "tokens", kind=float),
    _f("local-prefill-tokens", ("router",), "router.local_prefill_tokens",
       "the decode worker prefills a prompt itself when it lacks at most this many of "
       "its tokens (0: off)", kind=int),
    _f("local-prefill-hit", ("router",), "router.local_prefill_hit",
       "... or when it holds at least this share of the prompt's blocks (0: never)",
       kind=float),
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
    # -- the size of one request (router and colocated; README "Limits")
    _f("max-prompts", ROUTERS, "limits.max_prompts", "prompts in one completions request",
       kind=int),
    _f("max-n", ROUTERS, "limits.max_n", "choices (n) per prompt", kind=int),
    _f("max-messages", ROUTERS, "limits.max_messages", "messages in one chat", kind=int),
    _f("max-prompt-chars", ROUTERS, "limits.max_prompt_chars",
       "characters of prompt text and message contents in one request", kind=int),
    _f("max-prompt-token-ids", ROUTERS, "limits.max_prompt_token_ids",
       "prompt token ids in one request", kind=int),
    _f("max-stop", ROUTERS, "limits.max_stop", "stop strings in one request", kind=int),
    _f("max-stop-chars", ROUTERS, "limits.max_stop_chars", "characters of one stop string",
       kind=int),
    _f("max-stop-token-ids", ROUTERS, "limits.max_stop_token_ids",
       "stop token ids in one request", kind=int),
    _f("max-cache-salt-chars", ROUTERS, "limits.max_cache_salt_chars",
       "characters of a cache_salt", kind=int),
    _f("max-request-id-chars", ROUTERS, "limits.max_request_id_chars",
       "characters of a request_id", kind=int),
    _f("max-user-chars", ROUTERS, "limits.max_user_chars",
       "characters of the OpenAI `user` field", kind=int),
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
       kind=list),
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
       "serve /v1/load_lora_adapter, /v1/unload_lora_adapter and their RPCs", kind=bool),
    _f("max-loras", WORKERS, "engine.max_loras", "LoRA adapters in a step", kind=int),
    _f("max-lora-rank", WORKERS, "engine.max_lora_rank", "largest LoRA rank", kind=int),
    _f("max-cpu-loras", WORKERS, "engine.max_cpu_loras", "LoRA adapters held in host "
       "memory (default: 4 x --max-loras)", kind=int, optional=True),
]


class EnvError(SystemExit):
    def __init__(self, flag: Flag, raw: str, why: str):
        super().__init__(f"baton: {flag.env}={raw!r}: {why}")


def add_flags(parser: argparse.ArgumentParser, roles: tuple[str, ...]) -> list[Flag]:
    """Add every flag any of `roles` takes, its default from its variable when set."""
    flags = [f for f in FLAGS if set(f.roles) & set(roles)]
    for flag in flags:
        default = flag.default
        raw = os.environ.get(flag.env)
        if raw is not None:
            try:
                default = flag.parse(raw)
            except ValueError as e:
                raise EnvError(flag, raw, str(e)) from None
        shown = ",".join(default) if isinstance(default, list) else default
        if flag.secret and default is not None:
            shown = "(set)"
        help_text = argparse.SUPPRESS if flag.hidden else (
            f"{flag.help} [{flag.env}; default: {shown}]")
        kw: dict = {"default": default, "help": help_text, "dest": flag.dest}
        if flag.kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif flag.kind is list:
            kw.update(action="append", default=None, nargs="+" if flag.spaced else None)
            parser.set_defaults(**{f"{flag.dest}_env": default})
        else:
            kw["type"] = _checked(flag)
            if flag.choices:
                kw["choices"] = flag.choices
        parser.add_argument(f"--{flag.name}", *(f"--{a}" for a in flag.aliases), **kw)
    return flags


def _checked(flag: Flag):
    def convert(text: str):
        try:
            return flag.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = flag.kind.__name__
    return convert


def values(ns: argparse.Namespace, flags: list[Flag], role: str) -> dict[str, dict]:
    """{config: {field: value}} for `role`, from parsed flags."""
    out: dict[str, dict] = {name: {} for name in CONFIGS}
    for flag in flags:
        if role not in flag.roles:
            continue
        value = tuple(_entries(ns, flag)) if flag.kind is list else getattr(ns, flag.dest)
        for config, field in flag.fills:
            if role in BUILT_BY[config]:
                out[config][field] = value
    return out


def argv_for(ns: argparse.Namespace, flags: list[Flag], role: str) -> list[str]:
    """Command-line arguments that give a `role` process the same values (baton up)."""
    args: list[str] = []
    for flag in flags:
        if role not in flag.roles or (flag.kind is list and not flag.spaced) or flag.secret:
            continue
        value = _entries(ns, flag) if flag.kind is list else getattr(ns, flag.dest)
        if flag.kind is list:  # a spaced one: its entries, as given
            args += [f"--{flag.name}", *value] if value else []
        elif value is None:
            continue
        elif flag.kind is bool:
            args.append(f"--{flag.name}" if value else f"--no-{flag.name}")
        else:
            args += [f"--{flag.name}", str(value)]
    return args


def _entries(ns: argparse.Namespace, flag: Flag) -> list[str]:
    """A list flag's entries: given (repeated; comma-separated unless spaced), else its
    variable's."""
    given = getattr(ns, flag.dest) or []
    if not given:
        return list(getattr(ns, f"{flag.dest}_env"))
    parts = [a for v in given for a in (v if flag.spaced else v.split(","))]
    return [a.strip() for a in parts if a.strip()]


def fail(message: str) -> None:
    sys.exit(f"baton: {message}")
