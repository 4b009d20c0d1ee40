"""`dsv4 diagnose` and `dsv4 generate` under a torchrun launch (2 CPU processes, gloo): every rank computes,
rank 0 alone prints, and the report states the world size."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "dsv4.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_diagnose_under_torchrun(tiny_ckpt):
    p = _torchrun("diagnose", "--ckpt", str(tiny_ckpt), "--dtype", "fp32", "--decode-steps", "1")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("RESULT: PASS (both decisive tests)") == 1
    assert "world size 2" in p.stdout


@pytest.mark.slow
def test_generate_under_torchrun(tiny_ckpt):
    p = _torchrun("generate", "--ckpt", str(tiny_ckpt), "--prompt", "Hi", "--max-tokens", "2")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stderr.count("stop=") == 1
