"""The dequantized weights of a cached GGUF file, kept beside it so that a second start
does not dequantize again.

Reading a GGUF costs seconds on every start: gguf's reader parses every metadata field
(the tokenizer's vocabulary included) and each quantized tensor is dequantized in numpy.
For a GGUF in Baton's own model cache (the default model; `BATON_CACHE`), the first load
writes what it produced (HF-named fp32 tensors, after the q/k un-permute and Gemma's norm
shift) to one safetensors file beside it, with the metadata it read; later loads map that
file. The copy names the GGUF's size and modification time and FORMAT (raise it when what
load_gguf yields changes): a copy that does not match is converted again. A GGUF given
from elsewhere is never copied (its fp32 copy could be many times its size). Writing is
best effort: a read-only cache only makes starts slower.

    <cache>/models/<name>.gguf  ->  <cache>/models/<name>.f32.safetensors
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ..common.default_model import cache_dir

log = logging.getLogger(__name__)

FORMAT = 1
# Metadata arrays of which load_gguf needs only the length (the tokenizer's).
_COUNTED = "__count__"


def entry(path: Path) -> Path | None:
    """Where the converted copy of `path` goes, or None if it is not kept."""
    try:
        path.resolve().relative_to(cache_dir().resolve())
    except ValueError:
        return None
    return path.with_suffix(".f32.safetensors")


def _source(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}|{st.st_mtime_ns}|{FORMAT}"


def read_converted(path: Path) -> tuple[dict, bool, Iterator[tuple[str, torch.Tensor]], int] | None:
    """(metadata, has output.weight, tensors, their count) from the cache, or None."""
    from safetensors import safe_open

    file = entry(path)
    if file is None or not file.exists():
        return None
    try:
        with safe_open(str(file), framework="pt") as sf:
            header = sf.metadata() or {}
            names = list(sf.keys())
        if header.get("source") != _source(path):
            return None  # the GGUF changed since (or an older format): convert again
        meta = {k: range(v[_COUNTED]) if isinstance(v, dict) and _COUNTED in v else v
                for k, v in json.loads(header["meta"]).items()}
        has_output = header["has_output"] == "1"
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        log.warning("ignoring the converted copy %s: %s", file, e)
        return None

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        with safe_open(str(file), framework="pt") as sf:
            for name in names:
                yield name, sf.get_tensor(name)

    return meta, has_output, weights(), len(names)


def write_through(path: Path, meta: dict, has_output: bool,
                  weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `weights` unchanged; once all have passed, save them as the converted copy
    (if `path` gets one)."""
    file = entry(path)
    if file is None:
        yield from weights
        return
    kept: dict[str, torch.Tensor] = {}
    for name, w in weights:
        kept[name] = w
        yield name, w
    counted = {k: {_COUNTED: len(v)} if isinstance(v, range) else v for k, v in meta.items()}
    tmp = file.with_name(f"{file.name}.{os.getpid()}.part")
    try:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in kept.items()}, str(tmp),
                  metadata={"meta": json.dumps(counted), "source": _source(path),
                            "has_output": "1" if has_output else "0"})
        os.replace(tmp, file)  # atomic: a concurrent start sees the whole file or none
    except (OSError, TypeError, ValueError) as e:
        log.info("not keeping the dequantized %s: %s", path.name, e)
        tmp.unlink(missing_ok=True)
