"""LoRA adapters' names and `--lora-modules` entries, checked the same way by the router
(torch-free) and the engine."""

from __future__ import annotations

import json
import re

from ..common.errors import shown

_NAME = re.compile(r"[\w.:@+/-]{1,128}", re.ASCII)


def check_name(name: object) -> str:
    """An adapter's name, as requests give it (the API's `model`): ValueError if it is not
    1 to 128 ASCII letters, digits and ._:@+/-"""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"LoRA adapter name {shown(name)}: 1 to 128 ASCII letters, digits "
                         "and ._:@+/-")
    return name


def parse_lora_module(spec: str) -> tuple[str, str]:
    """A --lora-modules entry: "name=path", or vLLM's JSON {"name": ..., "path": ...}."""
    name = path = None
    if isinstance(spec, str) and spec.lstrip().startswith("{"):
        try:
            d = json.loads(spec)
        except ValueError:
            d = None
        if isinstance(d, dict):
            name, path = d.get("name"), d.get("path")
    elif isinstance(spec, str) and "=" in spec:
        name, path = (p.strip() for p in spec.split("=", 1))
    if not (isinstance(path, str) and path):
        raise ValueError(f"LoRA module {shown(spec)}: give name=path, or JSON with name and "
                         "path")
    return check_name(name), path
