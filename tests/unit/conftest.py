"""What a unit test may not do: start a gRPC server or open a channel, start a process,
bind or listen on a socket, or load the default model. Those tests live in
tests/integration (in-process gRPC, fake workers, engines) or tests/e2e (services as
processes).

The rule holds from each unit test's setup to its teardown, its module's and session's
fixtures included (an autouse fixture would start after those), through hooks that
pytest calls only for the items under this folder. gRPC's core opens its sockets without
Python's `socket`, so its servers and channels are refused by name."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess

import pytest

RULE = "tests/unit runs no process, socket, gRPC server or channel, nor the default model"


class UnitRuleError(RuntimeError):
    pass


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise UnitRuleError(f"{what} in a unit test: {RULE} (move the test to tests/integration)")

    return refused


def _seal(mp: pytest.MonkeyPatch) -> None:
    import grpc
    import grpc.aio

    for module, prefix in ((grpc, "grpc"), (grpc.aio, "grpc.aio")):
        for name in ("server", "insecure_channel", "secure_channel"):
            mp.setattr(module, name, _refuse(f"{prefix}.{name}"))
    # Every Popen (run, check_output, call, asyncio's) ends in _execute_child.
    mp.setattr(subprocess.Popen, "_execute_child", _refuse("starting a process"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            mp.setattr(os, name, _refuse(f"os.{name}"))
    mp.setattr(socket.socket, "bind", _refuse("socket.bind"))
    mp.setattr(socket.socket, "listen", _refuse("socket.listen"))
    # The C++ kernels build in a compiler's process: here torch's ops serve
    # (tests/integration/test_cpu_kernels.py runs the kernels). cpu_ops does not remember
    # this "off": a later integration test in this process builds them as ever.
    mp.setenv("BATON_CPU_KERNELS", "0")


@contextlib.contextmanager
def _sealed():
    """The rule on, for one phase of one test."""
    with pytest.MonkeyPatch.context() as mp:
        _seal(mp)
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _sealed():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _sealed():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    if nextitem is None:  # the session's own fixtures end here, whoever made them
        return (yield)
    with _sealed():
        return (yield)


@pytest.fixture(scope="session")
def hf_model():
    raise UnitRuleError(f"hf_model (the default model in transformers): {RULE}")


@pytest.fixture(scope="session")
def make_llm(make_llm, model_path):
    """The engines of tests/engine_fixtures.py, on tiny models only (tests/tiny_models.py)."""
    def make(**kwargs):
        model = kwargs.get("model")
        if model is None or os.path.realpath(model) == os.path.realpath(model_path):
            raise UnitRuleError(f"an engine of the default model: {RULE}")
        return make_llm(**kwargs)

    return make

