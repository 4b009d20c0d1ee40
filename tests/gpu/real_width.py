"""The real-width checkpoint of the GPU tests: which one, and whether this machine has room for it.

`real_ckpt` (tests/gpu/conftest.py) is `$DSV4_CKPT` when set (a released checkpoint, or one built by
`dsv4 make-checkpoint`), else a Flash-geometry checkpoint of `$DSV4_REAL_LAYERS` main layers (default 4: ratios
0, 0, 4, 128 = SWA, SWA, CSA, HCA; ~20 GB with the MTP block) built once per session by `dsv4.synth` on the GPU,
under pytest's temporary directory. Tests skip with a stated reason when the disk or the GPU memory is too small;
the memory needed comes from `dsv4.memory_plan` (computed, with the factor each loader needs, see `gpu_need`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

REAL_LAYERS_ENV = "DSV4_REAL_LAYERS"
DEFAULT_REAL_LAYERS = 4
GiB = 2 ** 30


def real_layers() -> int:
    """Main layers of the built Flash-geometry checkpoint: $DSV4_REAL_LAYERS (1..43), default 4."""
    raw = os.environ.get(REAL_LAYERS_ENV, "").strip() or str(DEFAULT_REAL_LAYERS)
    if not raw.isdigit() or not 1 <= int(raw) <= 43:
        raise ValueError(f"{REAL_LAYERS_ENV}={raw!r}: expected an integer in 1..43")
    return int(raw)


def build_real_ckpt(base: Path) -> Path:
    """Build (or skip with the reason) the Flash-geometry checkpoint under `base`; returns its directory."""
    from dsv4.synth import checkpoint_bytes, geometry_args, make_checkpoint, plan_shards

    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available: the real-width checkpoint is built and used on a GPU")
    n = real_layers()
    need = checkpoint_bytes(plan_shards(geometry_args("flash", n)))
    free = shutil.disk_usage(base).free
    if need + (1 << 30) > free:
        pytest.skip(f"disk too small for the Flash-geometry checkpoint of {n} layers: needs {need / 1e9:.1f} GB "
                    f"(+1 GB), {base} has {free / 1e9:.1f} GB free (set DSV4_CKPT to an existing checkpoint)")
    return make_checkpoint(base / f"flash{n}", "flash", n, device="cuda").path


def gpu_need(ckpt: Path, weights: str, world_size: int = 1, streamed: bool = True) -> int:
    """Bytes one GPU needs to load and run `ckpt` (TEST_LAYERS honoured) with `weights`: the rank's weights from
    `dsv4.memory_plan.rank_memory` (+ the per-use dequantization temporary for "quantized"), doubled when the
    loader holds the whole state dict beside the model (`dsv4.generate.load_model` at world size 1:
    `streamed=False`), plus 4 GiB for activations, decode state and the allocator."""
    from dsv4.checkpoint import open_source
    from dsv4.config import layers_from_env
    from dsv4.memory_plan import rank_memory

    args = open_source(ckpt).args
    args = args.with_layers(layers_from_env(args.n_layers))
    m = rank_memory(args, world_size, 0, "bf16" if weights == "dequantized" else "quantized")
    return m.peak * (1 if streamed else 2) + 4 * GiB


def release_gpu_memory() -> None:
    """Give this process's cached CUDA blocks back to the driver (gc first, so dropped models are really gone).
    Needed before a test starts a GPU subprocess: the caching allocator of the pytest process otherwise keeps what
    earlier tests' models used (measured: 120 GiB held by pytest after the real-width final-norm tests, and the
    `dsv4 diagnose` subprocesses then ran out of memory)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def require_gpu_memory(ckpt: Path, weights: str, world_size: int = 1, streamed: bool = True) -> None:
    """pytest.skip with the numbers unless every visible GPU has `gpu_need(...)` bytes of memory in total; fails
    (not skips) when the memory exists but is not free after this process released its cache: something else holds
    it (another process, or a model an earlier test leaked), and a skip would hide that."""
    need = gpu_need(ckpt, weights, world_size, streamed)
    have = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    if need > have:
        pytest.skip(f"GPU memory too small for {ckpt} with weights={weights} at world size {world_size}: needs "
                    f"{need / GiB:.1f} GiB (dsv4.memory_plan), a GPU has {have / GiB:.1f} GiB (lower TEST_LAYERS)")
    release_gpu_memory()
    # under torchrun each rank checks its own GPU only (the others fill up with the other ranks' models)
    local = os.environ.get("LOCAL_RANK", "") if os.environ.get("WORLD_SIZE", "1") != "1" else ""
    for i in ([int(local)] if local.isdigit() else range(torch.cuda.device_count())):
        free, _ = torch.cuda.mem_get_info(i)
        if need > free:
            pytest.fail(f"GPU {i}: {free / GiB:.1f} GiB free, {need / GiB:.1f} GiB needed for {ckpt} with "
                        f"weights={weights} at world size {world_size}; this process still holds "
                        f"{torch.cuda.memory_allocated(i) / GiB:.1f} GiB allocated, the rest is held elsewhere")