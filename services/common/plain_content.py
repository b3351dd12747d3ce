"""A chat's content as plain text: where a caller's message (any role), tool, tool call or
template variable spells one of the tokenizer's special tokens (`<|im_end|>`,
`<|start_header_id|>`, ...), those characters become the text's own tokens, never the
control token, so no message can close its turn and open another (a forged system
turn). The template's own special tokens stay control tokens. This is transformers'
`split_special_tokens=True` applied to the caller's strings alone; added tokens that are
not special (`<think>`, `<tool_call>`) stay as the tokenizer reads them.

    1. each special token a caller's string spells -> a content marker
    2. the template renders the chat (every special token left in it is the template's)
    3. each special token in the text -> a control marker: an added (not special) token
       of a copy of the tokenizer that stands for it; each content marker -> the
       characters it replaced
    4. the copy encodes the text in one pass with special tokens split (its control
       markers are still taken whole), and each control marker's id -> the special
       token's id

So the ids equal transformers' for the same text wherever the caller spelled no special
token, and the text is tokenized as one string, as transformers does (pre-tokenizers that
treat the start of the text apart, such as Metaspace's `prepend_scheme: first`, see the
same start). Markers carry a random nonce per process: a caller cannot spell one.
Raw prompt text (completions, /tokenize's `prompt`) keeps vLLM's behaviour: it is read
with its special tokens.
"""

from __future__ import annotations

import re
import secrets
import threading
import weakref
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

_NONCE = "x" + secrets.token_hex(16)
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _trie_pattern(words: list[str]) -> re.Pattern:
    """One regex matching any of `words`, longest first, through a trie of their shared
    prefixes: linear in the text, however many tokens share `<|reserved_...`."""
    trie: dict = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def branch(node: dict) -> str:
        alts = [re.escape(ch) + branch(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    return re.compile(branch(trie))


class PlainContent:
    """One tokenizer's special tokens, and the copy of it that step 4 encodes with."""

    def __init__(self, tok: PreTrainedTokenizerBase):
        self.added = {t.content: (i, t) for i, t in tok.added_tokens_decoder.items()
                      if t.special and t.content}
        self.specials = sorted(self.added)
        self.index = {s: k for k, s in enumerate(self.specials)}
        self.pattern = _trie_pattern(self.specials) if self.specials else None
        self.content_marker = re.compile(f"{_NONCE}c([0-9]+)z")
        self._copy = None
        self._to_special: dict[int, int] = {}  # a control marker's id -> the special's
        self._lock = threading.Lock()

    def spelled(self, value) -> bool:
        """Whether any string in `value` (str, list, dict: keys too) spells a special."""
        if self.pattern is None:
            return False
        if isinstance(value, str):
            return self.pattern.search(value) is not None
        if isinstance(value, dict):
            return any(self.spelled(k) or self.spelled(v) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return any(self.spelled(v) for v in value)
        return False

    def marked(self, value: Any) -> Any:  # JSON-like: strings, lists, dicts, as given
        """`value` with every special token its strings spell as a content marker."""
        assert self.pattern is not None  # called once spelled() has found a special
        if isinstance(value, str):
            return self.pattern.sub(lambda m: f"{_NONCE}c{self.index[m[0]]}z", value)
        if isinstance(value, dict):
            return {self.marked(k): self.marked(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.marked(v) for v in value]
        return value

    def encode(self, tok: PreTrainedTokenizerBase, rendered: str) -> list[int]:
        """Steps 3 and 4 on the template's text."""
        if not tok.is_fast:  # transformers' Python tokenizers: no copy to make
            raise ValueError("chat: a message spells a special token of a tokenizer this "
                             "server cannot keep it plain in (start with "
                             "--allow-special-tokens-in-content to read it as one)")
        assert self.pattern is not None  # called once spelled() has found a special
        text = self.pattern.sub(lambda m: f"{_NONCE}t{self.index[m[0]]}z", rendered)
        text = self.content_marker.sub(lambda m: self.specials[int(m[1])], text)
        ids = self._encoder(tok).encode(text, add_special_tokens=False).ids
        return [self._to_special.get(i, i) for i in ids]

    def _encoder(self, tok: PreTrainedTokenizerBase):
        """The copy (built on first use: a chat that spells a special token is rare)."""
        with self._lock:
            if self._copy is None:
                from tokenizers import AddedToken, Tokenizer

                # A fast tokenizer's (encode() checked is_fast): tokenizers' Tokenizer.
                backend = cast(Tokenizer, tok.backend_tokenizer)
                copy = Tokenizer.from_str(backend.to_str())
                copy.no_truncation()
                copy.no_padding()
                copy.encode_special_tokens = True
                markers = [(f"{_NONCE}t{k}z", *self.added[s]) for k, s in
                           enumerate(self.specials)]
                copy.add_tokens([AddedToken(m, single_word=t.single_word, lstrip=t.lstrip,
                                            rstrip=t.rstrip, normalized=t.normalized,
                                            special=False) for m, _, t in markers])
                for m, i, _ in markers:
                    marker_id = copy.token_to_id(m)
                    if marker_id is None:  # add_tokens above has added every one
                        raise RuntimeError(f"chat: the tokenizer's copy lost marker {m!r}")
                    self._to_special[marker_id] = i
                self._copy = copy
            return self._copy


def plain_content(tok: PreTrainedTokenizerBase) -> PlainContent:
    """The tokenizer's PlainContent, made once."""
    with _LOCK:
        found = _CACHE.get(tok)
        if found is None:
            found = _CACHE[tok] = PlainContent(tok)
        return found
