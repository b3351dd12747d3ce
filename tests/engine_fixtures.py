"""The session's models and engines (a pytest plugin, registered by tests/conftest.py).
Every engine made through `make_llm` is checked after every test: no request left, every
block free with ref count zero.

Nothing here imports torch or the engine until a fixture is used: the torch-free tests
(the client, the router, services/common, the CLI's flags) run without either."""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

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


@pytest.fixture(scope="module")
def llm(make_llm):
    """A small fp32 engine shared by a test module."""
    return make_llm(dtype="float32", max_num_batched_tokens=128, max_num_seqs=16)


@pytest.fixture(scope="session")
def hf_model(model_path):
    """HF transformers' own Llama, loaded by transformers' own GGUF reader (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
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
