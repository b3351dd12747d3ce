"""What the engine API tests share: greedy params, the idle check, stepping an engine
to the end, and the clean start of each test."""

from __future__ import annotations

from baton.services.engine import LLM, SamplingParams

EOS = 2
STORY = "Once upon a time, in a land far away, there lived a"
N_REF = 32


def kv_gib(model, blocks: int) -> float:
    """The KV budget (GiB, for EngineConfig.kv_cache_gib) of `blocks` blocks of 16 tokens
    of `model` (an HF directory) in fp32: a pool size that means the same for any model."""
    import torch

    from baton.services.engine.loader import hf_dir_config
    from baton.services.engine.model_runner import kv_bytes_per_block

    per_block = kv_bytes_per_block(hf_dir_config(model), 16, torch.float32)
    return (blocks + 1) * per_block / 2**30  # the null block too


def greedy(max_tokens: int = N_REF, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def assert_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    llm.engine.pool.check_all_free()


def run_steps(engine, max_steps: int = 10_000):
    """Step the engine; return ({id: [outputs in order]}, [ids in finish order])."""
    per_req: dict[str, list] = {}
    finished: list[str] = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            per_req.setdefault(out.request_id, []).append(out)
            if out.finished:
                assert out.request_id not in finished, "a request finished twice"
                finished.append(out.request_id)
    else:
        raise AssertionError("engine did not drain")
    return per_req, finished
