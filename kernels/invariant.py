"""Batch-invariant mode (issue 25): a request's logits bitwise independent of its batch, its neighbours, a
verify step's length and how its prompt is chunked.

Selected when the model is built: `Transformer(..., backend="triton", batch_invariant=True)` (also
`load_model(..., batch_invariant=True)`, `dsv4 generate / diagnose --batch-invariant`), which builds the triton
backend table with `get_backend("triton", device, batch_invariant=True)`: the entries below and the kernels'
`invariant=True` launches. The backend table is frozen; nothing is switched after construction.

THE GUARANTEE (tested: tests/unit/test_batch_invariant.py under the interpreter, tests/gpu/test_batch_invariant.py
on the GPU at Flash width): with bf16 activations and weights="quantized", on one GPU (world size 1),
  * DECODE: the logits of a request's decode step are bitwise the same decoded alone or as any row of a batch of
    1..64 rows (b*s <= 64) whose other rows hold any requests at any positions (ragged `DecodeState.row_pos`),
    eager or inside the CUDA graph of `dsv4/graph.py`; a (k+1)-token verify step (`decode_step` with s = k+1 <=
    MAX_STEP_TOKENS, `Transformer.verify`) equals k+1 single-token steps;
  * CHUNKED PREFILL: a prompt prefilled in appended calls (`Transformer.forward` on a state) whose every call has
    more than 64 rows (b*s > 64; the unit: a chunk of >= 65 tokens at batch 1, its boundaries anywhere, inside a
    compression window too) leaves the same state and gives the same logits, bitwise, as the prompt prefilled at
    once; so does every decode step after it;
  * run to run (no atomics in any sum: split-K partials are merged in split order by the last program).
The two sides differ on purpose: a call of <= 64 rows runs the decode launches (16-row tensor-core tiles, the
MoE's gemv path), a call of > 64 rows the prefill launches (the FP8 128 x 128 tiles, 64-row GEMV tiles, the MoE's
fixed tiles); each side is fixed, so a row's value depends on its own inputs only, but a prompt chunk of 9..64
tokens (decode launches) is not bitwise a slice of the whole prompt's call, nor is a token's prefill bitwise its
decode step (the default mode's prefill == decode holds within the bf16 tolerance, tests/unit/test_model.py).
NOT covered: other GPU types (a split count follows the SM count, tensor-core instructions differ per
  architecture); other torch / triton / CUDA versions; tensor / expert parallel world sizes > 1 (the all-reduce
  order of NCCL); the fp32 exact mode and weights="dequantized" (their linears are cuBLAS: refused with
  ValueError); the reference backend (cuBLAS picks its algorithm by M: refused); decode batches of > 64 rows.

What the mode fixes (the audit; README "Batch-invariant mode" has the table):
  * FP8 linears and the grouped wo_a: `kernels.gemm.invariant_config` per weight shape (tuned on sm_90), 16-row
    tiles in one launch, split `invariant_split(N, K)` (default: `gemv_config` and `GEMV_TUNED` by the M bucket,
    BM = next_pow2(M), split from the bn that follows M, up to 8 rows; the 64-row DECODE_TILE tiles from 9); above
    64 rows the 128 x 128 prefill tiles (FP8 linear; default: cuBLAS scaled_mm or dequant + cuBLAS by shape) and
    64-row GEMV tiles (wo_a; default: cuBLAS bmm);
  * bf16-weight linears (indexer weights_proj): `kernels.fp32_linear` invariant launch + one bf16 rounding (the
    default runs cuBLAS bf16 GEMMs, not batch invariant);
  * fp32 linears (head, compressor wkv / wgate, router): `fp32_linear(invariant=True)`: bf16x3 dots on 16-row
    tiles (64 above 64 rows), blocks per N (default: CUDA-core rows at M = 1, bf16x3 dots above, cuBLAS above 64);
  * routed experts: the gemv path up to 64 tokens, fixed 32 x 128 tiles above, a left-to-right slot sum (default:
    path and tiles by pair count);
  * mHC pre / head: 16-row tiles and a split count fixed per K (default: split count from T); the fused
    post + pre boundary is off (the default's too, since the fifth session of 2026-12-06);
  * sparse attention: one kernel per head count, all columns per program, splits of 128 slots (default: the same
    kernel by head count, but column split and split count from b*s, the SMs and k); the s = 1 step lists the
    window's slots in position order as the s > 1 step does (default: ring-slot order: another order of the softmax sums);
  * torch reductions: the per-head q RMS (`head_rms`) and the indexer / compressor Hadamard (`hadamard`) as
    per-row kernels, the compressor's prefill pooling (`pool_windows`) as a tree of elementwise adds.
Already invariant in the default mode: RMSNorm (one program per row), the router after its logits
(`kernels.router.route`: one program per row, its weight sum left to right in pick order, as `route_ref`), the activation quantizations (per row /
block), RoPE, the compressor's decode pooling and commit (per row), the indexer scores (a key's score never mixes with
another key's; chunks are block-aligned) and top-k (exact rule, ties to the lower index), hc_post (per token),
the MoE gemv path itself, every elementwise torch op on CUDA.
"""

from __future__ import annotations

import torch

from kernels import fp32_linear as kfp32
from kernels import gemm as kgemm
from kernels import moe as kmoe
from kernels import norm as knorm
from kernels import numerics
from kernels.gemm import dequantize_ref

__all__ = ["linear", "fp32_linear", "grouped_linear", "moe_routed", "head_rms", "hadamard", "pool_windows"]

_BLOCK = 128


def _refuse(what: str, detail: str) -> None:
    raise ValueError(f"batch_invariant=True: {what} ({detail}); the mode covers bf16 activations with "
                     "weights='quantized' on the triton backend (kernels.invariant)")


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32-compute linear, `fp32_linear_ref` signature: x [..., in] (fp32 / bf16 read as is, other float dtypes
    upcast), weight [out, in] bf16 -> [..., out] fp32 via `kernels.fp32_linear.fp32_linear(invariant=True)`.
    Raises ValueError for an fp32 weight (weights="dequantized": that path is cuBLAS)."""
    if weight.dtype != torch.bfloat16:
        _refuse("fp32 linear with an fp32 weight", f"weight dtype {weight.dtype}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.dtype not in (torch.float32, torch.bfloat16):
        x2 = x2.float()
    y = kfp32.fp32_linear(x2.contiguous(), weight, invariant=True)
    return y.view(*shape[:-1], y.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, act_block: int = 0,
           fp32: bool = False) -> torch.Tensor:
    """`Linear.forward`, `kernels.gemm.linear_ref` signature and result up to the fp32 summation order: x [..., in]
    bf16, the weight as held -> [..., out] (fp32 when `fp32`, else bf16). FP8 weights with 128-multiple widths:
    `fp8_linear(invariant=True)`; other weights (bf16 weights_proj, narrow FP8): act quant (if act_block) and the
    exact dequantized weight through `fp32_linear(invariant=True)` (fp32 products and sum, as `linear_ref`),
    rounded once to bf16. act_block as `kernels.gemm.linear` (every int >= 0 honoured: 128 on a 128-multiple
    width runs the FP8 kernels, any other block `numerics.act_quant_sim`). Raises ValueError for fp32
    activations (the exact mode runs cuBLAS), fp32 not a bool, act_block not an int >= 0 (a bool included)."""
    kgemm.check_linear_flags("invariant.linear", act_block, fp32)
    if fp32:
        return fp32_linear(x, weight)
    if x.dtype != torch.bfloat16:
        _refuse("activations not bf16", f"x dtype {x.dtype}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    k = shape[-1]
    if weight.dtype == torch.float8_e4m3fn and act_block == _BLOCK and k % _BLOCK == 0:
        y = kgemm.fp8_linear(x2, weight, scale, invariant=True)
    else:
        if act_block == _BLOCK and k % _BLOCK == 0:
            x2 = kgemm.act_quant(x2, sim=True)[0]
        elif act_block:  # the row width below 128 (or any other block): the reference's quantizer
            x2 = numerics.act_quant_sim(x2, act_block)
        w = dequantize_ref(weight, scale, torch.bfloat16).contiguous()  # exact
        y = kfp32.fp32_linear(x2, w, invariant=True).to(torch.bfloat16)
    return y.view(*shape[:-1], y.shape[-1])


def grouped_linear(o: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The grouped wo_a, `kernels.gemm.grouped_linear_ref` signature: o [b, s, G, i] bf16, wo_a as held [G*n, i]
    -> [b, s, G, n] bf16. FP8 with i, n multiples of 128: `fp8_grouped_gemv(invariant=True)` (any b*s); else
    per group the exact bf16 weight through `fp32_linear(invariant=True)`, rounded once (fp32 products and sum,
    no activation quantization: `grouped_linear_ref`). Raises ValueError for fp32 activations and, naming the
    argument, o not a float [b, s, G, i] tensor or a weight whose dequantized shape is not [G*n, i]
    (`kernels.gemm.check_grouped_linear_args`)."""
    b, s, G, i, n = kgemm.check_grouped_linear_args("invariant.grouped_linear", o, weight)
    if o.dtype != torch.bfloat16:
        _refuse("activations not bf16", f"o dtype {o.dtype}")
    if weight.dtype == torch.float8_e4m3fn and i % _BLOCK == 0 and n % _BLOCK == 0:
        y = kgemm.fp8_grouped_gemv(o.reshape(b * s, G * i).contiguous(), weight, scale, G, invariant=True)
        return y.view(b, s, G, n)
    w = dequantize_ref(weight, scale, torch.bfloat16).view(G, n, i)
    o2 = o.reshape(b * s, G, i)
    parts = [kfp32.fp32_linear(o2[:, g].contiguous(), w[g].contiguous(), invariant=True) for g in range(G)]
    return torch.stack(parts, 1).to(torch.bfloat16).view(b, s, G, n)


def moe_routed(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts, limit: float,
               act_blocks: tuple[int, int]) -> torch.Tensor:
    """Routed experts, `kernels.moe.moe_routed_ref` signature: x [N, dim] bf16, weights / ids [N, k], the layer's
    experts stacked (`kernels.moe.StackedExperts`: the model stacks every MoE in this mode and refuses one the
    grouped kernel cannot take, `dsv4.model.Transformer`) -> [N, dim] fp32 via
    `kernels.moe.moe_experts(invariant=True)` (the gemv path at every N, slots summed left to right). Raises
    ValueError for non-bf16 x, experts not stacked (the per-expert loop runs one cuBLAS GEMM per expert on however
    many tokens chose it: not batch invariant) or act_blocks other than (128, 128)."""
    if x.dtype != torch.bfloat16:
        _refuse("activations not bf16", f"x dtype {x.dtype}")
    if not isinstance(experts, kmoe.StackedExperts):
        _refuse("routed experts not stacked for the grouped FP4 kernel",
                "FP4 experts, widths multiples of 128, every expert on this rank")
    if tuple(act_blocks) != (128, 128):
        _refuse("act_blocks other than (128, 128)", repr(act_blocks))
    return kmoe.moe_experts(x.contiguous(), weights.contiguous(), ids.contiguous(), experts, limit, invariant=True)


def _tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` (kept, size 1) by a pairwise tree of elementwise adds, zero-padded to a power of two: the same
    order for every other size (torch's reduction kernels pick their split from the tensor's sizes)."""
    n = x.shape[dim]
    p = 1 << max(0, (n - 1).bit_length())
    if p != n:
        pad = list(x.shape)
        pad[dim] = p - n
        x = torch.cat((x, x.new_zeros(pad)), dim)
    while x.shape[dim] > 1:
        h = x.shape[dim] // 2
        x = x.narrow(dim, 0, h) + x.narrow(dim, h, h)
    return x


def pool_windows(Z: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """The compressor's prefill pooling (`dsv4.model.Compressor.extend`, spec §6.2: `(Z.softmax(2) * A).sum(2)`)
    in a fixed order: Z scores / A rows [b, n, w, d] fp32 (w rows per window) -> [b, n, d] fp32, the softmax's max
    exact, its denominator and the weighted sum by `_tree_sum` (elementwise adds: every window is summed in the
    same order whatever n, so a prompt prefilled in chunks pools each window as the whole prompt's call does). A
    window whose scores are all -inf gives NaN, as torch's softmax."""
    m = Z.amax(2, keepdim=True)
    e = torch.exp(Z - m)
    w = e / _tree_sum(e, 2)
    return _tree_sum(w * A, 2).squeeze(2)


# ------------------------------------------------------------------------- per-row kernels of the decode path
try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional (the backend that uses these entries requires it)
    triton = None
    tl = None

if triton is not None:
    from kernels.fp32_linear import dot_x3
    from kernels.jit_formats import round_bf16
    from kernels.launch import interpreting

    @triton.jit(do_not_specialize=["R"])  # the row count is a loop bound / mask only: one build per width
    def _hadamard_kernel(x_ptr, y_ptr, R, N: tl.constexpr, BR: tl.constexpr, MMA: tl.constexpr):
        """Rows [BR, N] fp32 per program times the +-1 Sylvester matrix S_ij = (-1)^popcount(i & j) (built in
        registers), then times N^-0.5 (`hadamard`): `kernels.fp32_linear.dot_x3` (x split exactly into three bf16
        pieces, three bf16 tensor-core dots against S, every product exact; fp32 "ieee" dots under the
        interpreter). (An fp32 "ieee" dot on the GPU holds S per thread: 73 us per call, measured.)"""
        r0 = tl.program_id(0).to(tl.int64) * BR
        rows = r0 + tl.arange(0, BR)
        cols = tl.arange(0, N)
        mask = (rows < R)[:, None]
        x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
        b = cols[:, None] & cols[None, :]
        par = b ^ (b >> 1)
        par = par ^ (par >> 2)
        par = par ^ (par >> 4)
        par = par ^ (par >> 8)
        sgn = tl.where((par & 1) == 1, -1.0, 1.0)  # S[k, j] (symmetric)
        y = dot_x3(x, sgn.to(tl.bfloat16), sgn, MMA) * (1.0 / tl.sqrt(N * 1.0))
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], y, mask=mask)


_HADAMARD_BR = 16


def head_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The mode's q head-RMS: `kernels.norm.head_rms` (one program per row, the sum of squares in one order for
    every row count; the default mode runs the same kernel), refusing what the mode does not cover.
    Raises ValueError for x not bf16, and as `kernels.norm.head_rms`."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() < 1:
        _refuse("head_rms of a non-bf16 q", f"{getattr(x, 'dtype', type(x))}")
    return knorm.head_rms(x, eps)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """`x @ hadamard_matrix(n).T` for fp32 x [..., n], n a power of two in 16..256 (the +-1 matrix is held in
    registers; V4's indexer rotates 128): rows of 16 per program, an fp32
    dot with the +-1 Sylvester matrix (each product exact, summed in the dot's fixed K order, the same for every
    row count: a cuBLAS fp32 GEMM picks its algorithm by the row count), then times n^-0.5. The same exact value
    as the matrix product, another fp32 rounding order (the official fast_hadamard_transform is a butterfly); on
    the GPU the products are summed by bf16x3 tensor-core dots (exact products, the MMA's own accumulation).
    Raises ValueError for x not fp32 or n not a power of two in 16..256."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() < 1:
        raise ValueError(f"hadamard: x {getattr(x, 'dtype', type(x))}; expected a float32 tensor [..., n]")
    n = x.shape[-1]
    if n & (n - 1) or not 16 <= n <= 256:
        raise ValueError(f"hadamard: width {n}; expected a power of two in 16..256")
    x = x.contiguous()
    y = torch.empty_like(x)
    rows = x.numel() // n
    if rows:
        _hadamard_kernel[(triton.cdiv(rows, _HADAMARD_BR),)](x, y, rows, N=n, BR=_HADAMARD_BR,
                                                             MMA=0 if interpreting() else 1, num_warps=4)
    return y
