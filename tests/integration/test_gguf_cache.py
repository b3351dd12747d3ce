"""The converted copy of a cached GGUF (services/engine/gguf_cache.py): a second load
gives exactly the first one's config and tensors without dequantizing; a changed GGUF is
converted again; a GGUF from outside the cache is never copied."""

from __future__ import annotations

import os

import pytest
import torch

from baton.services.engine import gguf_cache
from baton.services.engine.loader import load_gguf
from tests.tiny_models import build, gguf_ready_config, write_gguf


@pytest.fixture(scope="module")
def gguf(tmp_path_factory, model_path):
    from baton.services.common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    folder = tmp_path_factory.mktemp("gguf")
    hf = build("gemma2", folder / "hf", tokenizer,
               cfg=gguf_ready_config("gemma2", len(tokenizer)))
    path = folder / "cache" / "models" / "tiny.gguf"
    path.parent.mkdir(parents=True)
    write_gguf(hf, "gemma2", path, tokenizer)
    return path


def _load(path):
    config, weights = load_gguf(path)
    return config, dict(weights)


def test_second_load_reads_the_copy_and_equals_the_first(gguf, monkeypatch):
    monkeypatch.setenv("BATON_CACHE", str(gguf.parents[1]))
    first_config, first = _load(gguf)
    assert gguf_cache.entry(gguf).exists()
    import gguf as gguf_lib

    def no_reader(*a, **k):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(gguf_lib, "GGUFReader", no_reader)
    config, again = _load(gguf)
    assert config == first_config
    assert again.keys() == first.keys()
    for name, t in first.items():
        assert torch.equal(again[name], t), name


def test_a_changed_gguf_is_converted_again(gguf, monkeypatch):
    monkeypatch.setenv("BATON_CACHE", str(gguf.parents[1]))
    _load(gguf)
    assert gguf_cache.read_converted(gguf) is not None
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert gguf_cache.read_converted(gguf) is None
    _load(gguf)
    assert gguf_cache.read_converted(gguf) is not None


def test_a_gguf_outside_the_cache_is_never_copied(gguf, monkeypatch, tmp_path):
    beside = gguf.with_suffix(".f32.safetensors")
    beside.unlink(missing_ok=True)
    monkeypatch.setenv("BATON_CACHE", str(tmp_path / "elsewhere"))
    config, weights = _load(gguf)
    assert weights and not beside.exists()
