"""`--model` and `--tokenizer` as users pass them: a local GGUF file or HF directory, or a
hub id read from the huggingface_hub cache, offline mode honoured."""

from __future__ import annotations

import pytest

from baton.services.common.model_source import model_name, resolve_model, resolve_tokenizer
from baton.services.engine import LLM
from tests.tiny_models import build, put_in_hub_cache

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, model_path):
    from baton.services.common.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("models") / "tiny-qwen3"
    build("qwen3", folder, load_tokenizer(model_path))
    return folder


@pytest.fixture
def hub(tmp_path, tiny_dir, monkeypatch):
    """An offline hub cache holding `org/tiny-qwen3` (huggingface_hub reads these
    constants at call time)."""
    from huggingface_hub import constants

    put_in_hub_cache(tiny_dir, tmp_path / "hub", "org/tiny-qwen3", COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_local_paths_resolve_to_themselves(model_path, tiny_dir):
    assert resolve_model(model_path) == model_path
    assert resolve_model(str(tiny_dir)) == tiny_dir
    assert model_name(str(tiny_dir)) == "tiny-qwen3"
    assert model_name(model_path) == model_path.name
    assert model_name("org/name") == "org/name"


def test_a_cached_hub_id_resolves_offline_to_its_snapshot(hub):
    path = resolve_model("org/tiny-qwen3")
    assert path == hub / "models--org--tiny-qwen3" / "snapshots" / COMMIT
    assert (path / "config.json").exists()
    assert resolve_model("org/tiny-qwen3", revision=COMMIT) == path
    with pytest.raises(ValueError, match="offline mode .* not in the cache"):
        resolve_model("org/tiny-qwen3", revision="v2")


def test_an_uncached_hub_id_offline_is_a_clear_error(hub):
    with pytest.raises(ValueError, match=r"model 'org/absent': offline mode \(HF_HUB_OFFLINE\)"):
        resolve_model("org/absent")


@pytest.mark.parametrize("bad", ["a/b/c", "no such dir/", "x.gguf"])
def test_what_is_neither_a_path_nor_a_hub_id_is_refused(bad):
    with pytest.raises(ValueError, match="neither a .gguf file, an HF model directory"):
        resolve_model(bad)


def test_a_folder_without_config_json_is_refused(tmp_path):
    with pytest.raises(ValueError, match="neither"):
        resolve_model(str(tmp_path))


def test_an_engine_serves_a_hub_id_with_another_tokenizer(hub, tiny_dir, model_path):
    """The engine names the model by its hub id (the same on every host), and reads
    --tokenizer from where it says: here the default model's GGUF."""
    assert resolve_tokenizer(None, "org/tiny-qwen3") == resolve_model("org/tiny-qwen3")
    llm = LLM(model="org/tiny-qwen3", tokenizer=str(model_path), dtype="float32",
              kv_cache_gib=0.001, served_model_name="qwen-tiny")
    info = llm.engine.model_info
    assert (info.model, info.served_model_name, info.family) == (
        "org/tiny-qwen3", "qwen-tiny", "qwen3")
    assert llm.engine.kv_layout.model == f"org/tiny-qwen3@{COMMIT}"
    assert llm.tokenizer.name_or_path.endswith(".tokenizer")  # the GGUF's saved tokenizer


def test_a_snapshot_path_is_named_by_its_hub_id_and_pairs_by_commit(hub):
    """Given as a hub id or as the path of its cache snapshot, a model has one name (so
    workers started either way pair), and its KV layout carries the commit (so workers on
    different revisions never do)."""
    from baton.services.common.model_source import model_commit

    snap = resolve_model("org/tiny-qwen3")
    assert model_name(str(snap), snap) == model_name("org/tiny-qwen3", snap) == "org/tiny-qwen3"
    assert model_commit(snap) == COMMIT
    llm = LLM(model=str(snap), dtype="float32", kv_cache_gib=0.001)
    assert llm.engine.model_info.served_model_name == "org/tiny-qwen3"
    assert llm.engine.kv_layout.model == f"org/tiny-qwen3@{COMMIT}"


def test_the_model_revision_is_not_the_tokenizers(hub, tmp_path, tiny_dir, monkeypatch):
    put_in_hub_cache(tiny_dir, hub, "org/tok")  # at another commit
    assert resolve_tokenizer("org/tok", "org/tiny-qwen3", revision=COMMIT).exists()
    with pytest.raises(ValueError, match="org/tok' at revision 'v9'"):
        resolve_tokenizer("org/tok", "org/tiny-qwen3", revision=COMMIT,
                          tokenizer_revision="v9")


def test_a_router_needs_only_the_gguf_tokenizer_folder(tmp_path):
    """The router image carries the `<name>.tokenizer/` folder, not the GGUF."""
    assert resolve_tokenizer(None, tmp_path / "absent.gguf") == tmp_path / "absent.gguf"


def test_an_unsupported_hub_model_is_refused_before_its_weights(hub, tmp_path):
    """config.json is read first: a GPT-2 repository fails without fetching weights (the
    cache holds only its config, so fetching anything more would fail offline too)."""
    from baton.services.engine.loader import resolve_model_path

    only_config = tmp_path / "gpt2"
    only_config.mkdir()
    (only_config / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    put_in_hub_cache(only_config, hub, "org/gpt2")
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        resolve_model_path("org/gpt2")
