"""P/D between engines of different tensor-parallel sizes (prefill TP=2 -> decode TP=1 and
TP=1 -> TP=2), over the gRPC stream's receiver and over NIXL: the greedy text of one TP=1
engine, every block freed on both sides, no lease left, and each decode rank pulled
exactly its slice of the heads. (The tiny serving model: 2 KV heads, one per rank at
TP=2; the ranks forked, engine_fixtures.py forked_ranks.)"""

from __future__ import annotations

import pytest

from baton.kv_transfer.base import KVHandle
from baton.kv_transfer.blocks import read_heads
from baton.kv_transfer.grpc_stream import GrpcStreamReceiver
from baton.kv_transfer.head_map import rank_block_bytes
from baton.kv_transfer.lease_check import LeaseCheckedReceiver
from baton.services.engine import SamplingParams
from tests.integration.engine_helpers import run_steps

pytestmark = pytest.mark.usefixtures("forked_ranks")  # engine_fixtures.py

PROMPTS = ["The capital of France is",
           "Paged KV blocks move between workers of different sizes. " * 4,
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,"]
PARAMS = SamplingParams(max_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def want(make_llm, tiny_model):
    llm = make_llm(model=str(tiny_model), dtype="float32")
    return [o.text for o in llm.generate(PROMPTS, PARAMS)]


def _fetch_from(p):
    """The gRPC stream's fetch in process: the heads asked for, as ReadKvBlocks reads
    them from the prefill engine's ranks, in uneven messages."""
    def fetch(handle: KVHandle, block_ids: list[int], heads: range):
        data = read_heads(p.rank_kv_caches, p.kv_layout.num_kv_heads, block_ids, heads)
        step = max(1, len(data) // 3 + 7)
        for i in range(0, len(data), step):
            yield data[i:i + step]
    return fetch


def _pair(make_llm, tiny_model, p_tp: int, d_tp: int, transport: str):
    p = make_llm(model=str(tiny_model), dtype="float32", tensor_parallel_size=p_tp,
                 max_num_batched_tokens=64).engine
    made: dict = {}

    def receiver(layout, rank_caches):
        if transport == "grpc":
            made["r"] = GrpcStreamReceiver(layout, rank_caches, _fetch_from(p))
        else:
            from baton.kv_transfer.nixl_connector import NixlConnector

            made["r"] = NixlConnector(f"decode-{p_tp}{d_tp}", layout, rank_caches)
        return LeaseCheckedReceiver(made["r"], confirm=lambda h: p.release_lease(
            h.request_id, h.lease_id))

    d = make_llm(model=str(tiny_model), dtype="float32", tensor_parallel_size=d_tp,
                 kv_receiver=receiver).engine
    sender = None
    metadata = b""
    if transport == "nixl":
        from baton.kv_transfer.nixl_connector import NixlConnector

        sender = NixlConnector("prefill-0", p.kv_layout, p.rank_kv_caches)
        metadata = sender.metadata()
    made["r"].add_peer("prefill-0", p.kv_layout, metadata)
    return p, d, made["r"], sender


@pytest.mark.parametrize("transport", ["grpc", "nixl"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_pd_between_tp_sizes_equals_one_engine(make_llm, tiny_model, want, p_tp, d_tp,
                                               transport):
    if transport == "nixl":
        pytest.importorskip("nixl_cu12", reason="NIXL is not installed here")
    p, d, receiver, sender = _pair(make_llm, tiny_model, p_tp, d_tp, transport)
    assert (p.kv_layout.tp_size, d.kv_layout.tp_size) == (p_tp, d_tp)
    assert p.kv_layout.fingerprint == d.kv_layout.fingerprint
    for i, prompt in enumerate(PROMPTS):
        p.add_request(prompt, PARAMS, request_id=f"r{i}", kv_hold=True)
    firsts = {rid: outs[-1] for rid, outs in run_steps(p)[0].items()}
    blocks = 0
    for rid, o in firsts.items():
        handle = KVHandle("prefill-0", rid, o.kv_lease_id, tuple(o.kv_block_ids),
                          len(o.prompt_token_ids), verified=True,
                          fingerprint=p.kv_layout.fingerprint)
        d.add_remote_request(o.prompt_token_ids, o.new_token_ids[0], handle, PARAMS,
                             request_id=rid)
        blocks += len(o.kv_block_ids)
    outs, _ = run_steps(d)
    texts = [firsts[f"r{i}"].new_text + "".join(o.new_text for o in outs[f"r{i}"])
             for i in range(len(PROMPTS))]
    assert texts == want
    assert d.stats().num_blocks_pulled == blocks and d.stats().num_load_failures == 0
    # Each decode rank pulled its heads of every block, and nothing else.
    assert receiver.pulled_bytes == [blocks * rank_block_bytes(d.kv_layout, r)
                                     for r in range(d_tp)]
    assert p.stats().num_leases == 0, "every lease was released by the pull's check"
    for engine in (p, d):
        assert not engine.has_unfinished_requests()
        engine.pool.check_all_free()
    receiver.close()
    if sender is not None:
        sender.close()
