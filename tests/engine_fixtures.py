"""The session's models and engines (a pytest plugin, registered by tests/conftest.py).
Every engine made through `make_llm` is checked after every test: no request left, every
block free with ref count zero.

Nothing here imports torch or the engine until a fixture is used: the torch-free tests
(the client, the router, services/common, the CLI's flags) run without either."""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.tiny_models import FAMILIES

if TYPE_CHECKING:
    from baton.services.engine import LLM

# Weak: an engine is checked while its fixture keeps it, and freed with it.
_ENGINES: weakref.WeakSet[LLM] = weakref.WeakSet()


@pytest.fixture(scope="session")
def model_path():
    from baton.services.common.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, model_path) -> Path:
    """An HF directory of the tiny serving model (tests/tiny_models.py serving_config)."""
    from baton.services.common.tokenizer import load_tokenizer
    from tests.tiny_models import build, serving_config

    folder = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    tokenizer = load_tokenizer(model_path)
    build("llama", folder, tokenizer, cfg=serving_config(len(tokenizer)))
    return folder


@pytest.fixture(scope="session")
def make_llm(model_path):
    """Build an LLM over the default model; kwargs are EngineConfig fields."""
    from baton.services.engine import LLM

    def make(**kwargs) -> LLM:
        kwargs.setdefault("kv_cache_gib", 0.25)
        # On a GPU each engine would take 90% of it; the session keeps several alive.
        kwargs.setdefault("gpu_memory_utilization", 0.03)
        llm = LLM(**kwargs)
        _ENGINES.add(llm)
        return llm

    return make


# What a tensor-parallel rank imports before it runs (torch, transformers, the runner),
# and as it loads: AutoConfig and the family's config class, which it imports on first
# use (Llama's pulls in torch.distributed.tensor: 1 s of each rank's start).
RANK_IMPORTS = ["baton.services.engine.tp_ranks", "baton.services.engine.build",
                "transformers.models.auto.configuration_auto",
                *(f"transformers.models.{family}.configuration_{family}"
                  for family in FAMILIES)]


@pytest.fixture(scope="module")
def forked_ranks():
    """Tensor-parallel ranks forked from multiprocessing's fork server, which has imported
    RANK_IMPORTS once (the e2e zygote's idea), instead of spawned: a spawned rank spends
    about 4 s of CPU on those imports, most of a TP=2 engine's start on two cores, a
    forked one none. A forked rank still gets its config, rendezvous and report pipe
    pickled and runs `tp_ranks.follow`, as a spawned one does. For the modules that check
    what the ranks compute; how a spawned rank starts (the main module imported again, a
    rank that fails before it joins) is test_tp_start.py's, and the e2e workers spawn
    theirs. BATON_TEST_SPAWN_RANKS=1 spawns them here too. The server keeps the
    environment it started with: a test that sets a variable for its ranks spawns them."""
    if os.environ.get("BATON_TEST_SPAWN_RANKS") == "1":
        yield
        return
    import multiprocessing
    import multiprocessing.forkserver

    from baton.services.engine import tp_ranks

    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(RANK_IMPORTS)  # where the server is not up yet
    multiprocessing.forkserver.ensure_running()  # its imports run while the module sets up

    class Forking:
        """tp_ranks' `mp`: the context it asks for ("spawn") is the fork server's."""

        @staticmethod
        def get_context(method: str):
            assert method == "spawn", method
            return forkserver

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tp_ranks, "mp", Forking)
        yield


@pytest.fixture(scope="module")
def llm(make_llm):
    """A small fp32 engine shared by a test module."""
    return make_llm(dtype="float32", max_num_batched_tokens=128, max_num_seqs=16)


@pytest.fixture(scope="session")
def hf_model(model_path):
    """HF transformers' own Llama, loaded by transformers' own GGUF reader (the reference).
    Two of gguf's functions it calls are remembered while it loads, as they give the same
    object for the same arguments: the reader, which transformers makes twice (config,
    then tensors), each parsing the 49k-token list; and the tensor name map, which it
    makes again for each of ~400 modules. 13 s of loading becomes 5; the weights are
    the same."""
    import functools

    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    with pytest.MonkeyPatch.context() as mp:
        for name in ("GGUFReader", "get_tensor_name_map"):
            mp.setattr(gguf, name, functools.cache(getattr(gguf, name)))
        model = AutoModelForCausalLM.from_pretrained(
            str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(autouse=True)
def pool_invariant():
    yield
    for llm in list(_ENGINES):
        engine = llm.engine
        assert not engine.has_unfinished_requests(), "a request outlived its test"
        assert not engine.scheduler.leases, "a KV lease outlived its test"
        engine.pool.check_all_free()


@pytest.fixture(scope="session")
def tok(model_path):
    """The default model's path, with the tokenizer folder the router reads saved."""
    from baton.services.common.tokenizer import load_tokenizer

    load_tokenizer(model_path)
    return model_path
