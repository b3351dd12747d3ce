"""LoRA bad input: each bad adapter directory, name or setting is refused with a
ValueError saying why (NotFound for an adapter the engine does not hold), before anything
is queued, and the engine serves on; --lora-modules entries load at start."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from baton.services.common.errors import NotFound
from baton.services.engine import SamplingParams
from baton.services.engine.config import EngineConfig
from baton.services.lora.adapter import LoRARequest
from tests.integration.engine_helpers import kv_gib, run_steps
from tests.lora_adapters import peft_greedy, save_adapter

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPT = [300, 301, 302, 303, 304]
PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, model_path):
    """(HF reference model, its directory, a good rank-4 adapter's directory)."""
    from baton.services.common.tokenizer import load_tokenizer
    from tests.tiny_models import build

    root = tmp_path_factory.mktemp("lora-bad")
    model = build("qwen3", root / "model", load_tokenizer(model_path))
    return model, root / "model", save_adapter(model, root / "good", 4, 1)


@pytest.fixture(scope="module")
def engine(make_llm, qwen3):
    folder = qwen3[1]
    return make_llm(model=str(folder), dtype="float32", enable_lora=True, max_loras=2,
                    max_lora_rank=16, kv_cache_gib=kv_gib(folder, 16)).engine


def hand_made(folder, tensors: dict, **config):
    """A PEFT directory written by hand: adapter_config.json and the safetensors."""
    from safetensors.torch import save_file

    folder.mkdir()
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
           **config}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(folder / "adapter_model.safetensors"))
    return folder


def pair(module: str, layer: int = 0, rank: int = 4, size_in: int = 64, size_out: int = 128):
    key = f"{PREFIX}.{layer}.{module}"
    return {f"{key}.lora_A.weight": torch.randn(rank, size_in),
            f"{key}.lora_B.weight": torch.randn(size_out, rank)}


def edited(good, folder, **changes):
    """A copy of a good adapter with adapter_config.json's keys changed."""
    shutil.copytree(good, folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))
    return folder


def other_size(tmp):
    """An adapter made by peft for a Llama of other head sizes (q is 64 rows, not 128)."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import family_configs

    model = AutoModelForCausalLM.from_config(family_configs(256)["llama"])
    return save_adapter(model, tmp / "llama", 4, 1)


def truncated(good, folder):
    shutil.copytree(good, folder)
    st = folder / "adapter_model.safetensors"
    st.write_bytes(st.read_bytes()[:100])
    return folder


# case -> (build(model, good adapter, tmp folder) -> the path, what the error says)
BAD = {
    "missing": (lambda m, g, t: t / "nowhere", "is not a directory"),
    "a file": (lambda m, g, t: g / "adapter_config.json", "is not a directory"),
    "no config": (lambda m, g, t: t, "no adapter_config.json"),
    "bad json": (lambda m, g, t: (t / "adapter_config.json").write_text("{r: 4") and t,
                 "does not read"),
    "json list": (lambda m, g, t: (t / "adapter_config.json").write_text("[4]") and t,
                  "not an object"),
    "no weights": (lambda m, g, t: (t / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8})) and t,
        "no adapter_model.safetensors"),
    "truncated": (lambda m, g, t: truncated(g, t / "x"), "do not read"),
    "rank 32": (lambda m, g, t: save_adapter(m, t / "x", 32, 1), "rank 32 is above"),
    "qkv_proj": (lambda m, g, t: hand_made(t / "x", pair("self_attn.qkv_proj", size_out=256)),
                 "targets a module"),
    "layer 2": (lambda m, g, t: hand_made(t / "x", pair("self_attn.q_proj", layer=2)),
                "targets a module"),
    "lm_head": (lambda m, g, t: save_adapter(m, t / "x", 4, 1, targets=["lm_head"]),
                "lm_head"),
    "embed_tokens": (lambda m, g, t: save_adapter(m, t / "x", 4, 1, targets=["embed_tokens"]),
                     "embed_tokens"),
    # The config's targets as a regex (peft allows it): the weights' names are refused.
    "lm_head weights": (lambda m, g, t: hand_made(
        t / "x", {"base_model.model.lm_head.lora_A.weight": torch.randn(4, 64),
                  "base_model.model.lm_head.lora_B.weight": torch.randn(49152, 4)},
        target_modules=".*lm_head"), "lm_head.lora_A.weight is not a LoRA A or B"),
    "A alone": (lambda m, g, t: hand_made(
        t / "x", {k: v for k, v in pair("self_attn.q_proj").items() if "lora_A" in k}),
        "without its pair"),
    "other model": (lambda m, g, t: other_size(t), "this model needs"),
    "dora": (lambda m, g, t: edited(g, t / "x", use_dora=True), "use_dora"),
    "bias": (lambda m, g, t: edited(g, t / "x", bias="all"), "bias 'all'"),
    "modules_to_save": (lambda m, g, t: edited(g, t / "x", modules_to_save=["lm_head"]),
                        "modules_to_save"),
    "prompt tuning": (lambda m, g, t: edited(g, t / "x", peft_type="PROMPT_TUNING"),
                      "is not LORA"),
}


def assert_nothing_queued(engine):
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapter_is_refused(engine, qwen3, tmp_path, case):
    model, _, good = qwen3
    build, says = BAD[case]
    path = str(build(model, good, tmp_path))
    before = engine.stats().loras
    with pytest.raises(ValueError, match=says):
        engine.load_lora("bad", path)
    with pytest.raises(ValueError, match=says):  # a path given with a request: read there
        engine.add_request(PROMPT, GREEDY, lora=LoRARequest("bad", lora_path=path))
    assert_nothing_queued(engine)
    assert engine.stats().loras == before and "bad" not in engine.runner.lora.adapters
    with pytest.raises(NotFound):  # it was never taken in
        engine.add_request(PROMPT, GREEDY, lora=LoRARequest("bad"))
    assert_nothing_queued(engine)


@pytest.mark.parametrize("name", ["", "has space", "a" * 129, "semi;colon", "new\nline"])
def test_bad_adapter_name_is_refused(engine, qwen3, name):
    good = str(qwen3[2])
    with pytest.raises(ValueError, match="LoRA adapter name"):
        engine.load_lora(name, good)
    if name:  # an empty name in a request means the base model
        with pytest.raises(ValueError, match="LoRA adapter name"):
            engine.add_request(PROMPT, GREEDY, lora=LoRARequest(name, lora_path=good))
    assert_nothing_queued(engine)


def test_unknown_adapter_is_not_found(engine):
    with pytest.raises(NotFound, match="'nope'"):
        engine.add_request(PROMPT, GREEDY, lora=LoRARequest("nope"))
    assert_nothing_queued(engine)


def test_engine_serves_after_bad_input(engine, qwen3):
    """After every refusal above, the good adapter and the base model still run."""
    model, _, good = qwen3
    engine.load_lora("good", str(good))
    ids = [engine.add_request(PROMPT, GREEDY, lora=LoRARequest("good")),
           engine.add_request(PROMPT, GREEDY)]
    per_req, _ = run_steps(engine)
    want = peft_greedy(model, [(PROMPT, "good"), (PROMPT, None)], {"good": good}, 4)
    assert [per_req[i][-1].token_ids for i in ids] == want
    assert want[0] != want[1], "the adapter was meant to change the output"


def test_lora_off_refuses_adapters(make_llm, qwen3):
    _, folder, good = qwen3
    engine = make_llm(model=str(folder), dtype="float32",
                      kv_cache_gib=kv_gib(folder, 8)).engine
    with pytest.raises(ValueError, match="--enable-lora"):
        engine.add_request(PROMPT, GREEDY, lora=LoRARequest("good", lora_path=str(good)))
    with pytest.raises(ValueError, match="--enable-lora"):
        engine.add_request(PROMPT, GREEDY, lora=LoRARequest("good"))
    with pytest.raises(ValueError, match="--enable-lora"):
        engine.load_lora("good", str(good))
    assert_nothing_queued(engine)
    assert engine.stats().loras == ()


@pytest.mark.parametrize("kw, says", [
    (dict(lora_modules=("a=/x",)), "needs enable_lora"),
    (dict(enable_lora=True, max_loras=4, max_cpu_loras=3), "max_cpu_loras"),
    (dict(enable_lora=True, max_loras=0), "max_loras"),
    (dict(enable_lora=True, max_lora_rank=0), "max_lora_rank"),
    (dict(enable_lora=True, lora_modules=("noequals",)), "name=path"),
    (dict(enable_lora=True, lora_modules=("a=",)), "name=path"),
    (dict(enable_lora=True, lora_modules=("=/x",)), "LoRA adapter name"),
    (dict(enable_lora=True, lora_modules=("bad name=/x",)), "LoRA adapter name"),
    (dict(enable_lora=True, lora_modules=('{"name": "a"}',)), "name=path"),
    (dict(enable_lora=True, lora_modules=("{not json",)), "name=path"),
])
def test_bad_lora_settings(kw, says):
    with pytest.raises(ValueError, match=says):
        EngineConfig(**kw)


def test_lora_modules_load_at_start(make_llm, qwen3, tmp_path):
    model, folder, good = qwen3
    other = save_adapter(model, tmp_path / "b", 8, 2, targets=["v_proj", "up_proj"])
    specs = (f"a={good}", json.dumps({"name": "b", "path": str(other)}))
    engine = make_llm(model=str(folder), dtype="float32", enable_lora=True, max_loras=2,
                      lora_modules=specs, kv_cache_gib=kv_gib(folder, 8)).engine
    assert engine.stats().loras == ("a", "b")
    assert set(engine.runner.lora.adapters) == {"a", "b"}
    ids = [engine.add_request(PROMPT, GREEDY, lora=LoRARequest(n)) for n in ("a", "b")]
    per_req, _ = run_steps(engine)
    want = peft_greedy(model, [(PROMPT, "a"), (PROMPT, "b")], {"a": good, "b": other}, 4)
    assert [per_req[i][-1].token_ids for i in ids] == want


def test_bad_lora_module_stops_the_start(make_llm, qwen3, tmp_path):
    folder = qwen3[1]
    with pytest.raises(ValueError, match="is not a directory"):
        make_llm(model=str(folder), dtype="float32", enable_lora=True,
                 lora_modules=(f"a={tmp_path / 'nowhere'}",), kv_cache_gib=kv_gib(folder, 8))
