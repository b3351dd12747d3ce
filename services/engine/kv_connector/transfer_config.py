"""vLLM's `--kv-transfer-config` JSON, read into Baton's own settings. Torch-free.

Every key accepted here changes something; any other is refused by name (a setting that
is silently ignored is a setting the user believes in):

    kv_connector                 "NixlConnector" (Baton's "pd": a decode worker's pull,
                                 over its --kv-transport; with kv_producer, the side
                                 that every prefill worker serves anyway),
                                 "OffloadingConnector" ("offload"), "MultiConnector"
                                 (the stack in kv_connector_extra_config.connectors), or
                                 Baton's own names: "pd", "offload"
    kv_role                      kv_producer / kv_consumer / kv_both: checked against the
                                 worker's role (prefill / decode / colocated)
    kv_load_failure_policy       "recompute" or "fail" (--kv-load-failure-policy)
    kv_connector_extra_config    per connector:
        NixlConnector / pd:      {"backends": ["UCX"]} (the one NIXL backend there is)
        OffloadingConnector:     {"cpu_bytes_to_use": N} (--kv-offload-gib),
                                 {"disk_path": P, "disk_bytes_to_use": N}
        MultiConnector:          {"connectors": [{"kv_connector": ..., ...}, ...]}
"""

from __future__ import annotations

import json
from typing import Any

ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "colocated"}
_NAMES = {"NixlConnector": "pd", "pd": "pd", "OffloadingConnector": "offload",
          "offload": "offload"}
_TOP = ("kv_connector", "kv_role", "kv_load_failure_policy", "kv_connector_extra_config")
_EXTRA = {"pd": ("backends",),
          "offload": ("cpu_bytes_to_use", "disk_path", "disk_bytes_to_use")}
GIB = 1 << 30


def parse(text: str) -> dict[str, Any]:
    """The EngineConfig fields (and `kv_role`, the role it asks for) that the JSON sets;
    ValueError naming the first key or value that has no effect here."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"kv_transfer_config: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError("kv_transfer_config: expected a JSON object")
    out: dict[str, Any] = {}
    _only(doc, _TOP, "kv_transfer_config")
    if "kv_role" in doc:
        if doc["kv_role"] not in ROLES:
            raise ValueError(f"kv_transfer_config.kv_role: {doc['kv_role']!r} is not one of "
                             f"{', '.join(ROLES)}")
        out["kv_role"] = ROLES[doc["kv_role"]]
    if "kv_load_failure_policy" in doc:
        out["kv_load_failure_policy"] = doc["kv_load_failure_policy"]
    if "kv_connector" not in doc:
        if "kv_connector_extra_config" in doc:
            raise ValueError("kv_transfer_config.kv_connector_extra_config: needs "
                             "kv_connector")
        return out
    if doc["kv_connector"] == "MultiConnector":
        extra = doc.get("kv_connector_extra_config", {})
        _only(extra, ("connectors",), "kv_connector_extra_config")
        parts = extra.get("connectors")
        if not isinstance(parts, list) or not parts:
            raise ValueError("kv_transfer_config: MultiConnector needs "
                             "kv_connector_extra_config.connectors, a list")
        for i, part in enumerate(parts):
            if not isinstance(part, dict):
                raise ValueError(f"kv_connector_extra_config.connectors[{i}]: expected an "
                                 f"object")
            _only(part, ("kv_connector", "kv_connector_extra_config"),
                  f"kv_connector_extra_config.connectors[{i}]")
    else:
        parts = [doc]
    names = []
    for part in parts:
        name = _NAMES.get(part.get("kv_connector", ""))
        if name is None:
            raise ValueError(f"kv_transfer_config.kv_connector: {part.get('kv_connector')!r}"
                             f" is not one of {', '.join([*_NAMES, 'MultiConnector'])}")
        names.append(name)
        extra = part.get("kv_connector_extra_config", {})
        _only(extra, _EXTRA[name], f"kv_connector_extra_config of {part['kv_connector']}")
        if name == "pd" and extra.get("backends", ["UCX"]) != ["UCX"]:
            raise ValueError("kv_connector_extra_config.backends: only [\"UCX\"] here")
        if "cpu_bytes_to_use" in extra:
            out["kv_offload_gib"] = _bytes(extra, "cpu_bytes_to_use") / GIB
        if "disk_path" in extra:
            out["kv_offload_disk_path"] = str(extra["disk_path"])
        if "disk_bytes_to_use" in extra:
            out["kv_offload_disk_gib"] = _bytes(extra, "disk_bytes_to_use") / GIB
    out["kv_connector"] = ",".join(names)
    return out


def _only(doc: Any, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a JSON object")
    for key in doc:
        if key not in keys:
            raise ValueError(f"{where}: {key!r} is not accepted here (accepted: "
                             f"{', '.join(keys)})")


def _bytes(extra: dict, key: str) -> int:
    value = extra[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"kv_connector_extra_config.{key}: expected bytes, an integer "
                         f">= 0, got {value!r}")
    return value
