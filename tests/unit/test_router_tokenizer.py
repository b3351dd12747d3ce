"""The router's torch-free tokenizer gives the engine's (transformers') ids exactly."""

from __future__ import annotations

import pytest

from baton.services.common.tokenizer import Tokenizer, load_tokenizer

TEXTS = ["Hello world", " leading space", "émoji 🙂 and\n\nnewlines\ttabs", "a" * 300,
         "<|im_start|>user\nspecial tokens in text<|im_end|>", "数字 123,456.78"]
CHATS = [[{"role": "user", "content": "Hi"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
          {"role": "assistant", "content": "Because."}, {"role": "user", "content": "Ok"}]]


@pytest.fixture(scope="module")
def pair(model_path):
    load_tokenizer(model_path)  # makes sure the saved tokenizer folder exists
    return Tokenizer(model_path), load_tokenizer(model_path)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(pair, text):
    ours, ref = pair
    assert ours.encode(text) == ref.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_transformers(pair, messages):
    ours, ref = pair
    want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert ours.apply_chat_template(messages) == list(want)

