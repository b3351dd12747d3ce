"""`python -m baton.services.engine.default_model`: fetch the default model, save its
tokenizer beside it and write its dequantized copy (the fetch lives in services/common,
torch-free, for the router)."""

from ..common.default_model import (  # noqa: F401 - re-exported
    DEFAULT_MODEL_NAME,
    default_model_path,
    ensure_default_model,
)

if __name__ == "__main__":
    from ..common.tokenizer import load_tokenizer
    from .loader import load_checkpoint

    model = ensure_default_model()
    load_tokenizer(model)  # saves tokenizer.json beside it, for the torch-free router
    # Read once here, so the dequantized copy (gguf_cache.py) is written before the
    # first engines start: they map it, rather than each dequantizing the GGUF again.
    for _ in load_checkpoint(model)[1]:
        pass
    print(model)
