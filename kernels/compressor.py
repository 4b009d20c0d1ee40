"""Compressor pooling of one window at decode (spec §6): `pooled[b, j] = sum_i softmax_i(Z[b, :, j]) * A[b, i, j]`.

Spec: `dsv4_reference_spec.md` §6 (KV compressor): the entry that closes a window is the softmax-over-slots
(score Z = wgate(x) + ape, fp32) weighted sum of the slots' kv rows A (fp32); the CSA compressor (r = 4) pools
2r slots (the previous window's first halves and the current window's second halves), the HCA compressor
(r = 128) r slots. `softmax_pool_ref` is exactly the model's `(Z.softmax(1) * A).sum(1, keepdim=True)`
(`dsv4.model.Compressor.decode`). `softmax_pool` computes it in one launch: torch's `softmax(1)` over a middle
axis runs its "spatial" kernel, measured at 39 µs per call on an H200 for [1, 128, 512] (3 of the 4.05 ms of a
4-layer Flash decode step; benchmarks/RESULTS.md), plus a multiply and a sum launch.

Numerics: fp32 throughout, max-subtracted exponentials as torch's softmax; the kernel divides the weighted sum
once by the sum of the exponentials (torch divides every weight first), so results agree within a few fp32 ulps
(tests: rtol 1e-6). A column whose scores are all -inf gives NaN in both (torch: 0/0).

Dimension legend: b batch, n slots (r or 2r), d width (c*d of the compressor, or d after the CSA overlap cat).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import check_layout
from kernels.launch import fail as _fail


def _check(op: str, Z, A) -> tuple[int, int, int]:
    for name, t in (("Z", Z), ("A", A)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.dtype != torch.float32:
            _fail(op, name, f"{getattr(t, 'dtype', type(t))} shape {tuple(getattr(t, 'shape', ()))}",
                  "float32 [b, n, d]")
    if Z.shape != A.shape:
        _fail(op, "A", f"shape {tuple(A.shape)}", f"Z's shape {tuple(Z.shape)}")
    b, n, d = Z.shape
    if n == 0 or n > 4096:
        _fail(op, "Z", f"{n} slots", "1..4096 slots (a compressor window: r or 2r)")
    return b, n, d


def softmax_pool_ref(Z: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """The model's pooling: Z, A fp32 [b, n, d] -> [b, 1, d] fp32 = (Z.softmax(1) * A).sum(1, keepdim=True).
    Raises ValueError on a wrong shape or dtype."""
    _check("softmax_pool_ref", Z, A)
    return (Z.softmax(1) * A).sum(1, keepdim=True)


@triton.jit
def _softmax_pool_kernel(z_ptr, a_ptr, out_ptr, n, d, BN: tl.constexpr, BD: tl.constexpr):
    """One program per (batch row, BD columns): all n slots of its columns in registers (n <= BN)."""
    b = tl.program_id(0)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    offs_n = tl.arange(0, BN)
    mask = (offs_n < n)[:, None] & (offs_d < d)[None, :]
    rows = (b * n + offs_n).to(tl.int64) * d
    z = tl.load(z_ptr + rows[:, None] + offs_d[None, :], mask=mask, other=float("-inf"))
    a = tl.load(a_ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    m = tl.max(z, axis=0)
    e = tl.exp(z - m[None, :])
    e = tl.where(mask, e, 0.0)
    pooled = tl.sum(e * a, axis=0) / tl.sum(e, axis=0)
    tl.store(out_ptr + b.to(tl.int64) * d + offs_d, pooled, mask=offs_d < d)


def softmax_pool(Z: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """`softmax_pool_ref` in one Triton launch (no host sync; CUDA-graph capturable).

    Args: Z (scores), A (kv rows): float32 [b, n, d] contiguous, same shape and device, n <= 4096.
    Returns: [b, 1, d] float32, equal to the reference within a few fp32 ulps (module docstring).
    Raises: ValueError naming the wrong argument (shape, dtype, layout, device).
    """
    op = "softmax_pool"
    b, n, d = _check(op, Z, A)
    check_layout(op, {"Z": Z, "A": A})
    out = torch.empty(b, 1, d, dtype=torch.float32, device=Z.device)
    BN = max(2, triton.next_power_of_2(n))
    BD = max(16, min(triton.next_power_of_2(d), 8192 // BN))
    _softmax_pool_kernel[(b, triton.cdiv(d, BD))](Z, A, out, n, d, BN=BN, BD=BD, num_warps=4)
    return out
