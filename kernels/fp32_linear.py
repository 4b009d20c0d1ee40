"""fp32-compute linear on a bf16-held weight: `y [M, N] fp32 = x [M, K] . W [N, K]^T`, x fp32 (or bf16), W bf16.

Spec: `dsv4_reference_spec.md` §2 / §6 / §8 / §9: `head.weight`, the router `ffn.gate.weight` and the compressors'
`wkv` / `wgate` are BF16 on disk and computed in fp32 officially (the parameter held in fp32; an fp32 matmul).
bf16 -> fp32 is exact, so with the weight kept bf16 as on disk (`Transformer(weights="quantized")`) the official
product is `x_f32 @ W.float().T` exactly: that is `fp32_linear_ref`, and this kernel computes the same sum of
fp32 products reading half the weight bytes (the decode head GEMV is bandwidth bound: 2.1 GB fp32 for Flash).

Paths (chosen by M, never by a failure):
  * M <= ROWS_MAX (1): `_bf16w_gemv_kernel` with DOT=False, CUDA cores: each program holds a [BN, BK] weight
    tile upcast to fp32 in registers and, for each of its BM rows, sums the fp32 products `x[m, k] * w[n, k]`
    over the tile (`tl.sum`), accumulating in fp32; at M = 1 the products accumulate elementwise in a [BN, BK]
    fp32 tile instead and are summed once at the end (ACC2D). Each weight byte is read once.
  * ROWS_MAX < M <= GEMV_MAX_M (64): the same kernel with DOT=True, on the tensor cores with x split exactly into
    three bf16 pieces ("bf16x3") by bit truncation: hi = x with its low 16 bits cleared, mid = (x - hi) likewise,
    lo = x - hi - mid; hi + mid + lo == x bit for bit for every finite x, subnormals and values near the fp32
    maximum included (x has a 24-bit significand, each piece holds 8 of it; truncation never rounds up, so no
    piece overflows, and the casts to bf16 are exact on the GPU and under the interpreter alike). Every product piece * w is exact in fp32 (8 + 8 significant bits), so three
    bf16 MMAs per K tile (lo, mid, hi, from a zero accumulator; the tile's sum is added to the running fp32 sum
    in registers: the tensor core's in-MMA additions are not round-to-nearest fp32, `kernels.mhc._dot_bf16x3`)
    give the fp32 dot of the exact products. A non-finite x goes whole into hi (mid = lo = 0), so NaN / inf
    reach y as in the reference. The weight is assumed finite (the loaders refuse a non-finite weight: an inf
    weight would meet the zero mid / lo pieces and give NaN where the reference gives inf). The first version of this path, `tl.dot(..., input_precision="ieee")` (fp32
    FMA on CUDA cores), ran the Flash head at M = 32 in 5.4 ms, 4x slower than cuBLAS fp32 on the fp32 weight
    (benchmarks/RESULTS.md); under the interpreter (whose bf16 dots are not faithful in triton 3.9) the three
    pieces are multiplied in fp32 "ieee" dots - the same exact values.
  * M > GEMV_MAX_M (prefill of the router / compressor at T tokens; the head runs on the last position only):
    x bf16 on CUDA (the official numerics: the block's normed activations): cuBLAS's bf16 GEMM with an fp32
    output (`torch.mm(..., out_dtype=torch.float32)`, torch >= 2.8): every product of two bf16 values is exact in
    fp32 and the tensor cores accumulate them in fp32 (their in-MMA additions are not round-to-nearest, unlike
    the bf16x3 path's register sums; the error stays within the tests' bound below, measured 1.2-1.6e-3 of it) -
    the official fp32 GEMM's products in another summation, without the fp32 copies of x and W (issue 27: the
    fp32 SIMT GEMMs were 1.4 of 19.1 ms of a 4096-token Flash prefill layer, `benchmarks/layer_profile.py`;
    `benchmarks/latency_probe.py --section fp32lin` times both). Otherwise
    (x fp32, or the CPU, which has no such op): upcast both and `torch.mm` in fp32 (cuBLAS on CUDA, what the
    dequantized model runs; [M, K] and [N, K] fp32 temporaries).
Small N (the router: N = 256, K = 4096) is split over K (about two programs per SM); the last program of an N
block (an acq_rel semaphore from `kernels.launch.workspace`) sums the fp32 partials in split order and writes y
(deterministic). Nothing is read back to the host (CUDA-graph capturable). A NaN / inf in x reaches y as in the
reference (no max / min / clamp on the path).

Batch-invariant mode (`invariant=True`, README "Batch-invariant mode"): every M runs the DOT=True (bf16x3) path
on row tiles of INVARIANT_BM = 16 rows up to GEMV_MAX_M rows (a decode step), INVARIANT_PREFILL_BM = 64 above (a
prefill; the tile fixed for every M on each side), cdiv(M, BM) tiles in one launch, up to INVARIANT_LAUNCH_ROWS
rows per launch (no torch.mm), the blocks `invariant_blocks(N)` and the split of `kernels.launch.split_k` for the
grid without its row tiles (a function of N, K and the device only): a row's y is then bitwise independent of M and
of the other rows (the same tile, instruction and K order for every M on each side of GEMV_MAX_M; rows never mix in
a dot). The default picks CUDA-core rows at M = 1 and bf16x3
dots above (another summation order), a BM that follows M, and torch.mm (cuBLAS) above 64 rows.

Differences from `fp32_linear_ref`: only the order of the fp32 sum (per output element |y - y_ref| <=
2 * K * 2^-24 * sum_k |x_k w_k|, the textbook bound of two fp32 summations of K products; tests use it).

Reading order (STYLE §1): the reference, the kernel, the launcher, the triton backend's entry (`fp32_linear_op`:
any leading dims, an fp32 weight to the reference).

Dimension legend: M rows (tokens), K = in_features, N = out_features.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the references stay importable without it; launching raises
    triton = None
    tl = None

from kernels.launch import GEMM_MIN_ROWS, bucketed_gemm, check_layout, interpreting, split_k, workspace
from kernels.launch import fail as _fail

__all__ = ["fp32_linear", "fp32_linear_ref", "fp32_linear_op", "ROWS_MAX", "GEMV_MAX_M", "DEFAULT_BLOCKS"]

ROWS_MAX = 1          # CUDA-core rows up to this many rows, bf16x3 tensor-core dots above
GEMV_MAX_M = 64       # the kernel up to this many rows; torch.mm above (bf16 GEMM, fp32 out, for bf16 x on CUDA)
INVARIANT_BM = 16     # the batch-invariant mode's row tile (kernels.gemm.INVARIANT_BM: an mma.sync tile on sm_90)
INVARIANT_PREFILL_BM = 64  # its row tile above GEMV_MAX_M rows (a prefill: wgmma-sized, fixed for every M > 64)
INVARIANT_LAUNCH_ROWS = 1024  # rows per launch in the batch-invariant mode (bounds the split-K scratch)
DEFAULT_BLOCKS = {False: (16, 256), True: (128, 64)}  # DOT -> (BN, BK); benchmarks/bench_gemm.py --sections head


def invariant_blocks(N: int) -> tuple[int, int]:
    """(BN, BK) of the batch-invariant launch for an [N, K] weight: (64, 64) up to N = 4096 (compressor wkv /
    wgate, router), (128, 64) above (the head). A function of the weight shape only. One H200, 4 warps, M = 1 / 8 /
    32, µs (benchmarks/RESULTS.md, fifth session): CSA wkv/wgate [1024, 4096] 9.1 / 9.6 / 13.1 for (64, 64) against
    9.9 / 15.7 / 20.8 for (128, 64); router [256, 4096] 7.1 / 7.4 / 8.4 against 7.7 / 13.3 / 14.2; head [129280,
    4096] 271 / 296 / 518 for (128, 64), the fastest of eight blocks (the default mode: 238 / 291 / 469)."""
    return (64, 64) if N <= 4096 else (128, 64)


def fp32_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The official fp32 linear (spec §2, §9): x [..., K] any float dtype, weight [N, K] bf16 or fp32 ->
    `x.float() @ weight.float().T` [..., N] fp32 (the bf16 weight upcast exactly, an [N, K] fp32 temporary).
    Raises ValueError naming the argument: x not a float tensor [..., K], weight not a bf16 / fp32 [N, K] on x's
    device."""
    op = "fp32_linear_ref"
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype not in (torch.bfloat16,
                                                                                          torch.float32):
        _fail(op, "weight", f"{getattr(weight, 'dtype', type(weight))} shape {tuple(getattr(weight, 'shape', ()))}",
              "a bf16 / float32 tensor [N, K]")
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() < 1 or \
            x.shape[-1] != weight.shape[1] or x.device != weight.device:
        _fail(op, "x", f"{getattr(x, 'dtype', type(x))} shape {tuple(getattr(x, 'shape', ()))} on "
              f"{getattr(x, 'device', '?')}", f"a float tensor [..., {weight.shape[1]}] on {weight.device}")
    return x.float() @ weight.float().T


if triton is not None:  # the kernels exist only where triton is installed (it is optional)
    from kernels.launch import split_k_total

    @triton.jit
    def _bf16_trunc(x):
        """fp32 x with its low 16 bits cleared: a value bf16 holds exactly (x truncated toward 0 to 8 significant
        bits; subnormals included), so the cast to bf16 is exact however it rounds, and x - trunc(x) is exact."""
        return (x.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)


    @triton.jit
    def dot_x3(x, wb, wf, MMA: tl.constexpr):
        """The fp32 dot `x @ w` of the exact products, from zero: x [M, K] fp32 split exactly into three bf16
        pieces (hi + mid + lo == x, module docstring; a non-finite x all in hi), w [K, N] bf16-exact given as wb
        (bf16) and wf (the same values in fp32). MMA 1: three bf16 tensor-core dots (lo, mid, hi); MMA 0 (the
        interpreter, whose bf16 casts are not faithful): fp32 "ieee" dots on the same values. Callers add the
        result to their running fp32 sum in registers (the tensor core's in-MMA adds are not round-to-nearest).
        Used by `_bf16w_gemv_kernel` and `kernels.invariant`'s Hadamard."""
        fin = tl.abs(x) < float("inf")
        hi32 = tl.where(fin, _bf16_trunc(x), x)  # NaN / inf: all in hi (the mask would make a NaN inf)
        r = tl.where(fin, x - hi32, 0.0)
        mid32 = _bf16_trunc(r)
        lo32 = r - mid32  # <= 8 significant bits: bf16-exact
        if MMA == 1:
            t = tl.dot(lo32.to(tl.bfloat16), wb)
            t = tl.dot(mid32.to(tl.bfloat16), wb, t)
            t = tl.dot(hi32.to(tl.bfloat16), wb, t)
        else:
            t = tl.dot(lo32, wf, input_precision="ieee")
            t += tl.dot(mid32, wf, input_precision="ieee")
            t += tl.dot(hi32, wf, input_precision="ieee")
        return t


    @triton.jit
    def _bf16w_gemv_kernel(x_ptr, w_ptr, y_ptr, part_ptr, sem_ptr, M, N, K, K_PER_SPLIT, SPLIT, MCH,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
                           EVEN_K: tl.constexpr, ACC2D: tl.constexpr, MMA: tl.constexpr):
        """Grid (cdiv(N, BN) * MCH, SPLIT): y[:, n block] = x[:, K split] . W[n block, K split]^T in fp32, x [M, K]
        fp32 or bf16 (upcast exactly), W [N, K] bf16 (upcast exactly), y [M, N] fp32. DOT=False: per row m < BM, fp32
        products summed over each BK tile (CUDA cores); DOT=True: x split into three bf16 pieces, three dots per K
        tile (module docstring), MMA 1 bf16 tensor cores, MMA 0 fp32 "ieee" dots on the same pieces (interpreter).
        EVEN_K: K_PER_SPLIT and K are multiples of BK (no K mask: full-width vector loads). ACC2D (BM == 1 only): the
        products accumulate elementwise in a [BN, BK] fp32 tile, summed over BK once at the end (no cross-lane
        reduction per K tile); otherwise each tile's products are summed at once. SPLIT > 1: partials
        [SPLIT, M, N] in part_ptr; the last program of an N block (acq_rel semaphore) sums them in split order,
        writes y and resets its semaphore to 0. MCH: row tiles of BM rows (program 0-axis id = N block * MCH +
        tile; the tiles of one weight block run side by side): the batch-invariant mode's fixed BM over any M;
        the default runs MCH = 1 (BM covers M)."""
        pid0 = tl.program_id(0)
        pid_n = pid0 // MCH
        m0 = (pid0 % MCH) * BM
        pid_s = tl.program_id(1)
        offs_m = m0 + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        mask_m = offs_m < M
        mask_n = offs_n < N
        rows64 = offs_n.to(tl.int64)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc2 = tl.zeros((BN, BK), dtype=tl.float32)
        k0 = pid_s * K_PER_SPLIT
        k1 = tl.minimum(k0 + K_PER_SPLIT, K)
        for k in range(k0, k1, BK):
            kk = k + offs_k
            if EVEN_K:  # no K mask: full-width vector loads
                wmask = mask_n[:, None]
                xmask = mask_m[:, None]
            else:
                wmask = mask_n[:, None] & (kk < k1)[None, :]
                xmask = mask_m[:, None] & (kk < k1)[None, :]
            w = tl.load(w_ptr + rows64[:, None] * K + kk[None, :], mask=wmask, other=0.0)
            wb = w.to(tl.bfloat16)
            w = w.to(tl.float32)
            if DOT:
                x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * K + kk[None, :], mask=xmask,
                            other=0.0).to(tl.float32)
                acc += dot_x3(x, tl.trans(wb), tl.trans(w), MMA)
            elif ACC2D:
                if EVEN_K:
                    x0 = tl.load(x_ptr + m0 * K + kk)
                else:
                    x0 = tl.load(x_ptr + m0 * K + kk, mask=kk < k1, other=0.0)
                acc2 += w * x0.to(tl.float32)[None, :]
            else:
                for m in tl.static_range(BM):
                    if EVEN_K:
                        xm = tl.load(x_ptr + (m0 + m) * K + kk, mask=(offs_k * 0 + m0 + m) < M, other=0.0)
                    else:
                        xm = tl.load(x_ptr + (m0 + m) * K + kk, mask=(kk < k1) & ((offs_k * 0 + m0 + m) < M),
                                     other=0.0)
                    part = tl.sum(w * xm.to(tl.float32)[None, :], axis=1)  # [BN] fp32
                    acc += tl.where(offs_m[:, None] == m0 + m, part[None, :], 0.0)
        if ACC2D:
            acc = tl.sum(acc2, axis=1)[None, :]
        out_mask = mask_m[:, None] & mask_n[None, :]
        yoffs = offs_m[:, None].to(tl.int64) * N + rows64[None, :]
        if SPLIT == 1:
            tl.store(y_ptr + yoffs, acc, mask=out_mask)
        else:
            tot, last = split_k_total(acc, part_ptr, sem_ptr + pid0, offs_m[:, None] * N + offs_n[None, :], M * N,
                                      pid_s, SPLIT, out_mask)
            if last:
                tl.store(y_ptr + yoffs, tot, mask=out_mask)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None,
                block: tuple[int, int] | None = None, num_warps: int = 4, acc2d: bool | None = None,
                invariant: bool = False) -> torch.Tensor:
    """`fp32_linear_ref` with the weight read as bf16 (module docstring): x [M, K] fp32 or bf16, weight [N, K]
    bf16 -> y [M, N] fp32.

    Args:
        out: optional [M, N] fp32 output (written completely).
        block: (BN, BK) of the kernel (powers of two, BK >= 16; default `DEFAULT_BLOCKS`; for benchmarks).
        num_warps: warps per program (for benchmarks).
        acc2d: M == 1 only: accumulate elementwise over K, reduce once (default True; False for benchmarks).
        invariant: the batch-invariant launch (module docstring), any M; block / acc2d / num_warps must be the
            defaults.
    Returns: [M, N] fp32. M > GEMV_MAX_M: `torch.mm` (module docstring: the bf16 GEMM with an fp32 output for bf16
    x on CUDA, else on fp32 upcasts) unless invariant.
    Never synchronises with the device (CUDA-graph capturable).
    Raises: ValueError naming the argument (not 2-D, dtype, K mismatch, layout, device, a bad block or
    num_warps, a block / acc2d / num_warps given where M > GEMV_MAX_M runs torch.mm or with invariant=True).
    """
    op = "fp32_linear"
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            _fail(op, name, f"shape {tuple(getattr(t, 'shape', ()))}", "a 2-D torch.Tensor")
    if x.dtype not in (torch.float32, torch.bfloat16):
        _fail(op, "x", f"dtype {x.dtype}", "torch.float32 or torch.bfloat16 (upcast exactly)")
    if weight.dtype != torch.bfloat16:
        _fail(op, "weight", f"dtype {weight.dtype}", "torch.bfloat16 (the on-disk BF16 weight; fp32 weights: "
              "fp32_linear_ref)")
    (M, K), (N, K2) = x.shape, weight.shape
    if K != K2:
        _fail(op, "weight", f"shape {(N, K2)}", f"[N, {K}] (in_features of x)")
    if out is None:
        out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    elif not isinstance(out, torch.Tensor) or tuple(out.shape) != (M, N) or out.dtype != torch.float32:
        _fail(op, "out", f"{getattr(out, 'dtype', type(out))} {tuple(getattr(out, 'shape', ()))}", f"fp32 {(M, N)}")
    check_layout(op, {"x": x, "weight": weight, "out": out})
    if not isinstance(num_warps, int) or isinstance(num_warps, bool) or num_warps not in (1, 2, 4, 8, 16):
        _fail(op, "num_warps", repr(num_warps), "1, 2, 4, 8 or 16")
    if M > GEMV_MAX_M and (block is not None or acc2d is not None or num_warps != 4):
        _fail(op, "block / acc2d / num_warps", repr((block, acc2d, num_warps)),
              f"the defaults for M = {M} > GEMV_MAX_M = {GEMV_MAX_M} (that path is torch.mm: no kernel to tune)")
    if invariant and (block is not None or acc2d is not None or num_warps != 4):
        _fail(op, "block / acc2d / num_warps", repr((block, acc2d, num_warps)),
              "the defaults with invariant=True (the mode fixes the launch)")
    if M == 0 or N == 0 or K == 0:
        return out.zero_()  # an empty sum is 0, as in the reference
    if invariant:
        bm = INVARIANT_BM if M <= GEMV_MAX_M else INVARIANT_PREFILL_BM  # by the whole call's M
        for r0 in range(0, M, INVARIANT_LAUNCH_ROWS):  # bounds the split-K scratch; rows are independent
            r1 = min(M, r0 + INVARIANT_LAUNCH_ROWS)
            _gemv(x[r0:r1], weight, out[r0:r1], r1 - r0, N, K, True, invariant_blocks(N), bm, False, 4)
        return out
    if M > GEMV_MAX_M:
        if x.dtype == torch.bfloat16 and x.is_cuda:  # exact bf16 products, accumulated in fp32 (tensor cores)
            return torch.mm(x.detach(), weight.detach().T, out_dtype=torch.float32, out=out)
        return torch.mm(x.detach().float(), weight.detach().float().T, out=out)  # no autograd (as the kernel)
    dot = M > ROWS_MAX
    BN, BK = DEFAULT_BLOCKS[dot] if block is None else block
    if not all(isinstance(v, int) and v >= 1 and v & (v - 1) == 0 for v in (BN, BK)) or BK < 16 or (dot and BN < 16):
        _fail(op, "block", repr(block), "(BN, BK) powers of two, BK >= 16 (and BN >= 16 for M > ROWS_MAX)")
    BM = triton.next_power_of_2(M) if not dot else max(16, triton.next_power_of_2(M))
    if acc2d is None:
        acc2d = BM == 1
    elif acc2d and BM != 1:
        _fail(op, "acc2d", repr(acc2d), f"False or None for M = {M} (the [BN, BK] accumulator is for M == 1)")
    _gemv(x, weight, out, M, N, K, dot, (BN, BK), BM, acc2d, num_warps)
    return out


def _gemv(x, weight, out, M: int, N: int, K: int, dot: bool, block: tuple[int, int], BM: int, acc2d: bool,
          num_warps: int) -> None:
    """One `_bf16w_gemv_kernel` launch writing out [M, N] in cdiv(M, BM) row tiles (one unless BM < M: the
    batch-invariant mode): split-K of `split_k` for the (N, K, block) grid without its row tiles."""
    BN, BK = block
    n_blocks = triton.cdiv(N, BN)
    chunks = triton.cdiv(M, BM)
    split, per = split_k(x.device, n_blocks, triton.cdiv(K, BK))
    k_per = per * BK
    sem, part = workspace(x.device, n_blocks * chunks if split > 1 else 1, split * M * N if split > 1 else 1)
    _bf16w_gemv_kernel[(n_blocks * chunks, split)](x, weight, out, part, sem, M, N, K, k_per, split, chunks,
                                          BM=BM, BN=BN, BK=BK, DOT=dot, EVEN_K=K % BK == 0, ACC2D=acc2d,
                                          MMA=0 if interpreting() else 1, num_warps=num_warps)
    return out


def fp32_linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The triton backend's `fp32_linear` entry (the router `Gate`; `kernels.gemm.linear(fp32=True)` for head and
    compressor wkv / wgate), the signature of `fp32_linear_ref`: x [..., K] any float dtype, weight [N, K] ->
    [..., N] fp32 (spec §2, §8, §9). A bf16 weight (held as on disk, weights="quantized") goes to `fp32_linear`
    (the GEMV kernel up to GEMV_MAX_M rows, torch.mm above: module docstring); an fp32 weight (the dequantized
    model) to `fp32_linear_ref`. x in fp32 / bf16 is read as it is (upcast exactly in the kernel), other dtypes
    upcast first. Above 64 rows torch.mm runs at the bucketed row count of `kernels.launch.bucketed_gemm`
    (issue 29). Raises ValueError from `fp32_linear`'s argument checks."""
    if weight.dtype != torch.bfloat16:
        return fp32_linear_ref(x, weight)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.dtype not in (torch.float32, torch.bfloat16):
        x2 = x2.float()
    x2 = x2.contiguous()
    if x2.shape[0] < GEMM_MIN_ROWS:  # the GEMV kernel (no cuBLAS, nothing to bucket)
        y = fp32_linear(x2, weight)
    else:
        y = bucketed_gemm(lambda xp: fp32_linear(xp, weight), x2, ("fp32_linear", tuple(weight.shape), x2.dtype))
    return y.view(*shape[:-1], y.shape[-1])
