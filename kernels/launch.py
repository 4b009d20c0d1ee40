"""Launch plumbing shared by the Triton launchers: cached device facts and stream-ordered workspaces.

Why it exists (issue 6/7, launch overhead): the launchers used to ask the driver for the SM count, allocate
their split-K workspaces and, for one-launch kernels, would need a zeroed semaphore array on every call. Here:

* `sm_count(device)`: `torch.cuda.get_device_properties(i).multi_processor_count`, cached per device index
  (`functools.lru_cache`; device properties do not change while a process runs).
* `split_k(device, n_blocks, k_tiles, per_sm)`: how far a skinny GEMV splits its K loop (about `per_sm`
  programs per SM), and `split_k_total`, the deterministic merge of the split partials inside the launch
  (`kernels.gemm._fp8_gemv_kernel`, `kernels.fp32_linear._bf16w_gemv_kernel`).
* `workspace(device, n_sem, n_scratch)`: one `(sem, scratch)` pair per (device, current stream):
  `sem` int32 `[>= n_sem]`, all zero between launches (every kernel that takes it increments an entry once per
  program and the last program of a group resets it to 0, so no memset launch is needed per call);
  `scratch` fp32 `[>= n_scratch]`, uninitialised, for split partials written and read inside one launch.
  Stream ordering makes the reuse safe: kernels of one stream run one after another. The pair is NOT safe for
  two launches that run concurrently on one stream's workspace, i.e. two CUDA graphs captured on one stream and
  replayed at the same time on two different streams; nothing in dsv4 does that.
  Inside CUDA-graph capture a missing or too small pair is allocated for that call only (never cached), so a
  capture without a warm-up on its stream still records correct (zero-initialised) buffers.

This cache is the one piece of module state of the kernels; it holds device buffers only (no dtype, backend or
rank), so the reference and the Triton backend still live side by side in one process (STYLE §4).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the references stay importable without it; launching raises
    triton = None
    tl = None

_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1, read at call time)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device, cpu_default: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached per index); `cpu_default` for interpreter tensors."""
    if device.type != "cuda":
        return cpu_default
    return _cuda_sm_count(torch.cuda.current_device() if device.index is None else device.index)


def workspace(device: torch.device, n_sem: int, n_scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(sem int32 [>= n_sem] all zero, scratch fp32 [>= n_scratch])` for the current stream of `device`.

    The caller's kernel must leave every `sem` entry it touches at 0 when it ends (see the module docstring).
    """
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        key = ("cuda", index, torch.cuda.current_stream(index).cuda_stream)
    else:
        key = (device.type, device.index, 0)
    ws = _WORKSPACES.get(key)
    if ws is not None and ws[0].numel() >= n_sem and ws[1].numel() >= n_scratch:
        return ws
    n_sem, n_scratch = max(n_sem, 256), max(n_scratch, 1 << 16)
    if ws is not None:
        n_sem, n_scratch = max(n_sem, ws[0].numel()), max(n_scratch, ws[1].numel())
    fresh = (torch.zeros(n_sem, dtype=torch.int32, device=device),
             torch.empty(n_scratch, dtype=torch.float32, device=device))
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return fresh  # recorded in the graph (its zero fill included); not cached for later eager calls
    _WORKSPACES[key] = fresh
    return fresh


def fail(op: str, name: str, value, expected: str) -> None:
    """Raise the launchers' one error shape: ValueError("{op}: {name} is {value}; expected {expected}")."""
    raise ValueError(f"{op}: {name} is {value}; expected {expected}")


def check_layout(op: str, named: dict) -> None:
    """Launchers only, after all shape/dtype checks: every tensor of `named` ({argument name: tensor}) contiguous,
    on CUDA (CPU only under TRITON_INTERPRET=1), all on the first one's device. Raises ValueError (`fail`);
    RuntimeError when triton is not installed (the kernels are then not defined)."""
    if triton is None:
        raise RuntimeError(f"{op}: triton is not installed; use the *_ref function or install dsv4[triton]")
    interp = interpreting()
    first = next(iter(named.values())).device
    for name, t in named.items():
        if not t.is_contiguous():
            fail(op, name, f"non-contiguous (strides {t.stride()})", "a contiguous tensor")
        if not (t.is_cuda or (interp and t.device.type == "cpu")):
            fail(op, name, f"on device {t.device}", "a CUDA tensor (CPU only under TRITON_INTERPRET=1)")
        if t.device != first:
            fail(op, name, f"on device {t.device}", f"the device of the first tensor argument, {first}")


def split_k(device: torch.device, n_blocks: int, k_tiles: int, per_sm: int = 2) -> tuple[int, int]:
    """(SPLIT, K tiles per split) for a grid of `n_blocks` output blocks: about `per_sm` programs per SM (the
    interpreter counts 8 SMs), splits of >= 2 K tiles, no split below 4 tiles."""
    want = max(1, min(-(-per_sm * sm_count(device, 8) // n_blocks), k_tiles // 2 if k_tiles >= 4 else 1))
    per = -(-k_tiles // want)
    return -(-k_tiles // per), per


if triton is not None:  # the kernels exist only where triton is installed (it is optional)
    @triton.jit
    def split_k_total(acc, part_ptr, sem, poffs, stride, pid_s, SPLIT, mask):
        """Deterministic split-K merge inside one launch: this program's partial `acc` (fp32, any shape) goes to
        part_ptr[pid_s * stride + poffs]; the program that arrives last at its semaphore `sem` (acq_rel atomic; the
        scratch and semaphores of `workspace`) sums the SPLIT partials in split order and resets `sem` to 0.
        Returns (total, last): `total` is the full sum where `last` is true (the caller then writes it), else 0."""
        tl.store(part_ptr + pid_s * stride + poffs, acc, mask=mask)
        tl.debug_barrier()
        last = tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
        tot = tl.zeros(acc.shape, dtype=tl.float32)
        if last:
            for s in range(0, SPLIT):
                tot += tl.load(part_ptr + s * stride + poffs, mask=mask, other=0.0, volatile=True)
            tl.store(sem, 0)
        return tot, last
