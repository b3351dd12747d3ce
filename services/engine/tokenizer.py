"""Tokenizers come from transformers: from an HF directory, or built from a GGUF file."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer for an HF model directory or a `.gguf` file.

    Building a tokenizer from GGUF metadata takes seconds, so the result is saved in a
    `<name>.tokenizer/` folder beside the file and loaded from there next time.
    """
    path = Path(model_path)
    if path.suffix != ".gguf":
        return AutoTokenizer.from_pretrained(str(path))
    saved = path.with_suffix(".tokenizer")
    if (saved / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(saved))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        tmp = saved.with_suffix(".tokenizer-tmp")
        tok.save_pretrained(str(tmp))
        tmp.replace(saved)
    except OSError:
        pass  # a read-only cache still works, only slower
    return tok
