"""`python -m baton.services.engine.default_model`: fetch the default model and save its
tokenizer beside it (the logic lives in services/common, torch-free, for the router)."""

from baton.services.common.default_model import (  # noqa: F401 - re-exported
    DEFAULT_MODEL_NAME,
    default_model_path,
    ensure_default_model,
)

if __name__ == "__main__":
    from baton.services.common.tokenizer import load_tokenizer

    model = ensure_default_model()
    load_tokenizer(model)  # saves tokenizer.json beside it, for the torch-free router
    print(model)
