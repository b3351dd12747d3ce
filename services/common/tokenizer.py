"""Tokenizers, torch-free: the one owner of chat templating and of where a model's
tokenizer lives.

    path/to/dir             its own tokenizer files (an HF model or tokenizer folder)
    path/to/<name>.gguf     the `<name>.tokenizer/` folder beside it (`tokenizer_dir`),
                            built once from the GGUF by transformers and saved there
                            (`load_tokenizer`, in the engine's process: that build needs
                            torch), so later loads, and routers, read the folder

`Tokenizer` is the router's: transformers' own fast tokenizer, which loads no torch, so
the router's ids and chat prompts are the engine's by construction (a test checks them
against the engine's tokenizer anyway). `apply_chat_template` is the one place a chat
becomes token ids: the router, the engine and the offline `LLM` all call it, with the
chat's tools and the request's chat_template_kwargs passed to the template as
transformers passes them; `--chat-template` (`read_chat_template`) replaces the model's.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import cast

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .plain_content import plain_content


def tokenizer_dir(model: str | Path) -> Path:
    """Where a model's tokenizer files are: the HF directory itself, or for a `.gguf` file
    the `<name>.tokenizer/` folder saved beside it."""
    path = Path(model)
    return path.with_suffix(".tokenizer") if path.suffix == ".gguf" else path


def load_tokenizer(model: str | Path) -> PreTrainedTokenizerBase:
    """The engine's tokenizer for an HF directory or a `.gguf` file. Building one from GGUF
    metadata takes seconds, so it is saved in `tokenizer_dir` and loaded from there next
    time; a read-only cache still works, only slower."""
    from transformers import AutoTokenizer  # imports torch: never in the router

    path = Path(model)
    if path.suffix != ".gguf":
        return AutoTokenizer.from_pretrained(str(path))
    saved = tokenizer_dir(path)
    if (saved / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(saved))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        tmp = saved.with_suffix(".tokenizer-tmp")
        tok.save_pretrained(str(tmp))
        tmp.replace(saved)
    except OSError:
        pass
    return tok


def read_chat_template(value: str) -> str:
    """A --chat-template value as the template's text: inline jinja (it holds "{{" or
    "{%"), else the file it names. ValueError when it is neither."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"chat_template: {value!r} is neither a file nor a jinja template")
    return path.read_text(encoding="utf-8")


def reserved_template_names(tok: PreTrainedTokenizerBase) -> frozenset[str]:
    """What a request's chat_template_kwargs may not set: apply_chat_template's own
    parameters, what it passes the template itself (the messages, tools, special tokens)."""
    params = inspect.signature(type(tok).apply_chat_template).parameters
    return frozenset({*params, "messages", *tok.special_tokens_map} - {"self", "kwargs"})


def apply_chat_template(tok: PreTrainedTokenizerBase, messages: list[dict],
                        tools: list[dict] | None = None,
                        template_kwargs: dict | None = None,
                        special_tokens_in_content: bool = False) -> list[int]:
    """The messages through the model's chat template, ending with the assistant's turn;
    `tools` (OpenAI's function tools) and `template_kwargs` (more template variables)
    passed on as transformers passes them. A special token the caller's strings spell is
    plain text (plain_content.py) unless `special_tokens_in_content` (then it is the
    control token, as in vLLM). ValueError if the model has none, a kwarg is one the
    template call reserves, or the template refuses the messages."""
    if not tok.chat_template:
        raise ValueError("chat: this model has no chat template; send text or token ids")
    kwargs = dict(template_kwargs or {})
    taken = sorted(set(kwargs) & reserved_template_names(tok))
    if taken:
        raise ValueError(f"chat_template_kwargs: {taken[0]!r} is set by the server, not "
                         "by a request")
    plain = None if special_tokens_in_content else plain_content(tok)
    if plain is not None and not plain.spelled([messages, tools, kwargs]):
        plain = None  # nothing to keep plain: transformers' own path, as it always was
    if plain is not None:
        messages, tools, kwargs = plain.marked([messages, tools, kwargs])
    try:
        out = tok.apply_chat_template(messages, tools=[*tools] if tools else None,
                                      add_generation_prompt=True,
                                      tokenize=plain is None, **kwargs)
    except Exception as e:  # jinja's TemplateError, raise_exception() in a template
        raise ValueError(f"chat: the model's template refused the messages: {e}") from e
    if plain is not None:
        return plain.encode(tok, cast(str, out))  # tokenize=False: the text
    # Token ids, or (transformers 5) a BatchEncoding holding them.
    return list(cast(list[int], out["input_ids"] if isinstance(out, Mapping) else out))


class Tokenizer:
    """The router's tokenizer, from the saved folder (see the module doc)."""

    def __init__(self, model: str | Path, chat_template: str | None = None,
                 special_tokens_in_content: bool = False):
        """`chat_template`: a --chat-template value (a file or inline jinja) to use
        instead of the tokenizer's own; `special_tokens_in_content`: a chat's messages
        may spell control tokens (apply_chat_template)."""
        folder = tokenizer_dir(model)
        if not (folder / "tokenizer.json").exists():
            raise FileNotFoundError(
                f"no tokenizer.json in {folder}; for a .gguf model run a worker once, or "
                "`python -m baton.services.engine.default_model`, to save it")
        self._tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
        if chat_template:
            self._tok.chat_template = read_chat_template(chat_template)
        self.has_chat_template = bool(self._tok.chat_template)
        self.special_tokens_in_content = special_tokens_in_content
        self._texts: dict[int, str] = {}

    def save(self, folder: str | Path) -> None:
        """Its files (tokenizer.json, its config with the chat template it uses) into
        `folder`, as transformers saves a tokenizer: what a gateway that tokenizes for
        Baton loads (VllmEngine's GetTokenizer)."""
        self._tok.save_pretrained(str(folder))

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True) if text else []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (OpenAI's logprobs show them)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tok.decode([token_id])
        return text

    def marker_ids(self, text: str) -> list[int]:
        """A marker's token ids as the model writes it inside its output (no BOS)."""
        return self._tok.encode(text, add_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> list[int]:
        return apply_chat_template(self._tok, messages, tools, template_kwargs,
                                   self.special_tokens_in_content)
