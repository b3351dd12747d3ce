"""NixlConnector between workers of different tensor-parallel sizes, in two real processes
(NIXL over UCX, DRAM to DRAM on one host, or VRAM with BATON_TEST_KV_DEVICE=cuda): a
spawned prefill worker owns every rank's caches, cut from one random whole cache; each
decode rank pulls its heads of scattered blocks from whichever prefill ranks hold them,
per head run, and must hold exactly those bytes there and nothing new anywhere else, and
count exactly its slice of the bytes. Equal sizes over two ranks pull rank to rank.

One prefill process serves the module, a fresh connector (its own NIXL agent and engine
id) for each test: a process's start and imports cost seconds, a connector a fraction of
one."""

from __future__ import annotations

import contextlib
import uuid

import pytest
import torch

pytest.importorskip("nixl_cu12")

from baton.kv_transfer.base import IncompatibleLayout, TransferState  # noqa: E402
from baton.kv_transfer.nixl_connector import NixlConnector  # noqa: E402
from tests.integration.test_nixl_connector import (  # noqa: E402
    DEVICE,
    TIMEOUT_S,
    _handle,
    _wait,
    _within,
    piped,
)
from tests.tp_caches import (  # noqa: E402
    PAIRS,
    assert_pulled,
    layout,
    slice_bytes,
    split,
    whole,
)

SENDER_BLOCKS, RECEIVER_BLOCKS = 9, 13
REMOTE, LOCAL = [7, 2, 5, 0, 8], [1, 12, 4, 6, 0]


def _on_device(rank_caches: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    return [[t.to(DEVICE) for t in layers] for layers in rank_caches]


def _prefill_main(conn) -> None:
    """Asked (engine id, KV heads, TP, dtype): every rank's caches, cut from one random
    whole cache, behind a connector of that id; answers its metadata and the whole cache.
    "done" closes the connector; "exit", or EOF (the test process gone), this process."""
    held = None
    while True:
        try:
            ask = conn.recv()
        except EOFError:
            ask = "exit"
        if held is not None:
            held[0].close()
            held = None
        if ask == "exit":
            return
        if ask == "done":
            continue
        engine_id, heads, tp, dtype = ask
        lay = layout(heads, tp, dtype)
        source = whole(lay, SENDER_BLOCKS, seed=5)
        caches = _on_device(split(lay, source))
        held = (NixlConnector(engine_id, lay, caches), caches)
        # As numpy copies: a tensor sent over a pipe moves its storage to shared memory, and
        # the one-rank caches share the whole cache's storage, registered with NIXL.
        conn.send((engine_id, held[0].metadata(),
                   [t.view(torch.uint8).numpy().copy() for t in source]))


@pytest.fixture(scope="module")
def prefill():
    """The module's prefill process (spawned, as test_nixl_connector's senders): its pipe."""
    with piped(_prefill_main) as (mine, _):
        yield mine


@contextlib.contextmanager
def _sender(prefill, heads: int, tp: int, dtype: str):
    """A sender of `heads` KV heads over `tp` ranks in the prefill process, for the
    `with` block: (its engine id, its metadata, the whole cache its ranks' caches were cut
    from)."""
    engine_id = f"prefill-tp{tp}-{uuid.uuid4().hex[:8]}"
    prefill.send((engine_id, heads, tp, dtype))
    try:
        assert prefill.poll(60), "the prefill process did not answer"
        answered, metadata, source = prefill.recv()
        assert answered == engine_id, "an answer to an earlier test's question"
        yield engine_id, metadata, [torch.from_numpy(a).view(getattr(torch, dtype))
                                    for a in source]
    finally:
        with contextlib.suppress(OSError):
            prefill.send("done")


@pytest.mark.parametrize("heads, prefill_tp, decode_tp, dtype",
                         [(*pair, "bfloat16") for pair in PAIRS]
                         + [(4, 2, 2, "bfloat16"), (4, 2, 1, "float8_e4m3fn"),
                            (2, 1, 4, "float8_e4m3fn")])
def test_each_decode_rank_pulls_exactly_its_heads(prefill, heads, prefill_tp, decode_tp,
                                                  dtype):
    dest = layout(heads, decode_tp, dtype)
    with _sender(prefill, heads, prefill_tp, dtype) as (engine_id, metadata, source):
        caches = _on_device(split(dest, whole(dest, RECEIVER_BLOCKS, seed=6)))
        before = [[t.cpu().clone() for t in layers] for layers in caches]
        receiver = NixlConnector(f"decode-tp{decode_tp}-{uuid.uuid4().hex[:8]}", dest,
                                 caches)
        try:
            receiver.add_peer(engine_id, layout(heads, prefill_tp, dtype), metadata)
            receiver.start_load("t", _handle(engine_id), REMOTE, LOCAL)
            assert _wait(receiver, "t") == (TransferState.SUCCESS, None)
            got = [[t.cpu() for t in layers] for layers in caches]
            assert_pulled(dest, got, before, source, REMOTE, LOCAL)
            assert receiver.pulled_bytes == [slice_bytes(dest, r, len(REMOTE))
                                             for r in range(decode_tp)]
        finally:
            _within(TIMEOUT_S, receiver.close)


def test_a_split_that_cannot_be_made_is_refused_naming_tp_size(prefill):
    with _sender(prefill, 4, 2, "bfloat16") as (engine_id, metadata, _):
        dest = layout(4, 1, "bfloat16")
        receiver = NixlConnector(f"decode-{uuid.uuid4().hex[:8]}", dest,
                                 split(dest, whole(dest, RECEIVER_BLOCKS, seed=7)))
        try:
            with pytest.raises(IncompatibleLayout, match="tp_size: peer 3"):
                receiver.add_peer(engine_id, layout(4, 3, "bfloat16"), metadata)
            # Metadata of two ranks given for a layout of four: refused, nothing added.
            with pytest.raises(ValueError, match="metadata of 2 ranks"):
                receiver.add_peer(engine_id, layout(4, 4, "bfloat16"), metadata)
            receiver.start_load("t", _handle(engine_id), [1], [1])
            state, reason = receiver.poll("t")
            assert state is TransferState.FAILED and "unknown peer" in reason
        finally:
            _within(TIMEOUT_S, receiver.close)
