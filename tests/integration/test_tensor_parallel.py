"""Tensor parallelism on CPU (gloo, fp32): every family's tiny random model gives
transformers' greedy tokens with TP=2, under chunked prefill, preemption and prefix-cache
hits; TP=4 over 2 KV heads (each replicated on two ranks) too; a LoRA adapter matches
peft; seeded sampling, structured output and n-gram speculation give what TP=1 gives;
each rank holds its share of the weights; a rank that dies stops the engine, no hang.

The ranks are forked from a server that has imported torch once (engine_fixtures.py
forked_ranks): what they compute is checked here, how they start in test_tp_start.py."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from baton.kernels.kv_layout import rank_heads
from baton.services.common.sampling_params import StructuredOutput
from baton.services.engine import SamplingParams
from baton.services.engine.config import SpecConfig
from baton.services.engine.parallel import RankDied
from tests.integration.engine_helpers import kv_gib
from tests.tiny_models import FAMILIES, build, hf_greedy

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("forked_ranks")  # engine_fixtures.py


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from baton.services.common.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp(f"tp-{request.param}")
    return request.param, folder, build(request.param, folder, tokenizer)


def one_family(family: str):
    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory, tokenizer):
        folder = tmp_path_factory.mktemp(f"tp1-{family}")
        return folder, build(family, folder, tokenizer)

    return fixture


llama = one_family("llama")
qwen2 = one_family("qwen2")  # q/k/v biases, tied embeddings
gemma2 = one_family("gemma2")  # its random weights repeat a token: drafts are accepted


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(100, vocab, (n,), generator=g).tolist()  # noqa: E731
    shared = ids(48)  # three full blocks two prompts share
    return [ids(5), ids(40), ids(90), shared + ids(9), shared + ids(21)]


def rank_gib(folder, blocks: int, tp: int) -> float:
    """kv_cache_gib for `blocks` blocks on each of `tp` ranks (the budget is per rank,
    and a rank stores only its KV heads: 2 of the tiny models' 2 over 1 rank, 1 over 2+)."""
    return kv_gib(folder, blocks) * len(rank_heads(2, tp, 0)) / 2


def tp_llm(make_llm, folder, tp: int, blocks: int = 12, **kw):
    kw = {"max_num_batched_tokens": 32, "max_num_seqs": 8, **kw}
    return make_llm(model=str(folder), dtype="float32", tensor_parallel_size=tp,
                    kv_cache_gib=rank_gib(folder, blocks, tp), **kw)


def check_greedy(llm, hf, vocab: int) -> None:
    """Transformers' tokens under chunks, preemption and a prefix-cache hit; every block
    free after."""
    engine = llm.engine
    ps = prompts(vocab)
    outs = llm.generate(ps, GREEDY)
    assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
    assert engine.scheduler.num_partial_prefills > 0, "prompts were meant to run in chunks"
    hits = engine.kv.num_hits
    again = llm.generate(ps[-2:], GREEDY)
    assert engine.kv.num_hits >= hits + 6, "the shared prefix was meant to hit the cache"
    want = [hf_greedy(hf, p, MAX_NEW) for p in ps]
    for p, out, ref in zip(ps + ps[-2:], outs + again, want + want[-2:], strict=True):
        assert out.token_ids == ref, f"prompt of {len(p)} diverged"
    engine.pool.check_all_free()


def test_every_family_with_tp2_matches_transformers(tiny, make_llm, tokenizer):
    family, folder, hf = tiny
    llm = tp_llm(make_llm, folder, 2)
    check_greedy(llm, hf, len(tokenizer))
    assert llm.engine.kv_layout.tp_size == 2


def test_tp4_replicates_two_kv_heads_and_matches_transformers(make_llm, tokenizer, llama):
    folder, hf = llama
    llm = tp_llm(make_llm, folder, 4)
    caches = llm.engine.rank_kv_caches
    assert [c[0].shape[2] for c in caches] == [1, 1, 1, 1], "one KV head per rank"
    check_greedy(llm, hf, len(tokenizer))
    # Ranks 0 and 1 hold head 0, written by each of them: the same bytes.
    used = torch.arange(1, caches[0][0].shape[0])
    assert torch.equal(caches[0][0][used], caches[1][0][used])
    assert not torch.equal(caches[0][0][used], caches[2][0][used])


def test_each_rank_holds_its_share_of_the_weights(make_llm, qwen2):
    folder, _ = qwen2
    one = tp_llm(make_llm, folder, 1).engine.runner
    two = tp_llm(make_llm, folder, 2).engine.runner
    # What a rank must hold: every split tensor's half (the vocabulary's rows rounded
    # up), the norms whole.
    expected = 0
    for name, p in one.model.named_parameters():
        size = p.numel() * p.element_size()
        if "norm" in name:
            expected += size
        elif "embed_tokens" in name:
            expected += -(-p.shape[0] // 2) * p.shape[1] * p.element_size()
        else:
            expected += size // 2
    per_rank = two.rank_weight_bytes()
    assert per_rank == [expected, expected], (per_rank, expected)
    assert sum(per_rank) < 1.1 * one.rank_weight_bytes()[0]


def test_lora_adapter_under_tp2_matches_peft(make_llm, tmp_path_factory, tokenizer):
    from tests.integration.test_lora import check_parity, make_adapters, random_prompts

    root = tmp_path_factory.mktemp("tp-lora")
    model = build("qwen3", root / "model", tokenizer)
    adapters = make_adapters(model, root, ("r4", "part", "r2"))
    engine = make_llm(model=str(root / "model"), dtype="float32", tensor_parallel_size=2,
                      enable_lora=True, max_loras=4, max_num_batched_tokens=32,
                      max_num_seqs=16, kv_cache_gib=rank_gib(root / "model", 96, 2)).engine
    for name, path in adapters.items():
        engine.load_lora(name, str(path))
    check_parity(engine, model, adapters, random_prompts((5, 17, 40), 0,
                                                         model.config.vocab_size))
    engine.pool.check_all_free()


def test_sampling_structured_output_and_speculation_equal_tp1(make_llm, gemma2, tokenizer):
    folder, _ = gemma2
    spec = SpecConfig(method="ngram", num_speculative_tokens=3)
    one, two = (tp_llm(make_llm, folder, tp, blocks=64, speculative=spec) for tp in (1, 2))
    jobs = [(prompts(len(tokenizer))[1], GREEDY),
            (prompts(len(tokenizer))[2],
             SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.9, seed=3)),
            (prompts(len(tokenizer))[0],
             SamplingParams(max_tokens=MAX_NEW, temperature=0.7, seed=5,
                            structured=StructuredOutput("regex", "(ab|cd){1,3}x")))]
    got = [[o.token_ids for o in llm.generate([p for p, _ in jobs], [s for _, s in jobs])]
           for llm in (one, two)]
    assert got[0] == got[1]
    text = tokenizer.decode(got[1][2], skip_special_tokens=True)
    assert text.endswith("x") and set(text[:-1]) <= set("abcd"), text
    assert two.engine.stats().num_spec_accepted_tokens > 0, "drafts were meant to be kept"


def test_a_rank_that_dies_stops_the_engine_without_a_hang(make_llm, llama):
    folder, _ = llama
    llm = tp_llm(make_llm, folder, 2)
    engine = llm.engine
    rid = engine.add_request(prompts(1000)[2], GREEDY)
    engine.step()
    follower = engine.ranks.procs[0]
    os.kill(follower.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while engine.ranks.dead is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.ranks.dead is not None and "exited" in engine.ranks.dead
    with pytest.raises(RankDied):
        engine.step()
    engine.fail_all()
    assert not engine.has_unfinished_requests()
    engine.pool.check_all_free()
    assert rid not in engine.scheduler.requests
