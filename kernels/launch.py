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

* `bucketed_gemm(gemm, x2, key)`: the triton backend's torch GEMMs (cuBLAS / CUTLASS, prefill-sized inputs of
  more than 64 rows) run at `gemm_rows(M)` rows, 8 sizes per doubling (issue 29): cuBLAS pays a per-shape cost
  on the first call at a new row count (kernel selection and the lazy load of the kernel it picks: measured on an
  H200 as 2-16 ms of host time per 4-layer Flash prefill at a new length, all of it in `aten::mm`), so a bounded
  set of shapes lets `dsv4.warmup` meet every one of them once (`record_gemms`, `gemm_buckets`).

The workspace cache is the one lasting piece of module state of the kernels; it holds device buffers only (no
dtype, backend or rank), so the reference and the Triton backend still live side by side in one process (STYLE §4).
`record_gemms` holds what it records only while its `with` block runs (the warm-up's).
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


GEMM_MIN_ROWS = 65   # `bucketed_gemm` pads from here (the GEMV kernels take M <= 64 rows; kernels.gemm.GEMV_MAX_M)
_GEMMS_SEEN: dict | None = None  # `record_gemms`: {key: (gemm, row shape, dtype, device)} while recording
_GEMMS_ROWS: set = set()         # `record_gemms`: {(key, rows run at)} while recording


def gemm_rows(M: int) -> int:
    """Rows a torch GEMM of M rows runs at in the triton backend (`bucketed_gemm`): M itself up to 64, above that
    M rounded up to a multiple of 2^(p-4), where 2^(p-1) < M <= 2^p: 8 sizes per doubling (72, 80, ..., 128,
    144, ..., 256, ...), at most 1/8 more rows, and every size a multiple of 8 (FP8 `scaled_mm` needs M % 4 == 0).
    Raises ValueError for M < 0."""
    if not isinstance(M, int) or M < 0:
        raise ValueError(f"gemm_rows: M is {M!r}; expected an int >= 0")
    if M < GEMM_MIN_ROWS:
        return M
    step = 1 << ((M - 1).bit_length() - 4)
    return -(-M // step) * step


def gemm_buckets(max_rows: int) -> list[int]:
    """Every `gemm_rows` value of M in GEMM_MIN_ROWS..max_rows, ascending (80 of them up to 65536): the row counts
    `dsv4.warmup` runs each recorded GEMM at."""
    out, m = [], GEMM_MIN_ROWS
    while m <= max_rows:
        r = gemm_rows(m)
        out.append(r)
        m = r + 1
    return out


def bucketed_gemm(gemm, x2: torch.Tensor, key) -> torch.Tensor:
    """`gemm(x2)` for x2 [M, ...] (any trailing shape) whose result's row i depends on x2[i] only, run at
    `gemm_rows(M)` rows: x2 copied into zero-padded rows when M is not a bucket, the extra result rows dropped
    (a view of the first M rows). `key` names the GEMM's shape class (weight shape and dtypes, the path) for
    `record_gemms`. Same maths as `gemm(x2)`; at another row count cuBLAS may pick another kernel, so the fp32
    summation order may differ (the default mode is not batch-invariant; `kernels.invariant` never comes here)."""
    M = x2.shape[0]
    Mp = gemm_rows(M)
    if _GEMMS_SEEN is not None:
        if key not in _GEMMS_SEEN:
            _GEMMS_SEEN[key] = (gemm, tuple(x2.shape[1:]), x2.dtype, x2.device)
        _GEMMS_ROWS.add((key, Mp))
    if Mp == M:
        return gemm(x2)
    xp = x2.new_zeros((Mp,) + tuple(x2.shape[1:]))
    xp[:M] = x2
    return gemm(xp)[:M]


class record_gemms:
    """Context manager: inside it, every `bucketed_gemm` call records its GEMM once per key (`.seen`: key ->
    (gemm, row shape, dtype, device), so `dsv4.warmup` can run each at every `gemm_buckets` size) and the
    (key, row count) it ran at (`.rows`: the torch GEMM shapes met; tests/gpu/test_compile_count.py checks them
    against the warm-up's). Not reentrant (ValueError)."""

    def __enter__(self) -> "record_gemms":
        global _GEMMS_SEEN, _GEMMS_ROWS
        if _GEMMS_SEEN is not None:
            raise ValueError("record_gemms: already recording (not reentrant)")
        _GEMMS_SEEN, _GEMMS_ROWS = self.seen, self.rows = {}, set()
        return self

    def __exit__(self, *exc) -> None:
        global _GEMMS_SEEN, _GEMMS_ROWS
        _GEMMS_SEEN, _GEMMS_ROWS = None, set()


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
