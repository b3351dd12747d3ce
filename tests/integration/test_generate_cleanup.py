"""LLM.generate never leaves requests (or their blocks) behind, even when a step fails."""

from __future__ import annotations

import pytest

from baton.services.engine import SamplingParams


def test_an_error_mid_generate_leaves_no_request_behind(llm, monkeypatch):
    runner = llm.engine.runner
    real = runner.execute
    calls = []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return real(*args)

    monkeypatch.setattr(runner, "execute", failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate(["one prompt", "and another"], SamplingParams(max_tokens=8))
    assert not llm.engine.has_unfinished_requests()
    llm.engine.pool.check_all_free()
