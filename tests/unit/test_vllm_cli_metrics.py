"""vLLM's command line and metric names: `baton serve MODEL` is the colocated service with
vLLM's --host, --port, --api-key and --ssl-* flags (and every earlier invocation means
what it meant), and the workers export vLLM's `vllm:` metrics beside Baton's, read from
the engine's stats and from each request's outputs: exact figures on a clock the test
sets, then the counts of real requests through the engine thread."""

from __future__ import annotations

import asyncio
import re

import pytest

from baton.cli.flags import values
from baton.cli.main import main, parse, serve_address
from baton.services.common.finish import FinishReason
from baton.services.engine import SamplingParams
from baton.services.engine.outputs import EngineStats, RequestOutput
from baton.services.worker import vllm_metrics
from baton.services.worker.async_engine import AsyncEngine
from baton.services.worker.metrics import WorkerMetrics
from tests.e2e.topology import ROOT

# ---- the command line ----------------------------------------------------------------


def test_serve_model_is_colocated_with_vllms_flags(tmp_path):
    files = {}
    for name in ("cert", "key", "ca"):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_text("-")
    args, flags = parse(["serve", "org/model", "--host", "127.0.0.1", "--port", "8123",
                         "--api-key", "k1", "--ssl-certfile", str(files["cert"]),
                         "--ssl-keyfile", str(files["key"]),
                         "--ssl-ca-certs", str(files["ca"])])
    assert args.role == "colocated" and serve_address(args) == "127.0.0.1:50051"
    got = values(args, flags, "colocated")
    assert got["engine"]["model"] == got["router"]["model"] == "org/model"
    assert got["router"]["http_port"] == 8123 and got["router"]["api_keys"] == ("k1",)
    assert (got["service"]["tls_cert"], got["service"]["tls_key"],
            got["service"]["tls_ca"]) == tuple(str(files[n]) for n in ("cert", "key", "ca"))
    # vLLM's names are Baton's flags under another name: the same values.
    same, same_flags = parse(["serve", "--role", "colocated", "--model", "org/model",
                              "--address", "127.0.0.1:50051", "--http-port", "8123",
                              "--api-key", "k1", "--tls-cert", str(files["cert"]),
                              "--tls-key", str(files["key"]), "--tls-ca", str(files["ca"])])
    assert values(same, same_flags, "colocated") == got


@pytest.mark.parametrize("argv, address", [
    (["serve", "m"], "0.0.0.0:50051"),
    (["serve", "m", "--host", "::1", "--address", "10.0.0.1:7000"], "[::1]:7000"),
    (["serve", "--role", "decode", "--host", "127.0.0.1"], "127.0.0.1:50071"),
    (["serve", "--role", "router", "--address", "127.0.0.1:9"], "127.0.0.1:9"),
])
def test_host_replaces_the_host_of_the_address(argv, address):
    assert serve_address(parse(argv)[0]) == address


def test_serve_starts_the_colocated_service_with_those_configs(monkeypatch, tmp_path):
    from baton.cli import colocated

    started = []
    monkeypatch.setattr(colocated, "serve", lambda worker, router: started.append(
        (worker, router)))
    main(["serve", str(tmp_path), "--port", "8124", "--host", "127.0.0.1", "--api-key", "k"])
    (worker, router), = started
    assert worker.engine.model == router.model == str(tmp_path)
    assert worker.service.address == router.service.address == "127.0.0.1:50051"
    assert router.http_port == 8124 and router.api_keys == ("k",)


def test_earlier_invocations_mean_what_they_meant(monkeypatch):
    args, _ = parse(["serve", "--role", "router", "--decode", "d:1"])
    assert args.role == "router" and args.model is None
    monkeypatch.setenv("BATON_ROLE", "decode")  # the images and compose files
    args, flags = parse(["serve"])
    assert args.role == "decode" and "http-port" not in {f.name for f in flags}
    with pytest.raises(SystemExit):  # a worker has no HTTP API: no --port
        parse(["serve", "--port", "8000"])
    monkeypatch.delenv("BATON_ROLE")
    args, _ = parse(["up", "--port", "50051"])  # baton up's --port: the router's gRPC
    assert args.port == 50051


def test_the_positional_model_and_another_model_flag_are_refused():
    with pytest.raises(SystemExit, match="two models"):
        parse(["serve", "a/model", "--model", "b/model"])
    assert parse(["serve", "a/model", "--model", "a/model"])[0].model == "a/model"


def test_every_flag_the_vllm_page_names_is_a_baton_serve_flag(capsys):
    """docs/coming-from-vllm.md's table: each flag in it is one `baton serve` takes (its
    vLLM column included, but for the vLLM flags it maps to others)."""
    section = (ROOT / "docs" / "coming-from-vllm.md").read_text()
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", section))
    not_batons = {"--speculative-config", "--ssl-cert-reqs", "--pipeline-parallel-size",
                  "--master-addr", "--master-port", "--headless"}  # said to map elsewhere
    with pytest.raises(SystemExit):
        parse(["serve", "--help"])
    helped = capsys.readouterr().out
    assert len(flags) > 20 and not_batons <= flags
    for flag in sorted(flags - not_batons):
        assert re.search(rf"(?<![\w-]){flag}(?![\w-])", helped), flag


# ---- the metrics ---------------------------------------------------------------------

def _out(new: list[int], tokens: int, finish=None, **kw) -> RequestOutput:
    return RequestOutput("r", [1, 2, 3, 4], list(range(tokens)), "", new_token_ids=new,
                         finish_reason=finish, **kw)


def test_request_figures_on_a_set_clock(monkeypatch):
    clock = iter([10.0, 10.5, 10.7, 11.0, 20.0, 20.25, 30.0, 30.5, 40.0, 41.0])
    monkeypatch.setattr(vllm_metrics.time, "monotonic", lambda: next(clock))
    stats = EngineStats(num_waiting=2, num_loading=1, num_running=3, num_blocks=10,
                        num_free_blocks=4, num_prompt_tokens=40, num_generation_tokens=9,
                        prefix_cache_queries=50, prefix_cache_hits=16, num_preemptions=1)
    worker = WorkerMetrics(lambda: stats, "model.gguf", 1, "served")
    reg, vllm = worker.registry, worker.vllm

    seen = vllm.request()  # arrives at 10.0
    seen(_out([7], 1, queue_time=0.2, prefill_time=0.25))  # first token at 10.5
    seen(_out([8, 9], 3))  # two tokens at 10.7: 0.1 each
    seen(_out([5], 4, FinishReason.LENGTH))  # the last at 11.0: 0.3
    constrained = vllm.request()  # arrives at 20.0, ends with its constraint at 20.25
    constrained(_out([3], 1, FinishReason.CONSTRAINT))
    failed = vllm.request()  # the engine failed: not a success, nothing timed to an end
    failed(_out([], 0, FinishReason.ABORT, engine_failed=True))
    handed_off = vllm.request()  # a prefill worker's: its first token at 41.0, no end here
    handed_off(_out([6], 1, kv_block_ids=[1], kv_lease_id=1))

    def value(name, **labels):
        return reg.get_sample_value(name, {"model_name": "served", **labels})

    assert value("vllm:time_to_first_token_seconds_count") == 3
    assert value("vllm:time_to_first_token_seconds_sum") == pytest.approx(0.5 + 0.25 + 1.0)
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert value(f"{name}_count") == 3
        assert value(f"{name}_sum") == pytest.approx(0.1 + 0.1 + 0.3)
    assert value("vllm:e2e_request_latency_seconds_count") == 2
    assert value("vllm:e2e_request_latency_seconds_sum") == pytest.approx(1.0 + 0.25)
    assert value("vllm:request_queue_time_seconds_sum") == pytest.approx(0.2)
    assert value("vllm:request_prefill_time_seconds_sum") == pytest.approx(0.25)
    assert value("vllm:request_success_total", finished_reason="length") == 1
    assert value("vllm:request_success_total", finished_reason="stop") == 1
    assert value("vllm:request_success_total", finished_reason="abort") is None
    assert value("vllm:request_prompt_tokens_sum") == 8
    assert value("vllm:request_generation_tokens_sum") == 4 + 1
    # From the stats snapshot; requests waiting for their KV wait, as in vLLM.
    assert value("vllm:num_requests_waiting") == 3 and value("vllm:num_requests_running") == 3
    assert value("vllm:kv_cache_usage_perc") == value("vllm:gpu_cache_usage_perc") == 0.6
    assert value("vllm:prompt_tokens_total") == 40
    assert value("vllm:generation_tokens_total") == 9
    assert value("vllm:prefix_cache_queries_total") == 50
    assert value("vllm:prefix_cache_hits_total") == 16
    assert value("vllm:num_preemptions_total") == 1
    # Baton's own stay as they were, beside them.
    assert reg.get_sample_value("baton:num_requests_waiting", {"model_name": "model.gguf"}) == 2


def test_real_requests_move_them_through_the_engine_thread(make_llm, tiny_model):
    engine = make_llm(model=str(tiny_model), dtype="float32").engine
    aengine = AsyncEngine(engine)
    metrics = WorkerMetrics(lambda: aengine.stats, "tiny", 1, "served")
    metrics.watch(aengine)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)

    async def run(i: int) -> int:
        rid = f"r{i}"
        n = 0
        async for out in aengine.generate(rid, lambda e: e.add_request(
                prompts[i], params, request_id=rid)):
            n += len(out.new_token_ids)
        return n

    async def main():
        return await asyncio.gather(*(run(i) for i in range(3)))

    try:
        assert asyncio.run(main()) == [5, 5, 5]
    finally:
        aengine.stop()
    reg = metrics.registry

    def value(name, **labels):
        return reg.get_sample_value(name, {"model_name": "served", **labels})

    assert value("vllm:request_success_total", finished_reason="length") == 3
    assert value("vllm:time_to_first_token_seconds_count") == 3
    assert value("vllm:inter_token_latency_seconds_count") == 3 * 4
    assert value("vllm:e2e_request_latency_seconds_count") == 3
    assert value("vllm:request_generation_tokens_sum") == 15
    assert value("vllm:request_prompt_tokens_sum") == 9
    assert value("vllm:generation_tokens_total") == 15
    assert value("vllm:prompt_tokens_total") == 9
    assert value("vllm:num_requests_running") == 0 and value("vllm:kv_cache_usage_perc") == 0
