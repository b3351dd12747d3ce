"""The model's own generation defaults (`generation_config.json`), read as vLLM reads them
with `--generation-config auto`:

  - its EOS ids join the config's (Llama 3 Instruct ends turns with <|eot_id|>, which
    only generation_config.json lists);
  - temperature, top_k, top_p, min_p, repetition_penalty and max_new_tokens (as
    max_tokens) become the defaults of a request that leaves them unset. A request's own
    values always win.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

# generation_config.json name -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                 "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                 "max_new_tokens": "max_tokens"}


def read_generation_config(source: str, model_dir: Path) -> tuple[tuple[int, ...], dict]:
    """(extra EOS ids, sampling defaults) from `source`: "auto" (the model's directory),
    "none" (nothing), or a folder holding a generation_config.json."""
    if source == "none":
        return (), {}
    folder = model_dir if source == "auto" else Path(source)
    if not (folder / "generation_config.json").exists():
        if source != "auto":
            raise ValueError(f"generation_config: no generation_config.json in {source!r}")
        return (), {}
    from transformers import GenerationConfig

    cfg = GenerationConfig.from_pretrained(str(folder))
    diff = cfg.to_diff_dict()  # only what the file sets, not transformers' defaults
    eos = cfg.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None
                                                                 else ())
    defaults = {field: diff[key] for key, field in SAMPLING_KEYS.items()
                if diff.get(key) is not None}
    if defaults.get("top_k") == 0:  # HF's "off"; ours is -1
        defaults["top_k"] = -1
    try:  # a bad default would fail every request that leaves it unset: fail here
        from baton.services.common.sampling_params import SamplingParams

        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{folder / 'generation_config.json'}: {e} (--generation-config "
                         "none ignores the file)") from e
    if defaults:
        log.info("sampling defaults from the model's generation_config.json: %s (a request's "
                 "own values win; --generation-config none ignores them)", defaults)
    return eos_ids, defaults
