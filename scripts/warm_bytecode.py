"""Write the bytecode of what the tests and services import, once, at install.

`make install` installs without compiling (pip's --no-compile: most of torch is never
imported), so on a fresh venv each module is compiled by the first process that imports
it. In `make test` those are the two test processes and the first services, all starting
at once and each compiling torch and transformers again (8 s a process against 3.5 s from
bytecode): about 15 s of a fresh clone's suite on 2 cores. This imports the same modules
while the CPU kernel builds, so the suite starts where a developer's second run does.
Run by the Makefile; it prints nothing unless an import fails, and never fails itself.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
import traceback

# Imported by the services (tests/e2e/zygote.py preloads the same), by the reference
# models of the family tests, and at run time by a few tests (plots, Triton, PEFT).
MODULES = [
    "baton.cli.main", "baton.router.server", "baton.prefill_worker.server",
    "baton.decode_worker.server", "baton.services.engine.engine",
    "baton.services.engine.tp_ranks", "baton.tools.bench.goodput",
    *(f"transformers.models.{f}.modeling_{f}"
      for f in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")),
    "transformers.models.auto.tokenization_auto", "peft", "triton", "xgrammar",
    "matplotlib.pyplot", "matplotlib.backends.backend_agg",
]


def main() -> None:
    failed = []
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a warm-up: say so and go on
            failed.append(f"{name}: {traceback.format_exc(limit=1).strip()}")
    import pytest

    # Collection imports every test module and, through it, what the tests import.
    with contextlib.redirect_stdout(io.StringIO()):
        pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"])
    for line in failed:
        print(f"warm_bytecode: not imported: {line}", file=sys.stderr)


if __name__ == "__main__":
    main()
