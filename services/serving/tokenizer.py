"""A tokenizer for the router, without torch: the `tokenizers` library over the model's
tokenizer.json, and the chat template rendered with jinja2 the way transformers renders
it (sandboxed, trim_blocks, lstrip_blocks, then encoded without special tokens). A test
checks both against the engine's transformers tokenizer."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import StrictUndefined
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Tokenizer


def tokenizer_dir(model: str | Path) -> Path:
    """Where a model's tokenizer files are: the HF directory itself, or for a `.gguf` file
    the `<name>.tokenizer/` folder a worker (or `make model`) saved beside it."""
    path = Path(model)
    return path.with_suffix(".tokenizer") if path.suffix == ".gguf" else path


def _raise(message: str):
    raise ValueError(f"chat template: {message}")


class Tokenizer:
    def __init__(self, model: str | Path):
        folder = tokenizer_dir(model)
        if not (folder / "tokenizer.json").exists():
            raise FileNotFoundError(
                f"no tokenizer.json in {folder}; for a .gguf model run a worker once, or "
                "`python -m services.engine.default_model`, to save it")
        self._tok = _Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template = self.config.get("chat_template")
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        self._template = None
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(template)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def _special(self, name: str) -> str | None:
        value = self.config.get(name)
        return value.get("content") if isinstance(value, dict) else value

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids if text else []

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """The messages through the chat template, ending with the assistant's turn."""
        if self._template is None:
            raise ValueError("this model has no chat template; send text or token ids")
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each chat message needs a string role and content")
        text = self._template.render(messages=messages, add_generation_prompt=True,
                                     bos_token=self._special("bos_token") or "",
                                     eos_token=self._special("eos_token") or "",
                                     undefined=StrictUndefined)
        return self._tok.encode(text, add_special_tokens=False).ids
