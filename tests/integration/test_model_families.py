"""Every family Baton serves, against transformers: a tiny random-weight model of each
(tests/tiny_models.py) gives the same greedy tokens in fp32, under chunked prefill,
preemption and prefix-cache hits. Then what loading must get right: unknown
architectures refused, `--dtype auto`, the model's generation_config.json."""

from __future__ import annotations

import copy
import functools
import json

import pytest
import torch

from baton.kernels import cpu_ops
from baton.services.engine import LLM, SamplingParams
from baton.services.rpc.convert import sampling_params
from baton.v1 import generation_pb2 as gen
from tests.integration.engine_helpers import kv_gib
from tests.tiny_models import FAMILIES, WINDOW, build

MAX_NEW = 12
GGUF_VOCAB = 1024


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from baton.services.common.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(100, vocab, (n,), generator=g).tolist()  # noqa: E731
    shared = ids(64)  # four full blocks two prompts share
    # Lengths past the window (24) and past llama3's original context (64).
    return [ids(5), ids(30), ids(70), ids(130), shared + ids(10), shared + ids(20)]


def _greedy_choices(hf):
    """transformers' greedy token at each position of an output, from one forward pass
    over the prompt and the output, EOS barred as tests/tiny_models.hf_greedy's
    min_new_tokens bars it: an output is hf_greedy's exactly when this gives it back
    (hf_greedy makes a pass of generate per token). Kept per sequence: where the ISAs are
    right, their outputs are the same."""
    eos = hf.generation_config.eos_token_id
    barred = [eos] if isinstance(eos, int) else list(eos or [])

    @functools.cache
    def choices(sequence: tuple[int, ...], n: int) -> list[int]:
        with torch.no_grad():
            logits = hf(torch.tensor([sequence[:-1]]), logits_to_keep=n).logits[0]
        logits[:, barred] = -float("inf")
        return logits.argmax(-1).tolist()

    return lambda prompt, out: choices(tuple(prompt + out), len(out))


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory, tokenizer):
    """A tiny model of each family, the engine that serves it and transformers' greedy
    choices: made once for all the ISAs the parity test runs it under (which ISA serves
    is read at each call, not when the engine is built)."""
    family = request.param
    folder = tmp_path_factory.mktemp(family)
    hf = build(family, folder, tokenizer)
    # 14 blocks: the six requests need ~32 together, so some are preempted; 32-token steps
    # cut every longer prompt into chunks.
    llm = LLM(model=str(folder), dtype="float32", kv_cache_gib=kv_gib(folder, 13),
              max_num_batched_tokens=32, max_num_seqs=8)
    assert llm.engine.model_info.family == family
    return family, llm, _prompts(len(tokenizer)), _greedy_choices(hf)


@pytest.fixture(params=cpu_ops.supported())
def isa(request):
    """Every C++ kernel serving from this ISA's build (tests/integration/test_cpu_kernels.py
    says where they cannot build)."""
    if cpu_ops.ops(request.param) is None:
        pytest.skip(f"no CPU kernels for {request.param}: {cpu_ops.failure(request.param)}")
    with cpu_ops.using(request.param, every_kernel=True):
        yield request.param


def test_greedy_parity_with_transformers(tiny, isa):
    family, llm, prompts, hf_choices = tiny
    engine = llm.engine
    llm.reset_prefix_cache()  # this ISA computes every prompt itself, as a new engine would
    preemptions = engine.scheduler.num_preemptions
    partial = engine.scheduler.num_partial_prefills
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert engine.scheduler.num_preemptions > preemptions, (
        "the KV budget was meant to force preemption")
    assert engine.scheduler.num_partial_prefills > partial, "prompts were meant to run in chunks"
    hits = engine.kv.num_hits
    again = llm.generate(prompts[-2:], params)  # their shared prefix is cached now
    assert engine.kv.num_hits >= hits + 8, "the shared prefix was meant to hit the cache"
    for prompt, out in zip(prompts + prompts[-2:], outs + again, strict=True):
        assert out.token_ids == hf_choices(prompt, out.token_ids), (
            f"{family}: the prompt of {len(prompt)} tokens diverged from transformers")
    engine.pool.check_all_free()
    windowed = [layer.self_attn for layer in engine.runner.model.layers
                if layer.self_attn.features]
    if windowed:
        # The test can fail: without the window (and soft-cap) the long prompt diverges.
        assert {a.window for a in windowed} <= {WINDOW, None}
        features = [a.features for a in windowed]
        try:
            for attn in windowed:
                attn.features = {}
            plain = llm.generate([prompts[3]], params)[0]
        finally:
            for attn, kept in zip(windowed, features, strict=True):
                attn.features = kept
        assert plain.token_ids != outs[3].token_ids
        engine.pool.check_all_free()


def test_an_unsupported_architecture_is_refused_by_name(tmp_path, tokenizer):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]
               ).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*"
                                         r"Gemma2ForCausalLM.*Qwen3ForCausalLM"):
        LLM(model=str(tmp_path), kv_cache_gib=0.001)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("qwen2-genconfig")
    build("qwen2", folder, tokenizer)
    return folder


def test_dtype_auto_follows_the_checkpoint_on_cpu(qwen_dir):
    config = json.loads((qwen_dir / "config.json").read_text())
    assert config["dtype"] == "float32"
    auto = LLM(model=str(qwen_dir), kv_cache_gib=0.001)  # dtype="auto" is the default
    # fp32 and fp16 checkpoints run in bf16 on CPU (see EngineConfig.resolve_dtype).
    assert auto.engine.config.dtype == auto.engine.model_info.dtype == "bfloat16"
    assert auto.engine.runner.model.embed_tokens.dtype == torch.bfloat16
    assert auto.engine.kv_layout.dtype == "bfloat16"
    forced = LLM(model=str(qwen_dir), dtype="float32", kv_cache_gib=0.001)
    assert forced.engine.runner.model.embed_tokens.dtype == torch.float32


def test_generation_config_gives_eos_ids_and_sampling_defaults(tmp_path, qwen_dir):
    import shutil

    from transformers import GenerationConfig

    folder = tmp_path / "m"
    shutil.copytree(qwen_dir, folder)
    GenerationConfig(eos_token_id=[2, 7], do_sample=True, temperature=0.6, top_k=20,
                     top_p=0.9, repetition_penalty=1.1, max_new_tokens=5
                     ).save_pretrained(folder)
    llm = LLM(model=str(folder), dtype="float32", kv_cache_gib=0.001)
    assert set(llm.engine.model_info.eos_token_ids) == {2, 7}
    assert llm.engine.sampling_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.9,
                                            "repetition_penalty": 1.1, "max_tokens": 5}
    # Unset fields take the model's defaults; a request's own values win.
    unset = sampling_params(gen.SamplingParams(), llm.engine.sampling_defaults)
    assert (unset.temperature, unset.top_k, unset.top_p, unset.max_tokens) == (0.6, 20, 0.9, 5)
    own = sampling_params(gen.SamplingParams(temperature=0.0, max_tokens=9),
                          llm.engine.sampling_defaults)
    assert (own.temperature, own.max_tokens, own.top_k) == (0.0, 9, 20)
    out = llm.generate([[5, 900, 17]])[0]  # offline: the same defaults (max_new_tokens 5)
    assert len(out.token_ids) <= 5
    ignored = LLM(model=str(folder), dtype="float32", kv_cache_gib=0.001,
                  generation_config="none")
    assert ignored.engine.sampling_defaults == {}
    assert 7 not in ignored.engine.model_info.eos_token_ids


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma2", "gemma3"])
def test_gguf_of_a_family_matches_transformers(family, tmp_path, tokenizer):
    """A llama.cpp-layout GGUF (F32) of a tiny model serves the same greedy tokens as the
    model it was written from. The writer's layout is transformers' too: its GGUF reader
    gives back every tensor of the model; for qwen2 its model from the GGUF agrees as
    well (its other mappings drop numbers a tiny model sets: qwen3's head_dim, Gemma's
    soft-caps). The model's vocabulary is the tokenizer's first 1024 tokens: a GGUF
    reader spends seconds on a full 49k-token list, which checks nothing more here."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tests.tiny_models import gguf_ready_config, write_gguf

    hf = build(family, tmp_path / "hf", tokenizer,
               cfg=gguf_ready_config(family, GGUF_VOCAB))
    write_gguf(hf, family, tmp_path / "m.gguf", tokenizer)
    read = load_gguf_checkpoint(str(tmp_path / "m.gguf"), return_tensors=True,
                                model_to_load=copy.deepcopy(hf))["tensors"]
    for name, t in hf.state_dict().items():
        if name in read:
            torch.testing.assert_close(read[name], t, rtol=0, atol=1e-6, msg=name)
        else:
            assert name == "lm_head.weight" and hf.config.tie_word_embeddings
    refs = [hf]
    if family == "qwen2":
        refs.append(AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval())
    llm = LLM(model=str(tmp_path / "m.gguf"), tokenizer=str(tmp_path / "hf"), dtype="float32",
              kv_cache_gib=0.01)
    assert llm.engine.model_info.family == family
    prompts = _prompts(GGUF_VOCAB)[:4]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for ref in map(_greedy_choices, refs):
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.token_ids == ref(prompt, out.token_ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_dummy_weights_cover_every_family(family, tmp_path, tokenizer):
    """--load-format dummy (GPU measurements without a checkpoint): every parameter of
    every family is filled from the config alone (load_weights raises on any gap)."""
    from tests.tiny_models import family_configs

    family_configs(len(tokenizer))[family].save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), load_format="dummy", dtype="float32", kv_cache_gib=0.001)
    out = llm.generate([[5, 900, 17]], SamplingParams(max_tokens=3, temperature=0,
                                                       ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and llm.engine.model_info.family == family


def test_a_gguf_of_another_architecture_is_refused_by_name(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from baton.services.engine.loader import load_gguf

    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi3'.*llama, qwen2"):
        load_gguf(tmp_path / "g.gguf")


def test_real_configs_resolve_as_their_models_run():
    """Real checkpoints' config.json keys (not the tiny ones): windows, RoPE tables and
    query scales as transformers runs them, in v5 and in v4 (pre-`layer_types`) form."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from baton.services.engine.model_config import ModelConfig

    def v5(**kw):
        return ModelConfig.from_hf(AutoConfig.for_model(**kw))

    qwen25 = v5(model_type="qwen2", architectures=["Qwen2ForCausalLM"], num_hidden_layers=24,
                use_sliding_window=False, sliding_window=131072, max_window_layers=21)
    assert qwen25.windows == () and qwen25.qkv_bias and not qwen25.o_bias
    mistral01 = v5(model_type="mistral", architectures=["MistralForCausalLM"],
                   num_hidden_layers=4, sliding_window=4096)
    assert mistral01.windows == (4096,) * 4
    assert v5(model_type="mistral", architectures=["MistralForCausalLM"],
              sliding_window=None).windows == ()
    gemma2_27b = v5(model_type="gemma2", architectures=["Gemma2ForCausalLM"],
                    num_hidden_layers=46, hidden_size=4608, num_attention_heads=32,
                    head_dim=128, query_pre_attn_scalar=144)
    assert gemma2_27b.scale == 144**-0.5 and gemma2_27b.windows[:2] == (4096, None)
    # gemma-3-1b-it's config.json as transformers 4.5x wrote it: no layer_types.
    gemma3_v4 = SimpleNamespace(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144,
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None,
        sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256,
        max_position_embeddings=32768, eos_token_id=[1, 106], tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
        attn_logit_softcapping=None, torch_dtype="bfloat16")
    g = ModelConfig.from_hf(gemma3_v4)
    assert [i for i, w in enumerate(g.windows) if w is None] == [5, 11, 17, 23]
    assert set(g.windows) == {512, None} and g.sliding_layers[:5] == (0, 1, 2, 3, 4)
    assert (g.rope.theta, g.sliding_rope.theta, g.dtype) == (1e6, 1e4, "bfloat16")


def test_generation_config_top_k_zero_is_off_and_a_bad_value_names_the_file(tmp_path):
    from transformers import GenerationConfig

    from baton.services.common.generation_config import read_generation_config

    GenerationConfig(do_sample=True, top_k=0, temperature=0.7).save_pretrained(tmp_path)
    assert read_generation_config("auto", tmp_path)[1] == {"temperature": 0.7, "top_k": -1}
    (tmp_path / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ValueError, match="generation_config.json: temperature"):
        read_generation_config("auto", tmp_path)
