"""The default model itself (SmolLM2-135M-Instruct, dequantized from its GGUF in each
worker process), served disaggregated over NIXL (the session's `smollm`, whose decode
worker also drafts n-gram tokens): the greedy text and the chat reply equal the offline
engine's, which tests/integration/test_hf_parity.py holds to transformers. The other
service tests run the tiny serving model: they check mechanics, this checks fidelity."""

from __future__ import annotations

from baton.services.engine import SamplingParams
from baton.v1 import generation_pb2 as gen
from tests.e2e.helpers import all_free_within, greedy, joined, run

PROMPTS = [
    "The capital of France is",
    "Explain what a KV cache is in one sentence. " * 4,
    "def fibonacci(n):",
]


def test_greedy_text_and_chat_equal_the_offline_engine(smollm, smollm_offline):
    offline, real = smollm_offline, smollm
    want = offline.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))
    for prompt, ref in zip(PROMPTS, want, strict=True):
        msgs = run(real["router"], gen.GenerateRequest(text=prompt, sampling=greedy(24)))
        assert joined(msgs) == (ref.token_ids, ref.text), prompt
        assert msgs[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    messages = [{"role": "user", "content": "Name a colour."}]
    ref = offline.chat(messages, SamplingParams(max_tokens=16, temperature=0.0))
    chat = gen.ChatMessages(messages=[gen.ChatMessage(**m) for m in messages])
    assert joined(run(real["router"], gen.GenerateRequest(chat=chat, sampling=greedy(16)))) \
        == (ref.token_ids, ref.text)
    assert all_free_within([real["prefill"], real["decode"]], 5.0)
