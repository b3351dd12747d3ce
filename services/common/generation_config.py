"""The model's own generation defaults (`generation_config.json`), read as vLLM reads them
with `--generation-config auto`, by the workers and the router alike (torch-free: the
router checks a request with the same defaults the workers will run it with):

  - its EOS ids join the config's (Llama 3 Instruct ends turns with <|eot_id|>, which
    only generation_config.json lists);
  - temperature, top_k, top_p, min_p, repetition_penalty and max_new_tokens (as
    max_tokens) become the defaults of a request that leaves them unset. A request's own
    values always win (convert.sampling_params applies them).

The file is read as JSON: what transformers' GenerationConfig.to_diff_dict gives (vLLM's
reading), now that its defaults of these keys are all None, is each key the file sets.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

FILE = "generation_config.json"
# generation_config.json name -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                 "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                 "max_new_tokens": "max_tokens"}


def read_generation_config(source: str, model_dir: Path) -> tuple[tuple[int, ...], dict]:
    """(extra EOS ids, sampling defaults) from `source`: "auto" (the model's directory),
    "none" (nothing), or a folder holding a generation_config.json."""
    if source == "none":
        return (), {}
    folder = Path(model_dir) if source == "auto" else Path(source)
    if not (folder / FILE).is_file():
        if source != "auto":
            raise ValueError(f"generation_config: no {FILE} in {source!r}")
        return (), {}
    try:
        data = json.loads((folder / FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder / FILE}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{folder / FILE}: not a JSON object")
    eos = data.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    defaults = {field: data[key] for key, field in SAMPLING_KEYS.items()
                if data.get(key) is not None}
    if defaults.get("top_k") == 0:  # HF's "off"; ours is -1
        defaults["top_k"] = -1
    try:  # a bad default would fail every request that leaves it unset: fail here
        from .sampling_params import SamplingParams

        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{folder / FILE}: {e} (--generation-config none ignores the "
                         "file)") from e
    if defaults:
        log.info("sampling defaults from the model's %s: %s (a request's own values win; "
                 "--generation-config none ignores them)", FILE, defaults)
    return eos_ids, defaults
