"""What a flag is: its name, the roles that take it, the config fields it fills. The
table of every flag is flag_table.py; parsing them is flags.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from baton.router.config import RouterConfig
from baton.services.common.limits import Limits
from baton.services.engine.config import EngineConfig, SpecConfig
from baton.services.rpc.config import ServiceConfig
from baton.services.worker.config import WorkerConfig

ROLES = ("router", "prefill", "decode", "colocated")
WORKERS = ("prefill", "decode", "colocated")
ROUTERS = ("router", "colocated")
CLUSTER = ("router", "prefill", "decode")  # the roles that call or serve workers
DEFAULT_PORTS = {"router": 50051, "prefill": 50061, "decode": 50071, "colocated": 50051}
CONFIGS = {"engine": EngineConfig, "worker": WorkerConfig, "router": RouterConfig,
           "service": ServiceConfig, "spec": SpecConfig, "limits": Limits}
# The roles that build each config: a flag fills only the configs its role builds.
BUILT_BY = {"engine": WORKERS, "worker": WORKERS, "spec": WORKERS, "router": ROUTERS,
            "limits": ROUTERS, "service": ROLES}


@dataclass(frozen=True)
class Flag:
    name: str  # without dashes: "kv-cache-gib"
    roles: tuple[str, ...]
    fills: tuple[tuple[str, str], ...]  # (config, field) per target; the first gives the default
    help: str
    kind: type = str  # str, int, float, bool or list (of addresses)
    choices: tuple[str, ...] | None = None
    optional: bool = False  # None is a value (unset)
    hidden: bool = False
    secret: bool = False  # never in --help or in a child's argv (baton up: env instead)
    aliases: tuple[str, ...] = ()  # other names of the flag (vLLM's), without dashes
    spaced: bool = False  # a list given as `--flag a b` (vLLM's nargs), never comma-split
    # vLLM's variable for the flag, read when its BATON_ one is unset, whole (one value, as
    # vLLM reads it): a vLLM user's setting is never dropped.
    vllm_env: str | None = None

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return "BATON_" + self.dest.upper()

    @property
    def default(self):
        config, name = self.fills[0]
        field = next(f for f in dataclasses.fields(CONFIGS[config]) if f.name == name)
        value = field.default
        return list(value) if isinstance(value, tuple) else value

    def from_env(self, environ) -> tuple[str, str] | None:
        """(the variable, its text) this flag takes from `environ`, or None."""
        if self.env in environ:
            return self.env, environ[self.env]
        if self.vllm_env and self.vllm_env in environ:
            return self.vllm_env, environ[self.vllm_env]
        return None

    def parse_env(self, name: str, raw: str):
        """A value from the text of variable `name`: vLLM's is one value, unsplit."""
        if name == self.vllm_env and self.kind is list:
            return [raw.strip()] if raw.strip() else []
        return self.parse(raw)

    def parse(self, raw: str):
        """A value from its text (an environment variable): ValueError says why not."""
        if self.kind is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError("not a boolean (true/false, 1/0, yes/no, on/off)")
        if self.kind is list:
            return raw.split() if self.spaced else [a.strip() for a in raw.split(",")
                                                    if a.strip()]
        if self.optional and raw.strip() in ("", "none", "None"):
            return None
        try:
            value = self.kind(raw)
        except ValueError:
            raise ValueError(f"not {'an integer' if self.kind is int else 'a number'}"
                             if self.kind in (int, float) else "bad value") from None
        if self.choices and value not in self.choices:
            raise ValueError(f"not one of {', '.join(self.choices)}")
        return value


def _f(name, roles, fills: str | tuple[tuple[str, str], ...], help, **kw) -> Flag:
    if isinstance(fills, str):  # "config.field"
        config, field = fills.split(".", 1)
        fills = ((config, field),)
    return Flag(name, tuple(roles), fills, help, **kw)
