"""Shared fixtures. Every engine made through `make_llm` is checked after every test:
no request left, every block free with ref count zero."""

from __future__ import annotations

import logging
import os
import weakref

import torch

# Without a GPU, Triton kernels run under Triton's interpreter. It is chosen when a kernel
# is decorated, so this must be set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from services.engine import LLM
from services.engine.default_model import ensure_default_model

# Weak: an engine is checked while its fixture keeps it, and freed with it.
_ENGINES: weakref.WeakSet[LLM] = weakref.WeakSet()


@pytest.fixture(scope="session")
def model_path():
    return ensure_default_model()


@pytest.fixture(scope="session")
def make_llm(model_path):
    """Build an LLM over the default model; kwargs are EngineConfig fields."""
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
