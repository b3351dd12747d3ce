"""The router's tokenizer: transformers' own fast tokenizer and chat templating, which load
no torch. So the router's ids and chat prompts are the engine's, by construction (a test
checks them against the engine's tokenizer anyway)."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast


def tokenizer_dir(model: str | Path) -> Path:
    """Where a model's tokenizer files are: the HF directory itself, or for a `.gguf` file
    the `<name>.tokenizer/` folder a worker (or `make model`) saved beside it."""
    path = Path(model)
    return path.with_suffix(".tokenizer") if path.suffix == ".gguf" else path


class Tokenizer:
    def __init__(self, model: str | Path):
        folder = tokenizer_dir(model)
        if not (folder / "tokenizer.json").exists():
            raise FileNotFoundError(
                f"no tokenizer.json in {folder}; for a .gguf model run a worker once, or "
                "`python -m services.engine.default_model`, to save it")
        self._tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
        self.has_chat_template = bool(self._tok.chat_template)
        self._texts: dict[int, str] = {}

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True) if text else []

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (OpenAI's logprobs show them)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tok.decode([token_id])
        return text

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """The messages through the model's chat template, ending with the assistant's
        turn. ValueError if the model has none or the template refuses the messages."""
        if not self.has_chat_template:
            raise ValueError("chat: this model has no chat template; send text or token ids")
        try:
            out = self._tok.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True)
        except Exception as e:  # jinja's TemplateError, raise_exception() in a template
            raise ValueError(f"chat: the model's template refused the messages: {e}") from e
        return list(out["input_ids"] if hasattr(out, "keys") else out)
