"""The unit folder's rule (tests/unit/conftest.py) bites: inside a unit test, and inside a
module fixture set up for one, each way of starting a gRPC server or channel, a process,
or a listening socket raises, and so does an engine of the default model."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import grpc.aio
import pytest

# Taken at import, outside the rule: were the rule off, the test would not fork pytest.
REAL_FORK = os.fork


def fork():
    assert os.fork is not REAL_FORK, "os.fork is not refused"
    os.fork()


CALLS = {
    "grpc.server": lambda: grpc.server(ThreadPoolExecutor(1)),
    "grpc.aio.server": lambda: grpc.aio.server(),
    "grpc.insecure_channel": lambda: grpc.insecure_channel("127.0.0.1:1"),
    "grpc.secure_channel": lambda: grpc.secure_channel(
        "127.0.0.1:1", grpc.ssl_channel_credentials()),
    "grpc.aio.insecure_channel": lambda: grpc.aio.insecure_channel("127.0.0.1:1"),
    "grpc.aio.secure_channel": lambda: grpc.aio.secure_channel(
        "127.0.0.1:1", grpc.ssl_channel_credentials()),
    "subprocess.Popen": lambda: subprocess.Popen([sys.executable, "-c", "pass"]),
    "subprocess.run": lambda: subprocess.run([sys.executable, "-c", "pass"]),
    "subprocess.check_output": lambda: subprocess.check_output(["true"]),
    "asyncio subprocess": lambda: asyncio.run(asyncio.create_subprocess_exec("true")),
    "os.fork": fork,
    "os.posix_spawn": lambda: os.posix_spawn("/bin/true", ["true"], {}),
    "socket.bind": lambda: socket.socket().bind(("127.0.0.1", 0)),
    "socket.listen": lambda: socket.socket().listen(),
    "asyncio server": lambda: asyncio.run(asyncio.start_server(lambda r, w: None,
                                                               "127.0.0.1", 0)),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_is_refused_inside_a_unit_test(name):
    with pytest.raises(RuntimeError, match="tests/unit runs no process"):
        CALLS[name]()


@pytest.fixture(scope="module")
def module_server():
    """A module fixture: set up before any function fixture, still under the rule."""
    try:
        grpc.aio.server()
    except RuntimeError as e:
        return str(e)
    return "started"


def test_a_module_fixture_is_refused_too(module_server):
    assert module_server.startswith("grpc.aio.server in a unit test")


def test_an_engine_of_the_default_model_is_refused(make_llm, model_path):
    for kwargs in ({}, {"model": str(model_path)}):
        with pytest.raises(RuntimeError, match="default model"):
            make_llm(dtype="float32", **kwargs)


def test_transformers_default_model_is_refused(request):
    with pytest.raises(RuntimeError, match="default model"):
        request.getfixturevalue("hf_model")


def test_the_cpu_kernels_serve_only_if_built_already():
    """Built by an integration test in this process, the kernels serve here too (no
    process starts); else torch's ops serve rather than a compiler being started."""
    from baton.kernels import cpu_ops

    if cpu_ops.isa not in cpu_ops._built:
        assert cpu_ops.ops() is None and cpu_ops.failure() == "BATON_CPU_KERNELS=0"
    else:
        assert cpu_ops.ops() is cpu_ops._built[cpu_ops.isa]


def test_the_kernels_are_not_left_off_after_a_unit_test():
    """Run after the test above (which asked for them with the rule's "off" on): that
    was not remembered as a failed build, so an integration test later in this process
    builds the kernels as ever. Holds whether or not one built them earlier."""
    from baton.kernels import cpu_ops

    assert "BATON_CPU_KERNELS=0" not in cpu_ops._failed.values()
