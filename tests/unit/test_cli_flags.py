"""The one flag table (cli/flags.py): every flag reaches its role's config, its variable
is derived from its name and read with the flag's own type, `--help` shows both the
variable and the default, bad values get one line naming them, and `baton up` hands the
workers every engine flag."""

from __future__ import annotations

import dataclasses

import pytest

from baton.cli.flags import FLAGS, argv_for, values
from baton.cli.main import parse
from baton.router.config import RouterConfig
from baton.services.engine.config import EngineConfig, SpecConfig
from baton.services.rpc.config import ServiceConfig
from baton.services.worker.config import WorkerConfig


def _configs(role: str, *argv: str, env: dict | None = None, monkeypatch=None):
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    args, flags = parse(["serve", "--role", role, *argv])
    return values(args, flags, role)


def test_each_variable_is_the_flags_name_and_every_default_is_its_configs():
    configs = {"engine": EngineConfig(), "worker": WorkerConfig(), "router": RouterConfig(),
               "service": ServiceConfig(), "spec": EngineConfig().speculative,
               "limits": RouterConfig().limits}
    for flag in FLAGS:
        assert flag.env == "BATON_" + flag.name.upper().replace("-", "_")
        for config, field in flag.fills:  # one default, wherever the flag lands
            default = getattr(configs[config], field)
            assert flag.default == (list(default) if isinstance(default, tuple) else default)




def test_the_engine_flags_vllm_users_expect_reach_the_engine(monkeypatch):
    got = _configs("decode", "--scheduling-policy", "priority", "--no-enable-prefix-caching",
                   "--max-num-seqs", "7", "--kv-load-failure-policy", "fail")
    engine = EngineConfig(**got["engine"])
    assert engine.scheduling_policy == "priority" and not engine.enable_prefix_caching
    assert engine.max_num_seqs == 7 and engine.kv_load_failure_policy == "fail"


@pytest.mark.parametrize("raw, want", [("False", False), ("0", False), ("", False),
                                        ("true", True), ("1", True), ("yes", True)])
def test_boolean_variables_mean_what_they_say(monkeypatch, raw, want):
    got = _configs("prefill", env={"BATON_ENFORCE_EAGER": raw}, monkeypatch=monkeypatch)
    assert got["engine"]["enforce_eager"] is want




def test_a_flag_of_another_role_is_refused():
    with pytest.raises(SystemExit):
        parse(["serve", "--role", "router", "--kv-cache-gib", "2"])


def test_addresses_come_from_flags_or_comma_separated_variables(monkeypatch):
    monkeypatch.setenv("BATON_DECODE", "a:1, b:2")
    assert _configs("router")["router"]["decode"] == ("a:1", "b:2")
    got = _configs("router", "--decode", "c:3", "--decode", "d:4,e:5")
    assert got["router"]["decode"] == ("c:3", "d:4", "e:5")


def test_up_hands_the_workers_every_engine_flag():
    args, flags = parse(["up", "--kv-cache-gib", "0.5", "--no-enable-prefix-caching",
                         "--scheduling-policy", "priority", "--kv-lease-timeout", "9",
                         "--kv-load-failure-policy", "fail", "--max-num-seqs", "3"])
    for role in ("prefill", "decode"):
        sent = argv_for(args, flags, role)
        worker_args, worker_flags = parse(["serve", "--role", role, *sent])
        got = values(worker_args, worker_flags, role)
        want = values(args, flags, role)
        assert got == want
        engine = EngineConfig(**got["engine"])
        assert (engine.kv_cache_gib, engine.enable_prefix_caching, engine.max_num_seqs,
                engine.scheduling_policy) == (0.5, False, 3, "priority")
    assert "--kv-lease-timeout" in argv_for(args, flags, "prefill")
    assert "--kv-lease-timeout" not in argv_for(args, flags, "decode")
    # Every engine field has its flag (the speculative config: one flag per its field).
    # kv_role is set by --kv-transfer-config's JSON alone (vLLM has no flag for it); the
    # cluster token and its opt-out are the service's and the worker's, which WorkerConfig
    # copies into the engine's config (checked below).
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {
        "speculative", "kv_role", "cluster_token", "insecure_no_cluster_auth"}
    engine_fields |= {f"spec.{f.name}" for f in dataclasses.fields(SpecConfig)}
    covered = {field if c == "engine" else f"spec.{field}" for f in FLAGS
               for c, field in f.fills if c in ("engine", "spec")}
    assert engine_fields == covered, engine_fields ^ covered


def test_speculative_flags_reach_the_engine_config(monkeypatch):
    got = _configs("decode", "--speculative-method", "ngram", "--num-speculative-tokens", "3",
                   "--ngram-max", "5", "--speculative-disable-by-batch-size", "4",
                   monkeypatch=monkeypatch)
    spec = SpecConfig(**got["spec"])
    assert (spec.method, spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max,
            spec.disable_batch_size) == ("ngram", 3, 2, 5, 4)
    assert SpecConfig(**_configs("decode", monkeypatch=monkeypatch)["spec"]).method is None
    with pytest.raises(ValueError, match="ngram_min <= ngram_max"):
        SpecConfig(**_configs("decode", "--speculative-method", "ngram", "--ngram-min", "6",
                              monkeypatch=monkeypatch)["spec"])


def test_the_loading_flags_reach_the_engine_and_the_router(monkeypatch):
    argv = ("--model", "Qwen/Qwen2.5-0.5B-Instruct", "--tokenizer", "org/tok", "--revision",
            "v1", "--served-model-name", "qwen", "--dtype", "auto", "--max-model-len", "4096")
    worker = _configs("prefill", *argv, "--generation-config", "none")
    engine = EngineConfig(**worker["engine"])
    assert (engine.model, engine.tokenizer, engine.revision, engine.served_model_name) == (
        "Qwen/Qwen2.5-0.5B-Instruct", "org/tok", "v1", "qwen")
    assert (engine.dtype, engine.max_model_len, engine.generation_config) == (
        "auto", 4096, "none")
    router = RouterConfig(**_configs("router", *argv[:8], "--decode", "d:1")["router"])
    assert (router.model, router.tokenizer, router.revision, router.served_model_name) == (
        "Qwen/Qwen2.5-0.5B-Instruct", "org/tok", "v1", "qwen")
    colocated = _configs("colocated", "--served-model-name", "x")
    assert colocated["router"]["served_model_name"] == colocated["engine"]["served_model_name"]




def test_the_grammar_compile_bounds_reach_every_engine_and_bad_ones_are_refused(monkeypatch):
    for role in ("prefill", "decode", "colocated"):
        got = _configs(role, "--grammar-compile-timeout", "2.5", "--grammar-compile-threads",
                       "3", "--grammar-compile-queue", "5", monkeypatch=monkeypatch)
        engine = EngineConfig(**got["engine"])
        assert (engine.grammar_compile_timeout_s, engine.grammar_compile_threads,
                engine.grammar_compile_queue) == (2.5, 3, 5)
    for field, bad in (("grammar_compile_timeout_s", 0.0), ("grammar_compile_threads", 0),
                       ("grammar_compile_queue", -1)):
        with pytest.raises(ValueError, match=f"{field} must be"):
            EngineConfig(**{field: bad})
