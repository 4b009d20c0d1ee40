"""Fixtures of the GPU tests: the real-width checkpoint (see tests/gpu/real_width.py)."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def real_ckpt(tmp_path_factory):
    """`$DSV4_CKPT` (a directory, or a synthetic source `synth:GEOMETRY[:LAYERS[:SEED]]` whose tensors each rank
    generates as it loads them: full depth without the files, docs/multi_gpu.md), else a Flash-geometry
    checkpoint of $DSV4_REAL_LAYERS (default 4) layers built on the GPU once per session and deleted at its end (~20 GB; pytest would otherwise keep it among its last three temporary
    directories); skips with the reason when there is no GPU or not enough disk."""
    env = os.environ.get("DSV4_CKPT")
    if env == "":  # `DSV4_CKPT=$UNSET pytest ...` must not quietly test a synthetic checkpoint instead
        raise ValueError("DSV4_CKPT is set but empty; expected a checkpoint directory or synth:GEOMETRY (unset it "
                         "to test a synthetic Flash-geometry checkpoint)")
    if env:
        from dsv4.synth import is_synth_source, parse_source

        if is_synth_source(env):
            yield Path(str(parse_source(env)))  # ValueError naming the bad field
            return
        if not Path(env).is_dir():
            raise FileNotFoundError(f"DSV4_CKPT={env}: not a checkpoint directory")
        yield Path(env)
        return
    from tests.gpu.real_width import build_real_ckpt

    base = tmp_path_factory.mktemp("real_width")
    try:
        yield build_real_ckpt(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _flash_width_slots() -> int:
    """Flash-width modules at once: DSV4_FLASH_WIDTH_SLOTS, else 2 on a GPU of >= 120 GiB (H200: 140 GiB) and 1 below
    (an H100's 80 GiB: test_graph_decode.py alone holds ~65 GiB - two such modules under `-n 2` ran out of memory
    in the fifth session of 2026-12-06)."""
    if "DSV4_FLASH_WIDTH_SLOTS" in os.environ:
        return int(os.environ["DSV4_FLASH_WIDTH_SLOTS"])
    if not torch.cuda.is_available():
        return 1
    return 2 if torch.cuda.get_device_properties(0).total_memory >= 120 * 2**30 else 1


FLASH_WIDTH_SLOTS = _flash_width_slots()


@pytest.fixture(scope="module", autouse=True)
def _flash_width_modules_share_the_gpu(request):
    """Modules marked `flash_width` hold Flash-width models (4 layers: ~15 GiB each in bf16; test_graph_decode.py
    ~65 GiB) for their whole run. Under pytest-xdist (`pytest -n 4 tests/gpu`) three or four at once exceed one
    H200's 140 GiB (seen: out of memory while building a model, an error that is not the code's), so each takes
    one of FLASH_WIDTH_SLOTS exclusive file locks (per visible-device set; `_flash_width_slots`: 2 on a GPU of
    >= 120 GiB, else 1) for its duration and returns its cached memory to the driver before releasing it; other
    modules run alongside. Serial runs take a slot uncontended."""
    if request.node.get_closest_marker("flash_width") is None:
        yield
        return
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(",", "-") or "none"
    locks = [open(Path(tempfile.gettempdir()) / f"dsv4-gpu-flash-width-{devices}-{i}.lock", "w")
             for i in range(max(1, FLASH_WIDTH_SLOTS))]
    held = None
    try:
        while held is None:
            for lock in locks:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = lock
                    break
                except BlockingIOError:
                    continue
            else:
                time.sleep(0.5)
        yield
    finally:
        from tests.gpu.real_width import release_gpu_memory

        release_gpu_memory()  # the module's models are gone (module fixtures tear down first): give their memory back
        for lock in locks:  # closing a file releases its lock
            lock.close()


@pytest.fixture(autouse=True)
def _release_gpu_memory_after_test():
    """Models of one test never hold GPU memory into the next: tests that start GPU subprocesses (diagnose,
    torchrun) need it free (tests/gpu/real_width.py `release_gpu_memory`)."""
    yield
    from tests.gpu.real_width import release_gpu_memory

    release_gpu_memory()


@pytest.fixture(scope="session", autouse=True)
def _leave_process_group():
    """Under torchrun (one pytest per rank, e.g. benchmarks/full_depth_gpu.sh), leave the NCCL process group that
    the multi-rank model loads created, cleanly at the end of the session: an open group aborts at interpreter
    exit (the same as dsv4.cli and benchmarks/measure_real_width.py)."""
    yield
    from dsv4.parallel import leave_process_group

    leave_process_group()
