"""scripts/gpu_check.py must stay runnable for whoever gets a GPU: its --smoke mode runs
every section at tiny sizes on CPU (Triton through its interpreter), here with --tiny: the
default model's stand-in a few MB, since what is checked is that each section runs. The
script runs in this process where there is no GPU (its imports are this process's
already: 5 s of CPU less than a process of its own); on a GPU machine, in a process of
its own with CUDA hidden (this process's Triton compiles for the GPU, not its interpreter)."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_section_cleanly(monkeypatch, capfd):
    argv = ["scripts/gpu_check.py", "--smoke", "--tiny"]
    if torch.cuda.is_available():
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'protos'}",
                   CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
    else:  # Triton already runs under its interpreter here (tests/conftest.py)
        monkeypatch.setattr("sys.argv", argv)
        runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
        captured = capfd.readouterr()
        out = captured.out + captured.err
    assert "Traceback" not in out, out
    assert out.count("exact") == 8, out  # every cache write equals the reference's
    assert "eager == HF: 3/3" in out and "graphs == HF: 3/3" in out, out
    for title in ("decode step time", "W1 throughput", "1B-class"):
        assert title in out, out
