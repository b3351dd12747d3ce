"""Baton. Installed, every part lives under this one package: `baton.services`,
`baton.router`, `baton.cli`, ... and the generated stubs in `baton.v1` (pyproject.toml
maps the repository's top-level folders there). In a checkout the parts stay in those
top-level folders, so the checkout's root joins this package's path: `import
baton.services` finds them there too, with nothing installed."""

from pathlib import Path as _Path

_root = _Path(__file__).resolve().parents[2]
if (_root / "services" / "engine").is_dir() and (_root / "protos" / "baton").is_dir():
    __path__.append(str(_root))
