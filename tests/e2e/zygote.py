"""A fork server for the e2e services. Most of a service's start is imports (torch,
transformers, gRPC: about 7 of a worker's 9 s of CPU on 2 cores), the same in every
process. So each test process starts one zygote that imports them once, and every
service is forked from it and then runs `baton serve` exactly as a fresh process would
(its own argv, environment, working directory and log file).

    test process (a subreaper) ── stdin/stdout ──> zygote (imports done, no threads)
          ▲                                          │ fork
          │ adopts the service when the              ▼
          │ intermediate exits                  intermediate ── fork ──> service
          └──────────────────────────────────────────────────────────────┘

The service is forked twice so that the test process, marked a child subreaper, becomes
its parent: it waits for it and reads its exit status as it would a Popen's (`Forked`).
The zygote never runs a torch op, a tokenizer or a gRPC channel, so nothing that holds a
thread or a lock is forked."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PR_SET_CHILD_SUBREAPER = 36


def preload() -> None:
    """What every service imports, imported once (no torch op runs, no thread starts)."""
    import grpc  # noqa: F401
    import torch  # noqa: F401
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401
    from transformers.models.llama import configuration_llama  # noqa: F401

    import baton.cli.main  # noqa: F401
    import baton.decode_worker.server  # noqa: F401
    import baton.prefill_worker.server  # noqa: F401
    import baton.router.server  # noqa: F401
    import baton.services.engine.engine  # noqa: F401


def serve_forks() -> dict | None:
    """Fork a service for each request read from stdin; answer its pid. Returns the
    request in the forked service, None in the zygote once stdin closes."""
    while line := sys.stdin.readline():
        request = json.loads(line)
        r, w = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.close(r)
            service = os.fork()
            if service == 0:
                os.close(w)
                return request
            os.write(w, str(service).encode())
            os._exit(0)
        os.close(w)
        pid = int(os.read(r, 32))
        os.close(r)
        os.waitpid(middle, 0)
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()
    return None


def run_service(request: dict) -> int:
    """In the forked service: become the process `baton serve` would have been."""
    os.setsid()  # its own session, as processes.spawn starts services
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["baton", *request["argv"]]
    from baton.cli.main import main

    try:
        main(request["argv"])
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


# Variables a library may read once, at import (huggingface_hub's cache paths, thread pools).
IMPORT_TIME_ENV = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "OMP_", "MKL_", "KMP_",
                   "GRPC_", "PYTHON", "TOKENIZERS", "XDG_", "HOME", "TRITON")


def _read_at_import(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


class Forked:
    """A forked service, with the part of Popen's interface the tests use."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The test process's side: one zygote for each set of the variables an import may
    read (most services share one), started at its first service."""

    def __init__(self):
        self.procs: dict[tuple, subprocess.Popen] = {}
        self.lock = threading.Lock()

    def spawn(self, cmd: list[str], log: Path, env: dict, cwd: Path = ROOT) -> Forked:
        """`cmd` is a `python -m baton.cli ...` command line (processes.serve_command)."""
        assert cmd[1:3] == ["-m", "baton.cli"], cmd
        key = tuple(sorted(_read_at_import(env).items()))
        with self.lock:
            proc = self.procs.get(key)
            if proc is None or proc.poll() is not None:
                proc = self.procs[key] = self._start(env)
            request = {"argv": cmd[3:], "log": str(log), "env": env, "cwd": str(cwd)}
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            pid = int(proc.stdout.readline())
        return Forked(pid, cmd)

    @staticmethod
    def _start(env: dict) -> subprocess.Popen:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        return subprocess.Popen([sys.executable, "-m", "tests.e2e.zygote"], cwd=ROOT, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.stdin.close()
                proc.wait(timeout=30)


if __name__ == "__main__":
    preload()
    job = serve_forks()
    if job is not None:
        sys.exit(run_service(job))
