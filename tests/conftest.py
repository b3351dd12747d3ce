"""The session's hooks: the marks and order, how xdist shares the tests out, and what
must happen when torch or triton is first imported. The models and engines are fixtures
of tests/engine_fixtures.py. Nothing here imports torch: the torch-free tests run
without it (tests/integration/test_torch_free.py)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from tests.xdist_groups import pytest_xdist_make_scheduler  # noqa: F401 (a hook)

pytest_plugins = ("tests.engine_fixtures", "tests.time_budget")


def _configure_torch(torch) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Two test processes on two cores: one torch thread each, so neither waits on
        # the other's spinning threads (the service tests' workers run one thread too).
        torch.set_num_threads(1)


class _FirstImports:
    """On the first `import triton`: without a GPU, Triton kernels run under Triton's
    interpreter, chosen when a kernel is decorated, so TRITON_INTERPRET is set before
    triton loads. On the first `import torch`: its threads, once it has loaded."""

    waiting = {"torch", "triton"}

    def find_spec(self, name, path=None, target=None):
        if name not in self.waiting:
            return None
        self.waiting.discard(name)
        if name == "triton":
            import torch

            if not torch.cuda.is_available():
                os.environ.setdefault("TRITON_INTERPRET", "1")
            return None  # the ordinary finders load triton
        spec = importlib.util.find_spec(name)  # this finder now passes torch on
        exec_module = spec.loader.exec_module

        def exec_then_configure(module):
            exec_module(module)
            _configure_torch(module)

        spec.loader.exec_module = exec_then_configure
        return spec


if "torch" in sys.modules:  # a plugin imported it first
    _FirstImports.waiting.discard("torch")
    _configure_torch(sys.modules["torch"])
sys.meta_path.insert(0, _FirstImports())


def pytest_collection_modifyitems(config, items) -> None:
    """Marks `e2e` on everything under tests/e2e (services as processes). Then the order:
    modules with `slow` tests first, then the e2e ones, then the many short ones, so that
    with xdist the long modules start early and the short ones even out the end."""
    for item in items:
        if "tests/e2e/" in item.nodeid:
            item.add_marker(pytest.mark.e2e)
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def rank(item) -> int:
        module = item.nodeid.split("::")[0]
        return 0 if module in slow else 1 if "tests/e2e/" in module else 2

    items.sort(key=rank)  # stable: each module keeps its own order
