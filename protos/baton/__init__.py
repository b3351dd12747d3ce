"""Baton. Installed, every part lives under this one package: `baton.services`,
`baton.router`, `baton.cli`, ... and the generated stubs in `baton.v1` (pyproject.toml
maps the repository's top-level folders there). In a checkout, the links beside this file
(`services -> ../../services`, ...) make this folder the same tree, so that editors, type
checkers and other tools that read the code without running it follow `baton.*` imports
to the top-level folders (tests/unit/test_layering.py checks the links)."""
