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
import math
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4.parallel import leave_process_group

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


def assert_mostly_bitwise(actual: torch.Tensor, expected: torch.Tensor, name: str, *,
                          min_fraction: float = 0.9) -> None:
    """Assert that at least `min_fraction` of the elements are bitwise equal (same shape and dtype required).

    For bf16 outputs that a kernel and its reference both round ONCE from an fp32 value computed in another
    summation order: the orders differ by ~2^-24 relative, so a bf16 rounding flips in a tiny fraction of the
    elements (measured 99.98-100 % equal for the mHC kernels under TRITON_INTERPRET=1), while a missing or extra
    rounding step moves about half of them by one ulp (~50 % equal), which a tolerance of one or two bf16 ulps
    cannot see. Use it next to `assert_close`, never instead. Raises AssertionError naming `name`.
    """
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: {tuple(actual.shape)}/{actual.dtype} != "
                             f"{tuple(expected.shape)}/{expected.dtype}")
    same = float((actual.cpu() == expected.cpu()).float().mean())
    if same < min_fraction:
        raise AssertionError(f"{name}: only {same:.2%} of the elements are bitwise equal to the reference "
                             f"(>= {min_fraction:.0%} expected: one rounding in both, only the summation order "
                             "differs)")


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
    what each rank saved with `save_rank_result(obj, OUT, rank)`, by rank. OUT = out_dir / "res"; run in `cwd`.

    Raises AssertionError with the tail of stdout/stderr when torchrun exits non-zero.
    """

    out = Path(out_dir) / "res"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(script), str(out), *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert p.returncode == 0, f"torchrun failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return [torch.load(f"{out}.{r}") for r in range(nproc)]


def save_rank_result(obj, out, rank: int) -> None:
    """The end of a `torchrun_workers` rank worker: `torch.save(obj, f"{out}.{rank}")`, then leave the process
    group (`dsv4.parallel.leave_process_group`; an open group can abort the rank at interpreter exit)."""

    torch.save(obj, f"{out}.{rank}")
    leave_process_group()


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
    import pytest  # an optional dependency: pytest (the test extra; this helper runs only under pytest)

    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available (these tests need a GPU)")
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, {torch.cuda.device_count()} visible")
    if nccl and not torch.distributed.is_nccl_available():
        pytest.skip("torch.distributed has no NCCL backend in this build")


@torch.no_grad()
def fill_random_quantized_(model, seed: int = 0) -> None:
    """Fill every parameter / buffer of a `Transformer(weights="quantized")` in place, on its device, with random
    values in the on-disk formats (no disk, no CPU copy: Flash / Pro width models for GPU tests and
    benchmarks/bench_model.py). FP8 linears: e4m3 codes ~N(0, 32^2) (clamped to +-448) with one ue8m0 scale per
    128x128 block; FP4 linears: uniform bytes (every e2m1 code, rms ~3.2) with one ue8m0 scale per 32 inputs;
    scales chosen so each weight has std ~1/sqrt(in). Other tensors as `dsv4.tiny.random_state_dict` (norms
    1 + N(0, 0.1^2), embed / attn_sink N(0, 1), ape N(0, 0.5^2), gate bias N(0, 0.1^2), hc_* asymmetric,
    distinct-expert tid2eid, other weights N(0, 1/in)). Deterministic given `seed` on one device type.
    Raises RuntimeError for a tensor no rule covers."""
    g = torch.Generator(device=model.device).manual_seed(seed)
    args = model.args
    for name, mod in model.named_modules():
        if getattr(mod, "fmt", None) in ("fp8", "fp4"):  # "bf16" weights (head, compressors): the rules below
            codes, scale = mod._buffers["weight"], mod._buffers["scale"]
            inp = codes.shape[1] * (2 if mod.fmt == "fp4" else 1)
            if mod.fmt == "fp8":
                w = torch.randn(codes.shape, device=codes.device, generator=g) * 32
                codes.copy_(w.clamp(-448, 448).to(torch.float8_e4m3fn))
                k = round(math.log2(1 / (32 * math.sqrt(inp))))
            else:
                codes.view(torch.uint8).copy_(torch.randint(0, 256, codes.shape, device=codes.device,
                                                            generator=g, dtype=torch.uint8))
                k = round(math.log2(1 / (3.2 * math.sqrt(inp))))  # rms of a uniform e2m1 code ~ 3.2
            scale.view(torch.uint8).fill_(127 + k)
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8) or name.endswith(("inv_freq",
                                                                                                  "hadamard")):
            continue
        last = name.rsplit(".", 1)[-1]
        if last == "tid2eid":
            r = torch.rand(p.shape[0], args.n_routed_experts, device=p.device, generator=g)
            p.copy_(r.argsort(dim=1)[:, :p.shape[1]])
        elif name.endswith("norm.weight"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, device=p.device, generator=g))
        elif name == "embed.weight" or last == "attn_sink":
            p.copy_(torch.randn(p.shape, device=p.device, generator=g))
        elif last == "ape":
            p.copy_(0.5 * torch.randn(p.shape, device=p.device, generator=g))
        elif last == "bias":
            p.copy_(0.1 * torch.randn(p.shape, device=p.device, generator=g))
        elif "hc_" in name and last.endswith("fn"):
            p.copy_(torch.randn(p.shape, device=p.device, generator=g) * (0.5 / math.sqrt(p.shape[1] / 4)))
        elif "hc_" in name and last.endswith("base"):
            p.copy_(0.5 * torch.randn(p.shape, device=p.device, generator=g))
        elif "hc_" in name and last.endswith("scale"):
            p.copy_(0.5 + torch.rand(p.shape, device=p.device, generator=g))
        elif p.dim() == 2:
            p.copy_(torch.randn(p.shape, device=p.device, generator=g) / math.sqrt(p.shape[1]))
        else:
            raise RuntimeError(f"fill_random_quantized_: no rule for {name} {tuple(p.shape)} {p.dtype}")


# --------------------------------------------------------------------------- launches of one decode step (issue 27)
# aten ops that launch nothing on a GPU (views, metadata, allocation without a fill)
_NO_LAUNCH = {"view", "_unsafe_view", "reshape", "expand", "as_strided", "slice", "select", "unsqueeze", "squeeze",
              "permute", "transpose", "t", "detach", "alias", "unflatten", "flatten", "split", "split_with_sizes",
              "unbind", "narrow", "empty", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
              "sym_size", "sym_stride", "is_nonzero", "_local_scalar_dense", "item", "set_", "resize_",
              "view_as_real", "view_as_complex", "_reshape_alias", "diagonal", "chunk", "empty_like",
              "scalar_tensor"}


def decode_launches(model, tok: torch.Tensor, state) -> list[tuple[int, str, str]]:
    """What one decode step `model(tok, state)` would launch on a GPU, in order: [(layer index, kind, name)] with
    kind "triton" (a Triton kernel launch, counted through the interpreter's launcher: needs TRITON_INTERPRET=1
    for the triton backend) or "aten" (an aten op that launches a kernel: every op a `TorchDispatchMode` sees
    except views, metadata and plain allocations, `_NO_LAUNCH`); layer index -1 outside the blocks (embedding,
    head). On a GPU one such aten op is one kernel except a few (`topk`, `sort`: 2-3), so this is the count's
    shape; `benchmarks/bench_model.py` measures the real one with the CUDA profiler. Used by
    `benchmarks/launch_inventory.py` and the launch budget test (tests/unit/test_launch_budget.py)."""
    out: list[tuple[int, str, str]] = []
    where = [-1]
    in_triton = [False]

    class _Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name not in _NO_LAUNCH and not in_triton[0]:
                out.append((where[0], "aten", name))
            return func(*args, **(kwargs or {}))

    interp = None
    try:
        import triton.runtime.interpreter as interp  # triton is an optional dependency
    except ImportError:  # triton is optional: a reference model launches aten ops only
        pass
    orig_run = interp.InterpretedFunction.run if interp is not None else None

    def run(self, *a, **k):
        out.append((where[0], "triton", getattr(self.fn, "__name__", str(self.fn))))
        in_triton[0] = True
        try:
            return orig_run(self, *a, **k)
        finally:
            in_triton[0] = False

    block = type(model.layers[0])
    orig_fwd, orig_fd = block.forward, block.forward_deferred

    def wrap(fn):
        def wrapped(self, *a, **k):
            where[0] = self.layer_id
            try:
                return fn(self, *a, **k)
            finally:
                where[0] = -1
        return wrapped
    block.forward, block.forward_deferred = wrap(orig_fwd), wrap(orig_fd)
    if interp is not None:
        interp.InterpretedFunction.run = run
    try:
        with _Ops():
            model(tok, state)
    finally:
        block.forward, block.forward_deferred = orig_fwd, orig_fd
        if interp is not None:
            interp.InterpretedFunction.run = orig_run
    return out
