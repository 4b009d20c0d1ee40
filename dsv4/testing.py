"""One numerics helper for every test (STYLE §8): a per-dtype tolerance table and one comparison that
explains itself on failure.

Tolerances (written down once, used everywhere):
    float64   rtol 1e-10  atol 1e-12   exact arithmetic reference
    float32   rtol 1e-5   atol 1e-5    same maths, different summation order
    bfloat16  rtol 1.6e-2 atol 1e-2    8 mantissa bits: 2**-7 relative per rounding, a few roundings deep
    float16   rtol 1e-3   atol 1e-3
Callers that know their computation is deeper than that (e.g. a whole model) pass an explicit `rtol`/`atol`
and say why next to the call.
"""

from __future__ import annotations

import hashlib

import torch

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for outputs of `dtype`. Raises KeyError naming the dtype if it has no entry."""
    if dtype not in TOLERANCES:
        raise KeyError(f"no tolerance written down for dtype {dtype}")
    return TOLERANCES[dtype]


def describe_diff(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Max/mean abs error, relative RMS, worst index with both values, NaN/inf counts."""
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    diff = (a - e).abs()
    finite = torch.isfinite(diff)
    dz = torch.where(finite, diff, torch.zeros_like(diff))
    worst = int(dz.argmax()) if dz.numel() else 0
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape)) if a.dim() else ()
    rel_rms = (dz.pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp_min(1e-30)).item() if dz.numel() else 0.0
    return (f"max_abs={dz.max().item() if dz.numel() else 0:.3e} mean_abs={dz.mean().item() if dz.numel() else 0:.3e} "
            f"rel_rms={rel_rms:.3e} worst{list(idx)}: actual={a[idx].item() if a.numel() else None!r} "
            f"expected={e[idx].item() if e.numel() else None!r} "
            f"nan(actual)={int(torch.isnan(a).sum())} nan(expected)={int(torch.isnan(e).sum())} "
            f"inf(actual)={int(torch.isinf(a).sum())} inf(expected)={int(torch.isinf(e).sum())}")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str, *, dtype: torch.dtype | None = None,
                 rtol: float | None = None, atol: float | None = None) -> None:
    """Assert `|actual - expected| <= atol + rtol*|expected|` elementwise, NaN/inf never equal.

    The tolerance comes from `dtype` (default: `actual.dtype`) unless given. Raises AssertionError naming
    `name`, shapes, and `describe_diff`.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    r, a = tolerance(dtype or actual.dtype)
    rtol = r if rtol is None else rtol
    atol = a if atol is None else atol
    act = actual.detach().double().cpu()
    exp = expected.detach().double().cpu()
    ok = torch.isfinite(act) & torch.isfinite(exp) & ((act - exp).abs() <= atol + rtol * exp.abs())
    if not bool(ok.all()):
        bad = int((~ok).sum())
        raise AssertionError(f"{name}: {bad}/{ok.numel()} elements outside rtol={rtol:g} atol={atol:g}; "
                             + describe_diff(actual, expected))


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Bitwise/exact equality (indices, quantisation codes and scales)."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: {tuple(actual.shape)}/{actual.dtype} != "
                             f"{tuple(expected.shape)}/{expected.dtype}")
    if not torch.equal(actual.cpu(), expected.cpu()):
        neq = (actual.cpu() != expected.cpu())
        first = tuple(int(i) for i in neq.nonzero()[0])
        raise AssertionError(f"{name}: {int(neq.sum())} elements differ; first at {list(first)}: "
                             f"actual={actual[first].item()} expected={expected[first].item()}")


def seed_for(test_id: str, base: int = 0) -> int:
    """Deterministic per-test seed: base + hash of the test id (STYLE §10)."""
    return base + int.from_bytes(hashlib.sha256(test_id.encode()).digest()[:4], "little")


def torchrun_workers(script: str, out_dir, *args: str, cwd=None, nproc: int = 2, timeout: int = 240) -> list:
    """Run `python -m torch.distributed.run --standalone --nproc_per_node NPROC SCRIPT OUT *ARGS` and return
    what each rank saved with `torch.save(obj, f"{OUT}.{rank}")`, by rank. OUT = out_dir / "res"; run in `cwd`.

    Raises AssertionError with the tail of stdout/stderr when torchrun exits non-zero.
    """
    import subprocess
    import sys
    from pathlib import Path

    out = Path(out_dir) / "res"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(script), str(out), *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert p.returncode == 0, f"torchrun failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return [torch.load(f"{out}.{r}") for r in range(nproc)]


def greedy_logits(model, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """[prefill logits at every position [b, s, V]] + the logits [b, V] of `steps` greedy decode steps, from a
    fresh decode state of `model` (a `dsv4.model.Transformer` or its parallel subclass)."""
    st = model.new_state(ids.shape[0])
    out = [model(ids, st, all_logits=True)]
    x = out[0][:, -1].argmax(-1, keepdim=True)
    for _ in range(steps):
        out.append(model(x, st))
        x = out[-1].argmax(-1, keepdim=True)
    return out


def require_gpus(n: int, *, nccl: bool = False) -> None:
    """pytest.skip with a stated reason unless n CUDA devices (and, with nccl, the NCCL backend) are visible."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available (these tests need a GPU)")
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, {torch.cuda.device_count()} visible")
    if nccl and not torch.distributed.is_nccl_available():
        pytest.skip("torch.distributed has no NCCL backend in this build")
