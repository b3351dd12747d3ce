"""Models served with their weights kept quantized (--quantization): the C++ kernel
through every ISA against fp32 over the dequantized weights, then whole tiny models whose
greedy tokens must equal an fp32 run over the same weights dequantized, for each format."""

from __future__ import annotations

import pytest
import torch

from baton.kernels import cpu_ops, quant
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.quantization import stored_bytes
from tests.tiny_models import build, gguf_ready_config, write_gguf

VOCAB = 1024
FORMATS = ("int8", "q8_0", "q4_0", "q4_1")


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from baton.services.common.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


def _weight(fmt: str, n: int, k: int) -> quant.QuantWeight:
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    if fmt == "int8":
        return quant.quantize_int8(w)
    import gguf
    from gguf.quants import quantize

    raw = quantize(w.numpy(), gguf.GGMLQuantizationType[fmt.upper()])
    return quant.from_gguf(fmt, torch.from_numpy(raw), k)


@pytest.mark.parametrize("isa", cpu_ops.supported())
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernel_equals_fp32_over_dequantized_weights(isa, fmt):
    module = cpu_ops.ops(isa)
    if module is None:
        pytest.skip(f"the CPU kernels for {isa} do not build here: {cpu_ops.failure(isa)}")
    k = 99 if fmt == "int8" else 96  # int8 rows need not fill a vector
    w = _weight(fmt, 37, k)  # 37 rows: a last tile of one
    for rows in (1, 5, 70):  # one, a partial group of 4, past one chunk of 64
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, k).to(dtype)
            with cpu_ops.using(isa, every_kernel=True):
                got = quant.matmul(x, w) if dtype == torch.float32 or fmt != "int8" \
                    else _weight_only(module, x, w)
            want = x.float() @ w.dequantize().T
            tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's rounding
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max())


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_integer_path_is_fp32_over_block_quantized_activations(fmt):
    """bf16 activations, few rows, on a build with VNNI: x quantized per 32-column block
    (round(x / s), s = max|x| / 127), then exact integer dot products: the same as fp32
    over the quantized activations and the dequantized weights."""
    isa = cpu_ops.supported()[0]
    module = cpu_ops.ops(isa)
    if module is None or "avx512_vnni" not in cpu_ops.ISAS[isa][0]:
        pytest.skip(f"no build with VNNI here (best ISA {isa}): the integer path is not built")
    w = _weight(fmt, 37, 96)
    x = (torch.randn(3, 96) * torch.tensor([0.1, 1.0, 20.0]).repeat(32)).bfloat16()
    blocks = x.float().view(3, 3, 32)
    s = blocks.abs().amax(-1, keepdim=True) / 127
    xq = (torch.round(blocks / s) * s).view(3, 96)
    want = xq @ w.dequantize().T
    out = x.new_empty(3, w.n)
    module.qmm(x, w.data, w.scale if w.scale is not None else torch.empty(0),
               quant.KERNEL_FORMAT[fmt], w.k, True, out)
    torch.testing.assert_close(out.float(), want, rtol=8e-3, atol=8e-3 * want.abs().max())
    assert not torch.allclose(out.float(), x.float() @ w.dequantize().T, rtol=1e-3, atol=0)


def _weight_only(module, x, w):
    out = x.new_empty(x.shape[0], w.n)
    module.qmm(x, w.data, w.scale, quant.KERNEL_FORMAT[w.fmt], w.k, False, out)
    return out


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, VOCAB, (n,), generator=g).tolist() for n in (5, 30, 70)]


def _greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate(_prompts(), SamplingParams(max_tokens=8, temperature=0,
                                                   ignore_eos=True))
    return [o.token_ids for o in outs]


def _quantized_linears(llm: LLM) -> list[quant.QuantWeight]:
    model = llm.engine.runner.model
    found = [p for layer in model.decoder_layers for m in (layer.self_attn, layer.mlp)
             for p in m.packed.values() if isinstance(p, quant.QuantWeight)]
    if isinstance(model.lm_head_packed, quant.QuantWeight):
        found.append(model.lm_head_packed)
    return found


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])  # tied head; untied, soft-caps
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_quantized_gguf_kept_quantized_serves_its_dequantized_tokens(family, qtype,
                                                                         tmp_path, tokenizer):
    hf = build(family, tmp_path / "hf", tokenizer, cfg=gguf_ready_config(family, VOCAB))
    write_gguf(hf, family, tmp_path / "m.gguf", tokenizer, qtype=qtype)
    kw = dict(model=str(tmp_path / "m.gguf"), tokenizer=str(tmp_path / "hf"),
              dtype="float32", kv_cache_gib=0.01, max_num_batched_tokens=32)
    dense = LLM(**kw)  # the loader dequantizes every tensor to fp32: the reference
    kept = LLM(**kw, quantization="gguf")
    layers = hf.config.num_hidden_layers
    linears = _quantized_linears(kept)
    assert len(linears) == 4 * layers + 1 and {w.fmt for w in linears} == {qtype.lower()}
    model = kept.engine.runner.model
    assert model.embed_tokens.numel() == 0 and model.embed_quant is not None
    assert model.layers[0].mlp.gate_up_weight.numel() == 0  # the dense copy is gone
    # Stored as the file stores them: its quantized tensors' bytes, its F32 ones in fp32.
    from gguf import GGUFReader

    in_file = sum(int(t.n_bytes) for t in GGUFReader(str(tmp_path / "m.gguf")).tensors)
    assert stored_bytes(model) == in_file
    assert _greedy(kept) == _greedy(dense)


def test_int8_serves_the_tokens_of_its_dequantized_weights(tmp_path, tokenizer):
    """fp32 activations: the weight-only kernel; the reference runs the dense model with
    each linear's weight replaced by its int8 weight dequantized."""
    build("llama", tmp_path, tokenizer)
    kw = dict(model=str(tmp_path), dtype="float32", kv_cache_gib=0.01,
              max_num_batched_tokens=32)
    kept = LLM(**kw, quantization="int8")
    dense = LLM(**kw)
    ref, got = dense.engine.runner.model, kept.engine.runner.model
    with torch.no_grad():
        for lr, lk in zip(ref.decoder_layers, got.decoder_layers, strict=True):
            for name, module in (("qkv", "self_attn"), ("o", "self_attn"),
                                 ("gate_up", "mlp"), ("down", "mlp")):
                w = getattr(lk, module).packed[name]
                getattr(getattr(lr, module), f"{name}_weight").copy_(w.dequantize())
        ref.lm_head.copy_(got.lm_head_packed.dequantize())
    assert len(_quantized_linears(kept)) == 4 * len(ref.decoder_layers) + 1
    assert _greedy(kept) == _greedy(dense)


def test_gguf_quantization_needs_a_gguf_and_awq_is_refused(tmp_path, tokenizer):
    build("llama", tmp_path, tokenizer)
    with pytest.raises(ValueError, match="needs a .gguf checkpoint"):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_gib=0.01, quantization="gguf")
    with pytest.raises(ValueError, match="AWQ checkpoints are not served yet"):
        LLM(model=str(tmp_path), quantization="awq")


def test_workers_of_other_weight_formats_do_not_pair(tmp_path, tokenizer):
    """KV computed from int8 weights is not the KV of the dense ones: the layout
    handshake refuses the pair, naming the model field."""
    from baton.kv_transfer.base import IncompatibleLayout

    build("llama", tmp_path, tokenizer)
    kw = dict(model=str(tmp_path), dtype="float32", kv_cache_gib=0.01)
    dense, kept = LLM(**kw).engine.kv_layout, LLM(**kw, quantization="int8").engine.kv_layout
    dense.check_compatible(LLM(**kw).engine.kv_layout)
    with pytest.raises(IncompatibleLayout, match=r"model: ours '.*\+int8'"):
        kept.check_compatible(dense)
