"""Shared fixtures. Every engine made through `make_llm` is checked after every test:
no request left, every block free with ref count zero."""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path

import torch

# Without a GPU, Triton kernels run under Triton's interpreter. It is chosen when a kernel
# is decorated, so this must be set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from baton.services.engine import LLM
from baton.services.engine.default_model import ensure_default_model
from tests.xdist_groups import pytest_xdist_make_scheduler  # noqa: F401 (a hook)

# Weak: an engine is checked while its fixture keeps it, and freed with it.
_ENGINES: weakref.WeakSet[LLM] = weakref.WeakSet()


@pytest.fixture(scope="session")
def model_path():
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


def pytest_configure(config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Two test processes on two cores: one torch thread each, so neither waits on
        # the other's spinning threads (the service tests' workers run one thread too).
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items) -> None:
    """Marks `e2e` on everything under tests/e2e (services as processes). Then the order:
    modules with `slow` tests first, then the e2e ones, then the many short ones, so that
    with xdist the long modules start early and the short ones even out the end."""
    for item in items:
        if "tests/e2e/" in item.nodeid:
            item.add_marker(pytest.mark.e2e)
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def rank(item) -> int:
        module = item.nodeid.split("::")[0]
        return 0 if module in slow else 1 if "tests/e2e/" in module else 2

    items.sort(key=rank)  # stable: each module keeps its own order
