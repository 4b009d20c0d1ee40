"""Fixtures shared by tests/unit and tests/gpu: the tiny checkpoints in the official on-disk layout.

Built once per session into a pytest temp directory by `dsv4.tiny.make_tiny` (about a second each); tests
must treat them as read-only (a test that corrupts a checkpoint copies it first, see `copy_ckpt`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """Directory of the tiny fp8 checkpoint (FP8 e4m3 + F8_E8M0 scales, FP4 experts, 4 shards, seed 0)."""
    from dsv4.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny_fp8") / "ckpt", variant="fp8", seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_bf16(tmp_path_factory) -> Path:
    """Directory of the tiny bf16-only checkpoint (same weights as `tiny_ckpt` before quantization, seed 0)."""
    from dsv4.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny_bf16") / "ckpt", variant="bf16", seed=0)


@pytest.fixture
def copy_ckpt(tmp_path):
    """`copy_ckpt(src) -> Path`: a private, writable copy of a checkpoint directory (for corruption tests)."""

    def _copy(src: Path) -> Path:
        dst = tmp_path / "ckpt"
        shutil.copytree(src, dst)
        return dst

    return _copy
