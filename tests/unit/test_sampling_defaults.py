"""The defaults of unset sampling values: SamplingParams' own, spelled once (the proto's
comments say them in prose), and the model's generation_config.json, which the router
reads as the workers do (services/common/generation_config.py), so it checks a request
with the values the workers will run it with."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from baton.router.config import RouterConfig
from baton.router.openai.protocol import CompletionRequest
from baton.router.server import build
from baton.services.common.generation_config import SAMPLING_KEYS, read_generation_config
from baton.services.common.sampling_params import DEFAULTS
from baton.services.rpc.convert import sampling_params
from baton.services.rpc.errors import InvalidArgument
from baton.services.rpc.server import Lifecycle
from baton.v1 import generation_pb2 as gen

PROTO = Path(__file__).parents[2] / "protos" / "baton" / "v1" / "generation.proto"
# A model's defaults, as Qwen3's file sets them (and a max_new_tokens).
MODEL = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05,
         "max_new_tokens": 40, "eos_token_id": [2, 7]}
INFO = gen.ModelInfo(max_model_len=2048, vocab_size=1 << 16)


def _proto_defaults() -> dict[str, str]:
    """SamplingParams' fields whose proto comment says "Default X.", with X."""
    text = PROTO.read_text()
    body = text[text.index("message SamplingParams {"):]
    body = body[:body.index("\n}")]
    out, comment = {}, ""
    for line in body.splitlines()[1:]:
        line = line.strip()
        if line.startswith("//"):
            comment += " " + line[2:].strip()
            continue
        field = re.match(r"(?:optional |repeated )?\w+ (\w+) = \d+;", line)
        said = re.search(r"Default (\S+)\.", comment)
        if field and said:
            out[field.group(1)] = said.group(1)
        comment = ""
    return out


def test_the_protos_comments_say_sampling_params_defaults():
    said = _proto_defaults()
    assert len(said) >= 10, said
    for name, text in said.items():
        value = {"true": True, "false": False}.get(text, text)
        assert value == DEFAULTS[name] or float(value) == DEFAULTS[name], (name, text)


def test_a_completion_without_max_tokens_gets_the_one_default():
    (req,) = CompletionRequest(model="m", prompt="p").requests(2048, {"max_tokens": 40})
    assert req.sampling.max_tokens == DEFAULTS["max_tokens"]  # vLLM's: the file's aside


def _folder(tmp_path: Path, settings: dict) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(settings))
    return tmp_path


def test_the_reader_takes_what_transformers_takes(tmp_path):
    from transformers import GenerationConfig

    for settings in (MODEL, {"top_k": 0, "do_sample": True}, {"temperature": 1.0},
                     {"eos_token_id": 5, "max_length": 100}):
        folder = _folder(tmp_path, settings)
        diff = GenerationConfig.from_pretrained(str(folder)).to_diff_dict()
        eos, defaults = read_generation_config("auto", folder)
        theirs = {SAMPLING_KEYS[k]: v for k, v in diff.items()
                  if k in SAMPLING_KEYS and v is not None}
        if theirs.get("top_k") == 0:
            theirs["top_k"] = -1
        assert defaults == theirs, settings
        want = diff.get("eos_token_id")
        assert list(eos) == (want if isinstance(want, list) else [want] if want else [])


def test_the_router_resolves_a_request_as_the_worker_does(tmp_path, make_llm, tiny_model, tok):
    """The router (its intake) and a worker (its engine) read the same folder: a request
    that leaves max_tokens unset with min_tokens over SamplingParams' default of 16
    passes the router (the worker takes it: the model's max_new_tokens is higher), and
    both resolve it to the same SamplingParams."""
    folder = _folder(tmp_path, MODEL)
    llm = make_llm(model=str(tiny_model), dtype="float32", max_model_len=64,
                   kv_cache_gib=0.01, generation_config=str(folder))
    worker = llm.engine.sampling_defaults
    router = build(RouterConfig(model=str(tok), generation_config=str(folder)),
                   Lifecycle())
    try:
        assert router.intake.sampling_defaults == worker and worker
        minimum = DEFAULTS["max_tokens"] + 1
        request = gen.GenerateRequest(token_ids=gen.TokenIds(ids=[1, 2]),
                                      sampling=gen.SamplingParams(min_tokens=minimum))
        job = asyncio.run(router.intake.job(request, INFO))
        routed = sampling_params(job.request.sampling, router.intake.sampling_defaults)
        assert routed == sampling_params(job.request.sampling, worker)
        with pytest.raises(ValueError, match="min_tokens"):  # without the model's defaults
            sampling_params(job.request.sampling)
        # A request the worker would refuse is refused by the router already.
        over = gen.GenerateRequest(token_ids=gen.TokenIds(ids=[1, 2]),
                                   sampling=gen.SamplingParams(min_tokens=worker["max_tokens"] + 1))
        with pytest.raises(ValueError):
            sampling_params(over.sampling, worker)
        with pytest.raises(InvalidArgument, match="^sampling: min_tokens"):
            asyncio.run(router.intake.job(over, INFO))
    finally:
        router.intake.close()


def test_the_router_reads_the_models_own_folder_as_the_workers_do(tmp_path, tiny_model):
    """`--generation-config auto`: the file in the model's folder, also when --tokenizer
    names another folder."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    _folder(folder, MODEL)
    want = read_generation_config("auto", folder)[1]
    for config in (RouterConfig(model=str(folder)),
                   RouterConfig(model=str(folder), tokenizer=str(tiny_model))):
        router = build(config, Lifecycle())
        router.intake.close()
        assert router.intake.sampling_defaults == want and want
    none = build(RouterConfig(model=str(folder), generation_config="none"), Lifecycle())
    none.intake.close()
    assert none.intake.sampling_defaults == {}
