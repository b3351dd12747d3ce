"""One flag table for every role. Each flag says which roles take it and which config
field it fills; its default is that field's default (defined once, in the config
dataclass), its environment variable is `BATON_` + its name, and `--help` shows both.

    --kv-cache-gib     prefill decode colocated   fills EngineConfig.kv_cache_gib

A bad value, on the command line or in a variable, gets one line naming it.
"""

from __future__ import annotations

import argparse
import os
import sys

from .flag_spec import (  # noqa: F401 (the names callers take from here)
    BUILT_BY,
    CLUSTER,
    CONFIGS,
    DEFAULT_PORTS,
    ROLES,
    ROUTERS,
    WORKERS,
    Flag,
)
from .flag_table import FLAGS


class EnvError(SystemExit):
    def __init__(self, flag: Flag, raw: str, why: str, name: str | None = None):
        super().__init__(f"baton: {name or flag.env}={raw!r}: {why}")


def add_flags(parser: argparse.ArgumentParser, roles: tuple[str, ...]) -> list[Flag]:
    """Add every flag any of `roles` takes, its default from its variable when set."""
    flags = [f for f in FLAGS if set(f.roles) & set(roles)]
    for flag in flags:
        default = flag.default
        given = flag.from_env(os.environ)
        if given is not None:
            name, raw = given
            try:
                default = flag.parse_env(name, raw)
            except ValueError as e:
                raise EnvError(flag, raw, str(e), name) from None
        shown = ",".join(default) if isinstance(default, list) else default
        if flag.secret and default:
            shown = "(set)"
        variables = f"{flag.env}, else {flag.vllm_env}" if flag.vllm_env else flag.env
        help_text = argparse.SUPPRESS if flag.hidden else (
            f"{flag.help} [{variables}; default: {shown}]")
        kw: dict = {"default": default, "help": help_text, "dest": flag.dest}
        if flag.kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif flag.kind is list:
            kw.update(action="append", default=None, nargs="+" if flag.spaced else None)
            parser.set_defaults(**{f"{flag.dest}_env": default})
        else:
            kw["type"] = _checked(flag)
            if flag.choices:
                kw["choices"] = flag.choices
        parser.add_argument(f"--{flag.name}", *(f"--{a}" for a in flag.aliases), **kw)
    return flags


def _checked(flag: Flag):
    def convert(text: str):
        try:
            return flag.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = flag.kind.__name__
    return convert


def values(ns: argparse.Namespace, flags: list[Flag], role: str) -> dict[str, dict]:
    """{config: {field: value}} for `role`, from parsed flags."""
    out: dict[str, dict] = {name: {} for name in CONFIGS}
    for flag in flags:
        if role not in flag.roles:
            continue
        value = tuple(_entries(ns, flag)) if flag.kind is list else getattr(ns, flag.dest)
        for config, field in flag.fills:
            if role in BUILT_BY[config]:
                out[config][field] = value
    return out


def argv_for(ns: argparse.Namespace, flags: list[Flag], role: str) -> list[str]:
    """Command-line arguments that give a `role` process the same values (baton up)."""
    args: list[str] = []
    for flag in flags:
        if role not in flag.roles or (flag.kind is list and not flag.spaced) or flag.secret:
            continue
        value = _entries(ns, flag) if flag.kind is list else getattr(ns, flag.dest)
        if flag.kind is list:  # a spaced one: its entries, as given
            args += [f"--{flag.name}", *value] if value else []
        elif value is None:
            continue
        elif flag.kind is bool:
            args.append(f"--{flag.name}" if value else f"--no-{flag.name}")
        else:
            args += [f"--{flag.name}", str(value)]
    return args


def _entries(ns: argparse.Namespace, flag: Flag) -> list[str]:
    """A list flag's entries: given (repeated; comma-separated unless spaced), else its
    variable's."""
    given = getattr(ns, flag.dest) or []
    if not given:
        return list(getattr(ns, f"{flag.dest}_env"))
    parts = [a for v in given for a in (v if flag.spaced else v.split(","))]
    return [a.strip() for a in parts if a.strip()]


def fail(message: str) -> None:
    sys.exit(f"baton: {message}")
