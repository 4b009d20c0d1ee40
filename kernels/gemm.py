"""FP8 block-scaled linear (W8A8): `y = act_quant(x) @ fp8_block_dequant(W)^T`, fp32 accumulation, bf16 out.

Spec: `dsv4_reference_spec.md` §2 ("Weight dequantization", "Activation quantization before every FP8/FP4 GEMM"):
the official `act_quant(x, 128, "ue8m0")` quantizes every 128-channel block of a token to e4m3 with the
power-of-two scale `2^ceil(log2(max(amax, 1e-4) / 448))`, and `fp8_gemm` sums `(xq_kb . Wq_kb) * s_x[kb] *
s_w[n/128, kb]` over the 128-wide K blocks in fp32. The act-quantized input and the dequantized weight are both
exact in bf16, so the result equals a GEMM with fp32 accumulation on the two dequantized operands up to summation
order: that is `fp8_linear_ref` (what `dsv4.model.Linear` computes in bf16 mode with FP8 weights).

Reading order (STYLE §1): the references, the shared in-kernel quantization helpers, the kernels, the launchers.
The references include the model's: `linear_ref` (every `dsv4.model.Linear`, any resident format) and
`grouped_linear_ref` (the grouped `wo_a`), the reference backend's `linear` / `grouped_linear` entries; the triton
backend's entries `linear` / `grouped_linear` (last in this module; which path runs when: the table in
dsv4/backend.py) run `fp8_linear` / `fp8_grouped_gemv` / `fp8_dequant` where they apply.

Paths of `fp8_linear` (chosen by M, never by a silent fallback):
  * decode, M < DECODE_TILES_MIN_M (any M <= GEMV_MAX_M with an explicit `gemv=`): `_fp8_gemv_kernel`, ONE
    launch. Each program quantizes its rows of x per 128-block in
    registers (exactly `act_quant`: integer exponent maths and round-to-nearest-even onto the e4m3 grid, so the
    interpreter and every GPU give the same codes), reads the FP8 codes and their ue8m0 scales directly and
    accumulates in fp32. Small N is split over K; the last split of an N block (semaphore from
    `kernels.launch.workspace`) sums the partials in a fixed order and writes bf16 (deterministic).
    The launch is a `GemvConfig` (tensor-core dot or CUDA-core rows, K blocks per iteration, columns per program,
    programs per SM, warps, stages, x quantized once or per program), default `gemv_config`; every variant
    multiplies the same exact values, a variant differs from another at most in the fp32 summation order
    (`benchmarks/bench_gemm.py --sections gemv_sweep` times them and checks each output).
    One row (M = 1, batch-1 decode): `_fp8_gemv_rows_kernel` instead, a `RowsConfig` - a few weight rows x all of
    K per program, no split-K and no merge (the merge's latency made the split launch 1.6-2.5x slower at Flash's
    shapes: benchmarks/gemv_probe.py, RESULTS.md session of 2026-12-04 (2)); the same exact products.
    DECODE_TILES_MIN_M rows and more (9 <= M <= GEMV_MAX_M, batch 16 / 32 / 64 decode): no GEMV but `act_quant` +
    `_fp8_gemm_kernel` on DECODE_TILE (64-row tiles: Hopper's wgmma; each weight tile read once, no split-K) -
    measured 1.2-7x faster than the GEMV at M = 32 and 64 at every Flash shape (`benchmarks/decode_knobs_probe.py
    --section fp8`, RESULTS.md, fifth session of 2026-12-06); at M = 8 the GEMV stays (faster on 2 of the 6 shapes,
    the same sum over a layer's linears: 88 vs 89 µs). An explicit `gemv=` keeps the GEMV at any M.
  * prefill, M > GEMV_MAX_M: `prefill=` one of
      "dequant"   `act_quant` kernel (bf16 quantize->dequantize) + `_fp8_dequant_kernel` (W -> bf16) + cuBLAS bf16
                  `torch.mm` (fp32 accumulation, bf16 out);
      "scaled_mm" `act_quant` kernel (e4m3 codes + fp32 scales) + `torch.nn.functional.scaled_mm` with
                  BlockWise1x128 (x) x BlockWise128x128 (W) scales (CUTLASS; measured on sm_90 with torch 2.11;
                  M and K/128 multiples of 4);
      "triton"    `act_quant` kernel + `_fp8_gemm_kernel` (tl.dot on e4m3 tiles, scales applied per K block).
    `prefill_method` is the default, chosen by measurement on one H200 (benchmarks/RESULTS.md, "GEMM / MoE kernels
    (issue 13)"): scaled_mm where N >= 4096 and K >= 3072 on sm_90 (wo_b M=4096: 295 µs vs 368 µs
    dequant+cuBLAS, 426 µs triton), dequant+cuBLAS elsewhere (wq_a M=1024: 26 µs vs 36 µs scaled_mm; scaled_mm's
    CUTLASS tiles lose on narrow N or short K). The Triton FP8 GEMM is kept as a measured alternative: it won
    only one of ten shapes (shared w1 at M=1024, 33 vs 37 µs).

Dimension legend: M tokens, K = in_features (multiple of 128), N = out_features.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the references stay importable without it; launching raises
    triton = None
    tl = None

from kernels import numerics
from kernels.fp32_linear import fp32_linear_op, fp32_linear_ref
from kernels.launch import GEMM_MIN_ROWS, bucketed_gemm, check_layout, interpreting, split_k, workspace
from kernels.launch import fail as _fail

BLOCK = 128            # FP8 weight block and activation block (spec §2)
GEMV_MAX_M = 64        # decode path up to this many rows
DECODE_TILES_MIN_M = 9  # from this many rows the decode path runs the 64-row tiles, not the GEMV (module docstring)
DECODE_TILE = dict(BM=64, BN=64, GROUP_M=8, num_warps=4, num_stages=4)  # their launch (the probe's 64 x 64 column)
PREFILL_TILE = dict(BM=128, BN=128, GROUP_M=8, num_warps=8, num_stages=3)  # prefill="triton" (and the invariant mode)
PREFILL_METHODS = ("dequant", "scaled_mm", "triton")
MMA_DEFAULT = "fp8"    # dot flavour of the Triton kernels on the GPU (`mma_mode`)


# ---------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------

def check_fp8_linear_args(op: str, x, weight, scale) -> tuple[int, int, int]:
    """Shapes/dtypes of (x [M, K] bf16, weight [N, K] float8_e4m3fn, scale [ceil(N/128), K/128] float8_e8m0fnu).
    Returns (M, N, K). Raises ValueError naming the argument, its value and what was expected (scale None: the
    FP8 codes' missing scales)."""
    if scale is None:
        _fail(op, "scale", "None", "the float8_e8m0fnu block scales of the float8_e4m3fn weight (FP8 codes need "
              "their scales)")
    for name, t in (("x", x), ("weight", weight), ("scale", scale)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            _fail(op, name, f"shape {tuple(getattr(t, 'shape', ()))}", "a 2-D torch.Tensor")
    if x.dtype != torch.bfloat16:
        _fail(op, "x", f"dtype {x.dtype}", "torch.bfloat16 (the official FP8 path takes bf16 activations)")
    if weight.dtype != torch.float8_e4m3fn:
        _fail(op, "weight", f"dtype {weight.dtype}", "torch.float8_e4m3fn (FP8 codes as on disk)")
    if scale.dtype != torch.float8_e8m0fnu:
        _fail(op, "scale", f"dtype {scale.dtype}", "torch.float8_e8m0fnu (ue8m0 block scales as on disk)")
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        _fail(op, "weight", f"shape {tuple(weight.shape)}", f"[N, {K}] (K of x)")
    if K % BLOCK or K == 0:
        _fail(op, "in_features", K, f"a positive multiple of {BLOCK} (act_quant blocks)")
    want = (-(-N // BLOCK), K // BLOCK)
    if tuple(scale.shape) != want:
        _fail(op, "scale", f"shape {tuple(scale.shape)}", f"{want} (one per 128x128 block of weight {(N, K)})")
    return M, N, K


def check_linear_flags(op: str, act_block, fp32) -> None:
    """The two switches of `linear_ref`, `linear` and `kernels.invariant.linear`: fp32 a bool, act_block an int >= 0
    (a bool refused). Raises ValueError (`kernels.launch.fail`) naming the argument."""
    if not isinstance(fp32, bool):
        _fail(op, "fp32", repr(fp32), "a bool (True: an official fp32-compute linear)")
    if isinstance(act_block, bool) or not isinstance(act_block, int) or act_block < 0:
        _fail(op, "act_block", repr(act_block), "an int >= 0 (0: no activation quantization)")


def check_grouped_linear_args(op: str, o, weight) -> tuple[int, int, int, int, int]:
    """The grouped wo_a's shapes (`grouped_linear_ref`, `grouped_linear`): o a float tensor [b, s, G, i] (G >= 1,
    i >= 1) and the weight as held, whose dequantized shape (FP8 codes / a float weight: its own; packed FP4 int8
    [rows, i/2]: [rows, i]) is [G*o_rank, i] with o_rank >= 1 - G groups of o_rank rows, each row i wide. Returns
    (b, s, G, i, o_rank). Raises ValueError (`kernels.launch.fail`) naming o or the weight. The weight's dtype
    and scale are `dequantize_ref`'s checks; the model's o_rank (o_lora_rank) is not known here, only that the
    rows split into G equal groups."""
    if not isinstance(o, torch.Tensor) or not o.dtype.is_floating_point or o.dim() != 4:
        _fail(op, "o", f"{getattr(o, 'dtype', type(o))} shape {tuple(getattr(o, 'shape', ()))}",
              "a float tensor [b, s, G, i] (the attention output in G groups)")
    b, s, G, i = o.shape
    if G < 1 or i < 1:
        _fail(op, "o", f"shape {tuple(o.shape)}", "[b, s, G, i] with G >= 1 and i >= 1")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        _fail(op, "weight", f"{getattr(weight, 'dtype', type(weight))} shape "
              f"{tuple(getattr(weight, 'shape', ()))}", f"a 2-D tensor [G*o_rank, i] = [{G}*o_rank, {i}]")
    rows, width = weight.shape[0], weight.shape[1] * (2 if weight.dtype == torch.int8 else 1)
    if width != i or rows == 0 or rows % G:
        _fail(op, "weight", f"{weight.dtype} shape {tuple(weight.shape)} ({rows} rows of {width} inputs)",
              f"[G*o_rank, i] = [{G}*o_rank, {i}] with o_rank >= 1 (G = {G} equal groups of rows as wide as o's "
              f"last dim; o {tuple(o.shape)})")
    return b, s, G, i, rows // G


# ---------------------------------------------------------------------------------------------------------
# Reference (plain torch): the executable spec
# ---------------------------------------------------------------------------------------------------------

def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`bf16(act_quant_sim(x, 128) @ fp8_block_dequant(weight, scale)^T)` in fp32 (spec §2; = `Linear.forward`).

    Args: x [M, K] bf16; weight [N, K] float8_e4m3fn; scale [ceil(N/128), K/128] float8_e8m0fnu.
    Returns: [M, N] bf16. Raises ValueError on a wrong shape or dtype.
    """
    check_fp8_linear_args("fp8_linear_ref", x, weight, scale)
    xq = numerics.act_quant_sim(x, BLOCK)
    w = numerics.fp8_block_dequant(weight, scale, out_dtype=torch.float32)
    return (xq.float() @ w.T).to(torch.bfloat16)


def dequantize_ref(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A linear's weight as stored -> [out, in] in `dtype` (spec §2; `dsv4.model.Linear.dequantized_weight`'s maths).

    Args: weight float8_e4m3fn [out, in] FP8 codes with scale float8_e8m0fnu [ceil(out/128), ceil(in/128)]
    (`numerics.fp8_block_dequant`); int8 [out, in/2] packed e2m1 with scale float8_e8m0fnu [out, in/32]
    (`numerics.fp4_dequant`); any float [out, in] with scale None (returned as it is, not cast).
    Returns: [out, in] in `dtype` (exact: every FP8 / FP4 value times its power-of-two scale is exact in bf16
    and fp32), or the float weight itself. Raises ValueError naming the argument: a weight that is not a 2-D
    float8_e4m3fn / int8 / float tensor, a missing scale for FP8 / FP4 codes, a scale given with a float weight
    (it would be ignored), and (from the dequantizers) a wrong scale shape or dtype.
    """
    op = "dequantize_ref"
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not (
            weight.dtype in (torch.float8_e4m3fn, torch.int8) or weight.dtype.is_floating_point):
        _fail(op, "weight", f"{getattr(weight, 'dtype', type(weight))} shape {tuple(getattr(weight, 'shape', ()))}",
              "a 2-D float8_e4m3fn (FP8 codes), int8 (packed FP4) or float tensor [out, in]")
    quantized = weight.dtype in (torch.float8_e4m3fn, torch.int8)
    if quantized and scale is None:
        _fail(op, "scale", "None", f"the float8_e8m0fnu scales of the {weight.dtype} weight {tuple(weight.shape)}")
    if not quantized and scale is not None:
        _fail(op, "scale", f"given ({getattr(scale, 'dtype', type(scale))}) with a {weight.dtype} weight",
              "None: a float weight has no scale")
    if weight.dtype == torch.float8_e4m3fn:
        return numerics.fp8_block_dequant(weight, scale, out_dtype=dtype)
    if weight.dtype == torch.int8:
        return numerics.fp4_dequant(weight, scale, out_dtype=dtype)
    return weight


def linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, act_block: int = 0,
               fp32: bool = False) -> torch.Tensor:
    """Every `dsv4.model.Linear` (the `linear` entry of the reference backend; spec §2): x [..., in] -> [..., out].

    Args:
        x: [..., in] activations (bf16 in the official numerics, fp32 in the exact mode).
        weight, scale: the weight as the linear holds it (`dequantize_ref`: FP8 / FP4 codes + ue8m0 scales, or a
            float [out, in] weight with scale None).
        act_block: > 0: FP8 activation quantization of x first (`numerics.act_quant_sim(x, act_block)`, the
            official act_quant before an FP8 / FP4 GEMM; 128, or the row width below 128); 0: none.
        fp32: an official fp32-compute linear (head, compressor wkv / wgate): `fp32_linear_ref(x, weight)` with
            the weight fp32 or bf16 as on disk (upcast exactly), fp32 out; scale and act_block unused.
    Returns: [..., out] fp32 when `fp32`, else `x.float() @ W.float()^T` (fp32 products and sum) in x.dtype,
        W dequantized to x.dtype (the linear's compute dtype).
    Raises: ValueError naming the argument: x not a float tensor, x's width not the weight's in-features,
        act_block not an int >= 0, fp32 not a bool, and (`dequantize_ref`, `numerics`) a missing / wrong scale or
        a width that is no multiple of act_block.
    """
    op = "linear_ref"
    check_linear_flags(op, act_block, fp32)
    if fp32:
        return fp32_linear_ref(x, weight)
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() < 1:
        _fail(op, "x", f"{getattr(x, 'dtype', type(x))} shape {tuple(getattr(x, 'shape', ()))}",
              "a float tensor [..., in]")
    w = dequantize_ref(weight, scale, x.dtype)
    if x.shape[-1] != w.shape[1]:
        _fail(op, "x", f"width {x.shape[-1]} (shape {tuple(x.shape)})",
              f"the weight's in-features {w.shape[1]} (weight {tuple(weight.shape)} {weight.dtype})")
    if act_block:
        x = numerics.act_quant_sim(x, act_block)
    return (x.float() @ w.float().T).to(x.dtype)


def grouped_linear_ref(o: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The grouped `wo_a` (spec §5; the `grouped_linear` entry of the reference backend): group g of o times rows
    g*o..(g+1)*o-1 of the weight.

    Args: o [b, s, G, i] float in the activation dtype; weight, scale: wo_a as held (`dequantize_ref`), [G*o, i]
        once dequantized (o >= 1 rows per group).
    Returns: [b, s, G, o] in o.dtype; fp32 products and sum, no activation quantization (wo_a's input is used
        unquantized in bf16, as officially: pitfall 17).
    Raises: ValueError naming the argument (`check_grouped_linear_args`): o not a float 4-D tensor, a weight
        whose dequantized shape is not [G*o, i] (its width not o's last dim, its rows not G equal groups), and
        (`dequantize_ref`) a weight dtype or scale that is wrong.
    """
    _, _, G, i, n = check_grouped_linear_args("grouped_linear_ref", o, weight)
    wa = dequantize_ref(weight, scale, o.dtype).view(G, n, i)
    return torch.einsum("bsgi,goi->bsgo", o.float(), wa.float()).to(o.dtype)


# ---------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------

if triton is not None:  # the kernels exist only where triton is installed (it is optional)
    # the in-kernel number formats (re-exported: kernels.moe, the tests and the other kernels import them here)
    from kernels.jit_formats import (_nonfinite_rows, act_apply, act_quant_block, act_scale,  # noqa: F401
                                     cast_for_store, dot_q_w, dot_w_w, e4m3_bits, e4m3_to_f32, e8m0_to_f32,
                                     round_bf16, round_e4m3)
    from kernels.launch import split_k_total
    from kernels.quant import act_quant_sim

    @triton.jit(do_not_specialize=["M"])  # issue 29: one build, not one per class of the row count
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, KB, BR: tl.constexpr):
        """Grid (cdiv(M, BR), K/128): q_ptr <- e4m3 codes and s_ptr[m, kb] <- s fp32 (`act_quant`). The
        quantize -> dequantize form is `kernels.quant.act_quant_sim`."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        kb = tl.program_id(1)
        cols = kb * 128 + tl.arange(0, 128)
        mask = (rows < M)[:, None]
        r64 = rows.to(tl.int64)
        x = tl.load(x_ptr + r64[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q, s = act_quant_block(x)
        tl.store(q_ptr + r64[:, None] * K + cols[None, :], e4m3_bits(q).to(tl.uint8), mask=mask)
        tl.store(s_ptr + r64 * KB + kb, s, mask=rows < M)


    @triton.jit
    def _gemv_block(x_ptr, w, sw, acc, M, m0, offs_m, mask_m, live, kbu, kb1, xcol, GK, QUANT_X: tl.constexpr,
                    MMA: tl.constexpr, DOT: tl.constexpr):
        """acc [BM, BN] + one 128-wide K block: x[:, xcol:xcol+128] (rows offs_m) against the weight tile w [BN, 128]
        (e4m3 codes) of block scale sw. DOT: `dot_q_w` on the [BM, 128] tile (tensor cores). Else CUDA cores, row by
        row: `sum(q_m * w, axis=1)` of the same exact fp32 products (e4m3 x e4m3, or bf16 x e4m3: <= 12 significant
        bits), summed by `tl.sum`'s tree instead of the MMA's order; each row quantized (QUANT_X) as `act_quant_block`.
        A masked row (DOT, m >= M) or block (live [1, 1] False) loads zeros and adds nothing."""
        offs_k = tl.arange(0, 128)
        if DOT:
            x = tl.load(x_ptr + offs_m[:, None] * GK + xcol + offs_k[None, :], mask=mask_m[:, None] & live,
                        other=0.0).to(tl.float32)
            if QUANT_X:
                q, sx = act_quant_block(x)
                acc += dot_q_w(q, w, MMA) * (sx * sw)[:, None]
            else:
                acc += dot_q_w(x, w, MMA) * sw
        else:
            if MMA == 0:
                wf = e4m3_to_f32(w)  # the interpreter's fp8 cast is not faithful (`dot_q_w`)
            else:
                wf = w.to(tl.float32)  # exact (every e4m3 code is an fp32 value)
            live1 = (kbu + tl.zeros((128,), tl.int32)) < kb1
            for m in range(m0, M):  # a runtime loop: one copy of the row code (a static unroll compiles for minutes)
                # x as one [128] vector (not [1, 128]): the products and the sum then stay in the weight tile's
                # layout (a [1, 128] row made Triton move the whole tile into the row's layout through shared memory)
                xm = tl.load(x_ptr + m * GK + xcol + offs_k, mask=live1, other=0.0).to(tl.float32)
                if QUANT_X:
                    inv, sx = act_scale(xm, 0)
                    row = tl.sum(wf * act_apply(xm, inv, 0)[None, :], axis=1) * (sx * sw)
                else:
                    row = tl.sum(wf * xm[None, :], axis=1) * sw
                acc += tl.where(offs_m[:, None] == m, row[None, :], 0.0)
        return acc


    @triton.jit(do_not_specialize=["M", "G", "KB", "KB_PER_SPLIT", "SPLIT", "MCH"])  # one build per GemvConfig, BM
    def _fp8_gemv_kernel(x_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, sem_ptr, M, N, K, G, KB, KB_PER_SPLIT, SPLIT, MCH,
                         BM: tl.constexpr, BN: tl.constexpr, MMA: tl.constexpr, QUANT_X: tl.constexpr,
                         DOT: tl.constexpr, UNROLL: tl.constexpr):
        """Decode GEMV/skinny GEMM, grid (cdiv(N, BN) * MCH, SPLIT, G): for group g, y[:, g*N:(g+1)*N] =
        x[:, g*K:(g+1)*K] . W[g*N:(g+1)*N]^T, x [M, G*K] bf16, W [G*N, K] e4m3 codes with one ue8m0 scale per
        128x128 block, y [M, G*N] bf16, fp32 accumulation. G = 1 is `fp8_linear`'s decode path; G > 1 the grouped
        `wo_a` (`fp8_grouped_gemv`). BN divides 128, so one weight scale per K block (G > 1 needs N % 128 == 0).
        QUANT_X: x is quantized in registers per 128 block (`act_quant_block`, the official act_quant) and the
        block's scale applied; otherwise x is used as it is (wo_a: no activation quantization, spec §5; or x already
        `act_quant_sim`-ed, whose values are the codes times 2^k: the same sums times the same powers of two).
        DOT: tensor-core dot per K block, else CUDA-core rows (`_gemv_block`). UNROLL: K blocks loaded per loop
        iteration (more bytes in flight), accumulated in the same kb order as UNROLL = 1 (bitwise the same result).
        SPLIT > 1: partials [G, SPLIT, M, N] in part_ptr, the last program of a (group, N block) (acq_rel
        semaphore) sums them in split order, writes bf16 and resets its semaphore.
        MCH: row chunks of BM rows (program 0-axis id = N block * MCH + chunk; the chunks of one weight tile run side
        by side, so the tile is read from HBM about once): the batch-invariant mode's fixed BM = 16 tile over any M
        (`_invariant_gemv`); the default runs MCH = 1 (BM covers M).
        Not specialized on M, G and the split sizes (loop bounds and masks only; K, whose divisibility by 16 the
        vector loads of W need, is): Triton would otherwise build one kernel per value class (== 1, % 16 == 0) of
        each, several per launch config across the model's shapes."""
        pid0 = tl.program_id(0)
        pid_n = pid0 // MCH
        m0 = (pid0 % MCH) * BM
        pid_s = tl.program_id(1)
        g = tl.program_id(2)
        offs_m = m0 + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, 128)
        mask_m = offs_m < M
        mask_n = offs_n < N
        GK = G.to(tl.int64) * K  # int64 row offsets: a prefill's rows x G*K can pass 2^31 in the invariant mode
        GN = G * N
        rows64 = (g * N + offs_n).to(tl.int64)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        kb0 = pid_s * KB_PER_SPLIT
        kb1 = tl.minimum(kb0 + KB_PER_SPLIT, KB)
        srow = (g * N + pid_n * BN) // 128
        for kb in range(kb0, kb1, UNROLL):
            for u in tl.static_range(UNROLL):  # a block past kb1 (UNROLL > 1) loads zero codes and x: adds +0
                live = (kb + u + tl.zeros((1, 1), tl.int32)) < kb1  # [1, 1]: the interpreter cannot mask by a scalar
                w = tl.load(w_ptr + rows64[:, None] * K + (kb + u) * 128 + offs_k[None, :],
                            mask=mask_n[:, None] & live, other=0.0)
                sw = e8m0_to_f32(tl.load(ws_ptr + srow * KB + tl.minimum(kb + u, kb1 - 1)).to(tl.int32))
                acc = _gemv_block(x_ptr, w, sw, acc, tl.minimum(M, m0 + BM), m0, offs_m, mask_m, live, kb + u, kb1, g * K + (kb + u) * 128, GK,
                                  QUANT_X, MMA, DOT)
        out_mask = mask_m[:, None] & mask_n[None, :]
        yoffs = offs_m.to(tl.int64)[:, None] * GN + (g * N + offs_n).to(tl.int64)[None, :]
        if SPLIT == 1:
            tl.store(y_ptr + yoffs, round_bf16(acc).to(tl.bfloat16), mask=out_mask)
        else:
            base = (g * SPLIT * M).to(tl.int64) * N
            tot, last = split_k_total(acc, part_ptr + base, sem_ptr + g * tl.num_programs(0) + pid0,
                                      offs_m[:, None] * N + offs_n[None, :], M * N, pid_s, SPLIT, out_mask)
            if last:
                tl.store(y_ptr + yoffs, round_bf16(tot).to(tl.bfloat16), mask=out_mask)


    @triton.jit(do_not_specialize=["N", "G", "KB"])  # one build per RowsConfig (K's divisibility stays: vector loads)
    def _fp8_gemv_rows_kernel(x_ptr, w_ptr, ws_ptr, y_ptr, N, K, G, KB, BN: tl.constexpr, BKB: tl.constexpr,
                              QUANT_X: tl.constexpr, MMA: tl.constexpr, EVEN: tl.constexpr, limit=0.0,
                              SWIGLU: tl.constexpr = False, HAS_LIMIT: tl.constexpr = False):
        """One row of x (M = 1), grid (cdiv(N, BN), G): y[0, g*N + n] = x[0, g*K:(g+1)*K] . W[g*N + n]^T for the BN
        rows n of this program, all of K in ONE program (no split-K, no merge): BKB K blocks of 128 per load, the
        FP8 codes widened to fp32 (exact) and multiplied by x on CUDA cores, summed per 128 block, times the
        block's ue8m0 weight scale (and, QUANT_X, x's act_quant scale: x quantized per 128 block in registers,
        `act_scale` / `act_apply`, exactly the official act_quant), accumulated in fp32 over the blocks; bf16 out.
        BN divides 128 (one weight-scale row per program); K blocks past KB (BKB not dividing KB) and rows past N
        are masked, unless EVEN (BN divides N and BKB divides KB: no masks, the loads the probe measured).
        The same exact products as `_fp8_gemv_kernel`, another fp32 summation order.
        SWIGLU (G = 1; the shared expert's joint [w1; w3], `fp8_gemv_swiglu`): W holds 2N rows, the program also
        computes rows N + n (v) beside rows n (u) from the same x loads, and stores h[n] = silu(u) * v of the two
        bf16-rounded outputs with the clamps (HAS_LIMIT: v to [-limit, limit], u to <= limit, NaN kept), bitwise
        what this kernel's [u | v] followed by `kernels.moe._swiglu_joint_kernel` stores."""
        pid = tl.program_id(0)
        g = tl.program_id(1)
        rows = pid * BN + tl.arange(0, BN)
        mask_n = rows < N
        wrow = (g * N + rows).to(tl.int64)[:, None] * K
        srow = (g * N + pid * BN) // 128
        wrow2 = (N + rows).to(tl.int64)[:, None] * K  # SWIGLU: the v rows (G = 1)
        srow2 = (N + pid * BN) // 128
        offs = tl.arange(0, BKB * 128)
        blk = tl.arange(0, BKB)
        xrow = x_ptr + g.to(tl.int64) * K
        acc = tl.zeros((BN,), dtype=tl.float32)
        acc2 = tl.zeros((BN,), dtype=tl.float32)
        for kb in range(0, KB, BKB):
            if EVEN:
                w = tl.load(w_ptr + wrow + kb * 128 + offs[None, :])
                xv = tl.load(xrow + kb * 128 + offs)
                se = tl.load(ws_ptr + srow * KB + kb + blk)
                if SWIGLU:
                    w2 = tl.load(w_ptr + wrow2 + kb * 128 + offs[None, :])
                    se2 = tl.load(ws_ptr + srow2 * KB + kb + blk)
            else:
                live_k = (kb * 128 + offs) < K
                w = tl.load(w_ptr + wrow + kb * 128 + offs[None, :], mask=mask_n[:, None] & live_k[None, :],
                            other=0.0)
                xv = tl.load(xrow + kb * 128 + offs, mask=live_k, other=0.0)
                se = tl.load(ws_ptr + srow * KB + kb + blk, mask=(kb + blk) < KB, other=127)
                if SWIGLU:
                    w2 = tl.load(w_ptr + wrow2 + kb * 128 + offs[None, :], mask=mask_n[:, None] & live_k[None, :],
                                 other=0.0)
                    se2 = tl.load(ws_ptr + srow2 * KB + kb + blk, mask=(kb + blk) < KB, other=127)
            if MMA == 0:
                wf = e4m3_to_f32(w)  # the interpreter's fp8 cast is not faithful (`dot_q_w`)
            else:
                wf = w.to(tl.float32)  # exact (every e4m3 code is an fp32 value)
            xb = tl.reshape(xv.to(tl.float32), (BKB, 128))
            sw = e8m0_to_f32(se.to(tl.int32))
            if QUANT_X:
                inv, sx = act_scale(xb)
                xb = act_apply(xb, inv)
                sw = sw * sx
            p = tl.reshape(wf, (BN, BKB, 128)) * xb[None, :, :]
            acc += tl.sum(tl.sum(p, axis=2) * sw[None, :], axis=1)
            if SWIGLU:
                wf2 = e4m3_to_f32(w2) if MMA == 0 else w2.to(tl.float32)
                sw2 = e8m0_to_f32(se2.to(tl.int32))
                if QUANT_X:
                    sw2 = sw2 * sx
                p2 = tl.reshape(wf2, (BN, BKB, 128)) * xb[None, :, :]
                acc2 += tl.sum(tl.sum(p2, axis=2) * sw2[None, :], axis=1)
        if SWIGLU:
            u = round_bf16(acc)
            v = round_bf16(acc2)
            if HAS_LIMIT:
                v = tl.maximum(v, -limit, propagate_nan=tl.PropagateNan.ALL)
                v = tl.minimum(v, limit, propagate_nan=tl.PropagateNan.ALL)
                u = tl.minimum(u, limit, propagate_nan=tl.PropagateNan.ALL)
            h = u / (1.0 + tl.exp(-u)) * v
            tl.store(y_ptr + rows, round_bf16(h).to(tl.bfloat16), mask=mask_n)
        else:
            tl.store(y_ptr + g * N + rows, round_bf16(acc).to(tl.bfloat16), mask=mask_n)


    @triton.jit
    def _fp8_dequant_kernel(w_ptr, ws_ptr, out_ptr, N, K, KB, BN: tl.constexpr):
        """W bf16 [N, K] <- e4m3 code * 2^(s-127), grid (cdiv(N, BN), K/128); exact."""
        offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
        kb = tl.program_id(1)
        offs_k = kb * 128 + tl.arange(0, 128)
        mask = (offs_n < N)[:, None]
        n64 = offs_n.to(tl.int64)
        w = tl.load(w_ptr + n64[:, None] * K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        s = e8m0_to_f32(tl.load(ws_ptr + (offs_n // 128) * KB + kb, mask=offs_n < N, other=127).to(tl.int32))
        tl.store(out_ptr + n64[:, None] * K + offs_k[None, :], (w * s[:, None]).to(tl.bfloat16), mask=mask)


    @triton.jit(do_not_specialize=["M"])  # issue 29
    def _fp8_gemm_kernel(q_ptr, sx_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, KB,
                         BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, MMA: tl.constexpr):
        """FP8 GEMM (prefill "triton": 128 x 128 tiles; decode from DECODE_TILES_MIN_M rows: DECODE_TILE) on
        pre-quantized x (e4m3 codes q [M, K] + fp32 scales sx [M, K/128]); grid
        cdiv(M, BM) * cdiv(N, BN) with grouped ordering for L2 reuse. BN divides 128. Per K block:
        `acc += dot(q, w) * sx[:, kb] * sw[n/128, kb]` (the official fp8_gemm). MMA: see `dot_w_w`."""
        pid = tl.program_id(0)
        n_m = tl.cdiv(M, BM)
        n_n = tl.cdiv(N, BN)
        group = pid // (GROUP_M * n_n)
        first_m = group * GROUP_M
        size_m = tl.minimum(n_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
        pid_n = (pid % (GROUP_M * n_n)) // size_m
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, 128)
        mask_m = offs_m < M
        mask_n = offs_n < N
        m64 = offs_m.to(tl.int64)
        n64 = offs_n.to(tl.int64)
        srow = (pid_n * BN) // 128
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, KB):
            a = tl.load(q_ptr + m64[:, None] * K + kb * 128 + offs_k[None, :], mask=mask_m[:, None], other=0.0)
            b = tl.load(w_ptr + n64[:, None] * K + kb * 128 + offs_k[None, :], mask=mask_n[:, None], other=0.0)
            blk = dot_w_w(a, b, MMA)
            sx = tl.load(sx_ptr + m64 * KB + kb, mask=mask_m, other=0.0)
            sw = e8m0_to_f32(tl.load(ws_ptr + srow * KB + kb).to(tl.int32))
            acc += blk * (sx * sw)[:, None]
        tl.store(y_ptr + m64[:, None] * N + n64[None, :], round_bf16(acc).to(tl.bfloat16),
                 mask=mask_m[:, None] & mask_n[None, :])


# ---------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------

def act_quant(x: torch.Tensor, *, sim: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton `dsv4.quant.act_quant(x, 128, "ue8m0")` (sim=False: e4m3 codes [M, K] + fp32 scales [M, K/128]) or
    `act_quant_sim` (sim=True: bf16 [M, K], scales None; `kernels.quant.act_quant_sim` with 128-channel blocks).
    x [M, K] bf16, K % 128 == 0; bitwise equal to the torch functions. Raises ValueError on a wrong shape, dtype or layout."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
        _fail("act_quant", "x", f"{getattr(x, 'dtype', type(x))} shape {tuple(getattr(x, 'shape', ()))}",
              "a 2-D bf16 tensor [M, K]")
    M, K = x.shape
    if K % BLOCK or K == 0:
        _fail("act_quant", "K", K, f"a positive multiple of {BLOCK}")
    check_layout("act_quant", {"x": x})
    if sim:
        return act_quant_sim(x, BLOCK), None
    KB = K // BLOCK
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, KB, dtype=torch.float32, device=x.device)
    if M:
        BR = 16  # e4m3 bytes are assembled bit by bit (`e4m3_bits`)
        _act_quant_kernel[(triton.cdiv(M, BR), KB)](x, q.view(torch.uint8), s, M, K, KB, BR=BR)
    return q, s


def fp8_dequant(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Triton `dsv4.quant.fp8_block_dequant(weight, scale, bf16)`: [N, K] bf16 (exact), K % 128 == 0."""
    N, K = weight.shape if weight.dim() == 2 else (0, 0)
    check_fp8_linear_args("fp8_dequant", torch.empty(0, K, dtype=torch.bfloat16), weight, scale)
    check_layout("fp8_dequant", {"weight": weight, "scale": scale})
    out = torch.empty(N, K, dtype=torch.bfloat16, device=weight.device)
    BN = 64
    _fp8_dequant_kernel[(triton.cdiv(N, BN), K // BLOCK)](weight, scale.view(torch.uint8), out, N, K, K // BLOCK,
                                                           BN=BN)
    return out


def prefill_method(M: int, N: int, K: int, device: torch.device) -> str:
    """Default prefill path for x [M, K] and an [N, K] FP8 weight (module docstring: the measurements). scaled_mm
    only where it was measured faster (sm_90, N >= 4096, K >= 3072) and its shape rule holds (M % 4 == 0)."""
    sm = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    fast = N >= 4096 and K >= 3072 and M % 4 == 0 and (K // BLOCK) % 4 == 0
    return "scaled_mm" if fast and sm[0] == 9 else "dequant"


def mma_mode(mma: str | None) -> int:
    """Dot flavour for the kernels: 0 under TRITON_INTERPRET=1 (always; see `dot_q_w`), else 2 for "fp8" (e4m3
    tensor cores, the official Hopper path) or 1 for "bf16" (both operands widened, exact). None -> MMA_DEFAULT.
    Raises ValueError for any other name."""
    name = MMA_DEFAULT if mma is None else mma
    if name not in ("fp8", "bf16"):
        _fail("mma", "mma", repr(mma), "'fp8' or 'bf16'")
    return 0 if interpreting() else (2 if name == "fp8" else 1)


class GemvConfig(NamedTuple):
    """Launch of `_fp8_gemv_kernel` (decode, M <= GEMV_MAX_M); `gemv_config` picks one, the sweep
    `benchmarks/bench_gemm.py --sections gemv_sweep` times them.

    dot: tensor-core dot per K block (BM = max(16, next_pow2(M)) rows) or False: CUDA-core rows (BM =
        next_pow2(M), M <= 16; `_gemv_block`) - the same exact products, another fp32 summation order.
    bn: output columns per program (32, 64, 128). unroll: K blocks per loop iteration (1, 2, 4; same order,
    bitwise the same). per_sm: programs per SM the split-K aims at (`kernels.launch.split_k`; another split is another order).
    num_warps, num_stages: Triton launch options (num_stages None = Triton's default).
    prequant: x quantized once by `kernels.quant.act_quant_sim` (one more launch; the kernel then reads the
        exact dequantized values, QUANT_X=False: the same sums times the same powers of two) instead of per
        program in registers. fp8_linear only (`wo_a` has no activation quantization)."""
    dot: bool = True
    bn: int = 64
    unroll: int = 1
    per_sm: int = 2
    num_warps: int = 4
    num_stages: int | None = None
    prequant: bool = False


class RowsConfig(NamedTuple):
    """Launch of `_fp8_gemv_rows_kernel`, the decode GEMV of ONE row (M = 1; `gemv_config` picks it there): bn
    weight rows per program (1..128, a power of two dividing 128), bkb K blocks of 128 per load (a power of two;
    blocks past K are masked), num_warps. No split-K: all of K in each program, cdiv(N, bn) * G programs."""
    bn: int = 8
    bkb: int = 8
    num_warps: int = 4


ROWS_DEFAULT = RowsConfig()
"""The one-row launch for a shape without a `ROWS_TUNED` entry: 8 rows x 1024 inputs per load, 4 warps - the fastest
of `benchmarks/gemv_probe.py`'s sweep at 4 of Flash's 5 decode shapes on one H200 (benchmarks/RESULTS.md, session
of 2026-12-04 (2)): wqkv_a 5.8 µs (the split-K `_fp8_gemv_kernel` 9.4), wo_b 13.1 (19.0), shared w13 7.8 (19.7),
shared w2 5.1 (13.0); within 1.18-1.25x of a read-only kernel over the same bytes."""

ROWS_TUNED: dict[tuple[int, int, int], RowsConfig] = {
    (32768, 1024, 1): RowsConfig(bn=16, bkb=4),  # flash wq_b 10.5 µs (18.5 split-K; read-only 10.8)
    (1024, 4096, 8): RowsConfig(bn=16, bkb=4),  # flash grouped wo_a 12.0 µs (13.3 default, 17.5 split-K)
}
"""{(N, K, G): RowsConfig} measured faster than ROWS_DEFAULT (same probe)."""


# Measured decode launches: {(M bucket 8 / 32 / 64, N, K, G): GemvConfig} on sm_90 (H200) (one row, M = 1, runs
# `_fp8_gemv_rows_kernel` with a `RowsConfig` since the session of 2026-12-04 (2): the bucket-1 entries went), pasted from the
# last lines of `benchmarks/bench_gemm.py --quick --sections gemv_sweep` (one H200, tree of 78aebf1; only where a
# variant beat the default by >= 3 %; benchmarks/RESULTS.md, session of 2026-12-01). Flash shapes only (the
# --quick sweep): Pro shapes and the M = 64 bucket take the launch of `gemv_config`'s rule.
GEMV_TUNED: dict[tuple[int, int, int, int], GemvConfig] = {
    (8, 1024, 4096, 1): GemvConfig(bn=128, unroll=2, num_warps=8),  # flash wq_a 9.1 -> 8.8 µs
    (32, 1024, 4096, 1): GemvConfig(unroll=2, num_warps=8),  # flash wq_a 13.8 -> 12.6 µs
    (8, 32768, 1024, 1): GemvConfig(unroll=2, per_sm=4, prequant=True),  # flash wq_b 22.9 -> 21.8 µs
    (32, 32768, 1024, 1): GemvConfig(unroll=2, num_warps=8),  # flash wq_b 60.3 -> 39.6 µs
    (32, 512, 4096, 1): GemvConfig(unroll=2, num_warps=8),  # flash wkv 9.9 -> 9.4 µs
    (32, 1024, 4096, 8): GemvConfig(unroll=2, num_warps=8),  # flash wo_a 30.1 -> 24.3 µs
    (8, 4096, 8192, 1): GemvConfig(bn=128, unroll=2, num_warps=8),  # flash wo_b 27.2 -> 19.8 µs
    (32, 4096, 8192, 1): GemvConfig(unroll=2, num_warps=8),  # flash wo_b 64.2 -> 50.0 µs
    (32, 2048, 4096, 1): GemvConfig(unroll=2, num_warps=8),  # flash shared w1/w3 21.8 -> 16.1 µs
    # the shared expert's joint w1 | w3 (`dsv4.model.Expert.join_w13`, issue 27): the w1 / w3 launches carried over
    # (not swept at this shape)
    (32, 4096, 4096, 1): GemvConfig(unroll=2, num_warps=8),
    # the attention's joint wq_a | wkv (`dsv4.model.Attention.join_wq_a_wkv`, issue 27): wq_a's launches carried over
    (8, 1536, 4096, 1): GemvConfig(bn=128, unroll=2, num_warps=8),
    (32, 1536, 4096, 1): GemvConfig(unroll=2, num_warps=8),
    (8, 4096, 2048, 1): GemvConfig(bn=128, unroll=2, num_warps=8),  # flash shared w2 10.5 -> 10.0 µs
    (32, 4096, 2048, 1): GemvConfig(unroll=2, num_warps=8),  # flash shared w2 19.8 -> 15.4 µs
    (8, 8192, 1024, 1): GemvConfig(bn=128, unroll=2, num_warps=8),  # flash indexer wq_b 10.3 -> 9.6 µs
    (32, 8192, 1024, 1): GemvConfig(unroll=2, num_warps=8),  # flash indexer wq_b 20.0 -> 17.8 µs
}


GEMV_INVARIANT = GemvConfig(dot=True, bn=64, unroll=1, per_sm=2, num_warps=4)
"""The launch of the batch-invariant mode (`fp8_linear(..., invariant=True)`, `fp8_grouped_gemv`) for a weight
shape without a `GEMV_INVARIANT_TUNED` entry: tensor-core dot on row tiles of INVARIANT_BM rows, one launch for
every M, the split-K count of `invariant_split` (a function of N, K, G and the device, never of M)."""

INVARIANT_BM = 16
"""Rows per tensor-core tile in the batch-invariant GEMVs (this module and `kernels.fp32_linear`): M rows run as
cdiv(M, 16) row tiles of one launch. 16 is the smallest dot Triton takes; on sm_90 it is an mma.sync tile (the
wgmma path needs 64 rows), the same instruction for every M, and at M = 1 it costs what the default's 16-row dot
costs (the previous fixed tile, 64 rows, cost 3.4x at M = 1: benchmarks/RESULTS.md)."""

INVARIANT_PREFILL_BM = 64
"""Row tile of the batch-invariant GEMV above GEMV_MAX_M rows (the grouped wo_a of a prefill; a wgmma tile on
sm_90): fixed for every M > GEMV_MAX_M, so a chunked prefill whose chunks all have > GEMV_MAX_M rows sums each
row as the whole prompt's call does."""

INVARIANT_LAUNCH_ROWS = 1024
"""Rows per launch of the batch-invariant GEMV at prefill (a launch's split-K scratch is SPLIT * rows * N fp32;
rows are independent, so the cut changes no value)."""

# The batch-invariant launch per weight shape {(N, K, G): GemvConfig with dot=True} on sm_90: the fastest of a
# sweep over bn / unroll / per_sm / num_warps / prequant at M = 1, 8 and 32 (`benchmarks/bench_gemm.py --sections
# invariant_sweep`; benchmarks/RESULTS.md). Any entry is invariant (its tile and split never follow M); only the
# speed differs.
GEMV_INVARIANT_TUNED: dict[tuple[int, int, int], GemvConfig] = {
    # one H200, `bench_gemm.py --quick --sections invariant_sweep` (tree of a27792f + this change): the launch with
    # the smallest worst ratio to the default mode over M = 1 / 8 / 32; comment: µs at M = 1 / 8 / 32, that ratio
    (1024, 4096, 1): GemvConfig(bn=128, unroll=2, per_sm=4, num_warps=8),  # wq_a 8.3/8.8/10.9, 1.01x
    (32768, 1024, 1): GemvConfig(unroll=2, per_sm=4, prequant=True),  # wq_b 21.8/22.1/34.4, 1.16x
    (512, 4096, 1): GemvConfig(bn=128, unroll=2, per_sm=4, num_warps=8),  # wkv 7.3/7.6/8.7, 0.98x
    (1024, 4096, 8): GemvConfig(),  # wo_a 18.2/18.4/28.4, 1.18x
    (4096, 8192, 1): GemvConfig(bn=128, unroll=2, num_warps=8),  # wo_b 19.6/20.0/32.5, 1.03x
    (2048, 4096, 1): GemvConfig(),  # shared w1/w3 10.8/10.9/14.8, 1.00x
    (4096, 2048, 1): GemvConfig(bn=128, unroll=2, per_sm=4, num_warps=8),  # shared w2 9.8/10.0/15.3, 1.00x
    (8192, 1024, 1): GemvConfig(bn=128, unroll=2, num_warps=8),  # indexer wq_b 9.5/9.5/15.1, 0.99x
}


def invariant_config(N: int, K: int, G: int, device: torch.device) -> GemvConfig:
    """The batch-invariant GEMV launch for G weights [N, K]: `GEMV_INVARIANT_TUNED` on sm_90 where swept, else
    GEMV_INVARIANT. A function of the weight shape and the device only (never of M)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
        return GEMV_INVARIANT_TUNED.get((N, K, G), GEMV_INVARIANT)
    return GEMV_INVARIANT


def invariant_split(N: int, K: int, G: int, device: torch.device,
                    cfg: GemvConfig | None = None) -> tuple[int, int]:
    """(SPLIT, K blocks per split) of the batch-invariant GEMV for G weights [N, K]: `kernels.launch.split_k` of
    the launch's grid without its row tiles (cdiv(N, bn) * G output blocks, K/128 blocks), so fixed per weight
    shape and device; the merge sums the splits in split order (`split_k_total`)."""
    cfg = cfg or invariant_config(N, K, G, device)
    return split_k(device, triton.cdiv(N, cfg.bn) * G, K // BLOCK, cfg.per_sm)


def _invariant_gemv(x, weight, ws, out, M: int, N: int, K: int, G: int, mma: int, quant_x: bool) -> None:
    """The batch-invariant GEMV: `_fp8_gemv_kernel` launches of `invariant_config` over row tiles of INVARIANT_BM
    rows (M <= GEMV_MAX_M: a decode step, one launch) or INVARIANT_PREFILL_BM rows (M > GEMV_MAX_M: the grouped
    wo_a of a prefill), with the split of `invariant_split`: a row's result depends on its own values only (the
    same tile shape, instruction, K order and split for every M on each side of GEMV_MAX_M; rows never mix in a
    dot)."""
    cfg = invariant_config(N, K, G, x.device)
    split = invariant_split(N, K, G, x.device, cfg)
    bm = INVARIANT_BM if M <= GEMV_MAX_M else INVARIANT_PREFILL_BM  # by the whole call's M: one tile per call
    for r0 in range(0, M, INVARIANT_LAUNCH_ROWS):  # bounds the split-K scratch (SPLIT * rows * N fp32) at prefill
        r1 = min(M, r0 + INVARIANT_LAUNCH_ROWS)
        _gemv_launch(x[r0:r1], weight, ws, out[r0:r1], r1 - r0, N, K, G, mma, quant_x, cfg, bm=bm, split=split)


def gemv_m_bucket(M: int) -> int:
    """The row bucket of `GEMV_TUNED` (1, 8, 32, 64): M rounded up to the next swept size."""
    return next(b for b in (1, 8, 32, GEMV_MAX_M) if M <= b)


def gemv_config(M: int, N: int, K: int, G: int, device: torch.device) -> GemvConfig | RowsConfig:
    """Decode launch for x [M, G*K] bf16 and G FP8 weights [N, K] (G = 1: `fp8_linear`; G > 1: the grouped
    `wo_a`), 1 <= M <= GEMV_MAX_M. One row (M = 1): the one-row kernel, `ROWS_TUNED` entry of (N, K, G) or
    ROWS_DEFAULT (measured on an H200; every device). More rows: on sm_90 the `GEMV_TUNED` entry of
    (gemv_m_bucket(M), N, K, G) where the sweep measured one; else the launch measured in benchmarks/RESULTS.md
    (issue 13): tensor-core dot, BN 64 (M <= 16) or 32, one K block per iteration, ~2 programs per SM, 4 warps,
    Triton's default stages. Every launch gives the reference's result within the same bound (`GemvConfig`: only
    the fp32 summation order differs)."""
    if M == 1:
        return ROWS_TUNED.get((N, K, G), ROWS_DEFAULT)
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
        tuned = GEMV_TUNED.get((gemv_m_bucket(M), N, K, G))
        if tuned is not None:
            return tuned  # (an entry the kernel cannot run is refused by `_check_gemv_config`, never replaced)
    return GemvConfig(bn=64 if M <= 16 else 32)


def _check_rows_config(op: str, cfg: RowsConfig, M: int) -> RowsConfig:
    """A RowsConfig as given, or ValueError naming the field and the value (M must be 1)."""
    if M != 1:
        _fail(op, "gemv", repr(cfg), f"a GemvConfig for M = {M} rows (a RowsConfig runs one row)")
    for field in ("bn", "bkb", "num_warps"):
        v = getattr(cfg, field)
        if not isinstance(v, int) or isinstance(v, bool):
            _fail(op, f"gemv.{field}", repr(v), "an int")
    if cfg.bn not in (1, 2, 4, 8, 16, 32, 64, 128):
        _fail(op, "gemv.bn", cfg.bn, "a power of two <= 128 (divides the 128-row scale block)")
    if cfg.bkb not in (1, 2, 4, 8, 16):
        _fail(op, "gemv.bkb", cfg.bkb, "1, 2, 4, 8 or 16 K blocks per load")
    if cfg.num_warps not in (1, 2, 4, 8, 16):
        _fail(op, "gemv.num_warps", cfg.num_warps, "1, 2, 4, 8 or 16")
    return cfg


def _check_gemv_config(op: str, cfg, M: int, G: int) -> GemvConfig | RowsConfig:
    """cfg as given (a GemvConfig, or a RowsConfig for one row) or ValueError naming the field and the value."""
    if isinstance(cfg, RowsConfig):
        return _check_rows_config(op, cfg, M)
    if not isinstance(cfg, GemvConfig):
        _fail(op, "gemv", repr(cfg), "a kernels.gemm.GemvConfig (or a RowsConfig for one row)")
    for field in ("dot", "prequant"):
        if not isinstance(getattr(cfg, field), bool):
            _fail(op, f"gemv.{field}", repr(getattr(cfg, field)), "a bool")
    for field in ("bn", "unroll", "per_sm", "num_warps") + (("num_stages",) if cfg.num_stages is not None else ()):
        v = getattr(cfg, field)
        if not isinstance(v, int) or isinstance(v, bool):
            _fail(op, f"gemv.{field}", repr(v), "an int")
    if cfg.bn not in (32, 64, 128):  # the tested and sm_90 / sm_100-built sizes (kernels/targets.py)
        _fail(op, "gemv.bn", cfg.bn, "32, 64 or 128 (divides the 128-row scale block)")
    if not cfg.dot and M > 16:
        _fail(op, "gemv.dot", f"False with M = {M}", "M <= 16 for the CUDA-core rows (unrolled per row)")
    if cfg.unroll not in (1, 2, 4):
        _fail(op, "gemv.unroll", cfg.unroll, "1, 2 or 4")
    if cfg.per_sm < 1:
        _fail(op, "gemv.per_sm", repr(cfg.per_sm), "an int >= 1")
    if cfg.num_warps not in (1, 2, 4, 8, 16):
        _fail(op, "gemv.num_warps", cfg.num_warps, "1, 2, 4, 8 or 16")
    if cfg.num_stages is not None and cfg.num_stages not in range(1, 8):
        _fail(op, "gemv.num_stages", cfg.num_stages, "None or 1..7")
    if cfg.prequant and G > 1:
        _fail(op, "gemv.prequant", True, "False for the grouped wo_a (no activation quantization)")
    return cfg


def _gemv_launch(x, weight, ws, out, M: int, N: int, K: int, G: int, mma: int, quant_x: bool,
                 cfg: GemvConfig | RowsConfig, bm: int | None = None, split: tuple[int, int] | None = None) -> None:
    """One `_fp8_gemv_kernel` launch (plus, for cfg.prequant, one `act_quant_sim`) writing out [M, G*N], or, for a
    RowsConfig (M = 1), one `_fp8_gemv_rows_kernel` launch. bm / split:
    the dot's row count and (SPLIT, K blocks per split), fixed by the batch-invariant mode (`_invariant_gemv`);
    None = from M and `split_k` (the default mode)."""
    KB = K // BLOCK
    if isinstance(cfg, RowsConfig):  # one row: `_fp8_gemv_rows_kernel` (no split-K, no workspace)
        rmma = 0 if mma == 0 else 1  # only the fp8 -> fp32 widening differs (the interpreter's is not faithful)
        _fp8_gemv_rows_kernel[(triton.cdiv(N, cfg.bn), G)](x, weight, ws, out, N, K, G, KB, BN=cfg.bn, BKB=cfg.bkb,
                                                           QUANT_X=quant_x, MMA=rmma,
                                                           EVEN=N % cfg.bn == 0 and KB % cfg.bkb == 0,
                                                           num_warps=cfg.num_warps)
        return
    if quant_x and cfg.prequant:
        x, quant_x = act_quant_sim(x, BLOCK), False
    if not quant_x and mma == 2:
        mma = 1  # x not on the e4m3 grid: the bf16 tensor-core dot (exact)
    BM = bm or (max(16, triton.next_power_of_2(M)) if cfg.dot else triton.next_power_of_2(M))
    chunks = triton.cdiv(M, BM)  # 1 unless bm fixes the tile below M (the batch-invariant mode)
    n_blocks = triton.cdiv(N, cfg.bn)
    split, per = split or split_k(x.device, n_blocks * G, KB, cfg.per_sm)
    sem, part = workspace(x.device, n_blocks * chunks * G, G * split * M * N if split > 1 else 1)
    opts = {"num_warps": cfg.num_warps}
    if cfg.num_stages is not None:
        opts["num_stages"] = cfg.num_stages
    _fp8_gemv_kernel[(n_blocks * chunks, split, G)](x, weight, ws, out, part, sem, M, N, K, G, KB, per, split,
                                                    chunks, BM=BM, BN=cfg.bn, MMA=mma, QUANT_X=quant_x,
                                                    DOT=cfg.dot, UNROLL=cfg.unroll, **opts)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor | None = None,
               prefill: str | None = None, mma: str | None = None, gemv: GemvConfig | RowsConfig | None = None,
               invariant: bool = False) -> torch.Tensor:
    """FP8 W8A8 block-scaled linear as the official bf16 path (spec §2): `fp8_linear_ref` computed in Triton.

    Args:
        x: [M, K] bf16 (contiguous); K % 128 == 0.
        weight: [N, K] float8_e4m3fn codes; scale: [ceil(N/128), K/128] float8_e8m0fnu (on-disk layout).
        out: optional [M, N] bf16 output (written completely).
        prefill: M > GEMV_MAX_M only: "dequant" | "scaled_mm" | "triton" (default `prefill_method`; module doc).
        mma: dot flavour of the Triton kernels, "fp8" | "bf16" (default MMA_DEFAULT; `mma_mode`); same result.
        gemv: M <= GEMV_MAX_M only: the decode launch (default: `gemv_config` below DECODE_TILES_MIN_M rows, the
            DECODE_TILE tiles from there; a `GemvConfig`, or `RowsConfig` at M = 1, forces the GEMV).
        invariant: the batch-invariant mode (README "Batch-invariant mode"): M <= GEMV_MAX_M runs
            `_invariant_gemv` (`invariant_config`, 16-row tiles, `invariant_split`), so a decode row's output is
            bitwise independent of M and of the other rows; M > GEMV_MAX_M (a prefill) the "triton" tiles, whose
            tile shape (128 x 128, no split-K) is the same for every M, so a prefill row's output is bitwise
            independent of how many rows (> GEMV_MAX_M) share the call. gemv and prefill must be None.
    Returns: [M, N] bf16. Never synchronises with the device (CUDA-graph capturable).
    Raises: ValueError naming the wrong argument (shape, dtype, layout, device, unknown prefill method, gemv or
    prefill given with invariant=True).
    """
    op = "fp8_linear"
    M, N, K = check_fp8_linear_args(op, x, weight, scale)
    if invariant and (gemv is not None or prefill is not None):
        _fail(op, "gemv / prefill", repr((gemv, prefill)), "None with invariant=True (the mode fixes the launch)")
    method = prefill_method(M, N, K, x.device) if prefill is None else prefill
    if method not in PREFILL_METHODS:
        _fail(op, "prefill", repr(prefill), f"one of {PREFILL_METHODS}")
    if method == "scaled_mm" and M > GEMV_MAX_M and (M % 4 or (K // BLOCK) % 4):
        _fail(op, "x", f"shape {(M, K)}", "M and K/128 multiples of 4 for prefill='scaled_mm' (CUTLASS blockwise)")
    if out is None:
        out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    elif not isinstance(out, torch.Tensor) or tuple(out.shape) != (M, N) or out.dtype != torch.bfloat16:
        _fail(op, "out", f"{getattr(out, 'dtype', type(out))} {tuple(getattr(out, 'shape', ()))}", f"bf16 {(M, N)}")
    check_layout(op, {"x": x, "weight": weight, "scale": scale, "out": out})
    mma = mma_mode(mma)
    if gemv is not None and M > GEMV_MAX_M:
        _fail(op, "gemv", repr(gemv), f"None for M = {M} > GEMV_MAX_M = {GEMV_MAX_M} (the decode launch only)")
    if prefill is not None and M <= GEMV_MAX_M:
        _fail(op, "prefill", repr(prefill), f"None for M = {M} <= GEMV_MAX_M = {GEMV_MAX_M} (the decode GEMV runs)")
    if M == 0:
        return out
    KB = K // BLOCK
    ws = scale.view(torch.uint8)
    if invariant and M <= GEMV_MAX_M:
        _invariant_gemv(x, weight, ws, out, M, N, K, 1, mma, True)
        return out
    if invariant:
        method = "triton"  # the prefill tiles: one fixed tile shape, no split-K (below)
    if M <= GEMV_MAX_M and gemv is None and M >= DECODE_TILES_MIN_M:
        return _fp8_tiles(*act_quant(x), weight, ws, out, mma, DECODE_TILE)
    if M <= GEMV_MAX_M:
        cfg = _check_gemv_config(op, gemv_config(M, N, K, 1, x.device) if gemv is None else gemv, M, 1)
        _gemv_launch(x, weight, ws, out, M, N, K, 1, mma, True, cfg)
        return out
    if method == "dequant":
        xq, _ = act_quant(x, sim=True)
        torch.mm(xq, fp8_dequant(weight, scale).T, out=out)
        return out
    q, sx = act_quant(x)
    if method == "triton":
        return _fp8_tiles(q, sx, weight, ws, out, mma, PREFILL_TILE)
    return _scaled_mm(q, sx, weight, scale, out)


def _fp8_tiles(q: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, ws: torch.Tensor, out: torch.Tensor,
               mma: int, tile: dict) -> torch.Tensor:
    """One `_fp8_gemm_kernel` launch on act_quant's codes q [M, K] / scales sx [M, K/128] writing out [M, N]: tile =
    DECODE_TILE or PREFILL_TILE (BM, BN, GROUP_M and the launch options). Returns out."""
    M, K = q.shape
    N = weight.shape[0]
    grid = (triton.cdiv(M, tile["BM"]) * triton.cdiv(N, tile["BN"]),)
    _fp8_gemm_kernel[grid](q, sx, weight, ws, out, M, N, K, K // BLOCK, MMA=mma, **tile)
    return out


def fp8_grouped_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int, *,
                     mma: str | None = None, gemv: GemvConfig | RowsConfig | None = None,
                     invariant: bool = False) -> torch.Tensor:
    """Grouped weight-only FP8 linear for few rows (decode `wo_a`, spec §5: used in bf16 WITHOUT activation
    quantization, pitfall 17): y[m, g, :] = x[m, g, :] . W_g^T, with W_g = weight[g*N:(g+1)*N] dequantized
    (e4m3 code x 2^(s-127) per 128x128 block), fp32 accumulation, bf16 out. The same maths as
    `grouped_linear_ref` in bf16 mode (x bf16 and the dequantized weight are exact in bf16, products
    exact in fp32), up to summation order; one launch, no host sync (CUDA-graph capturable).

    Args: x [M, G*K] bf16 contiguous, M <= GEMV_MAX_M; weight [G*N, K] float8_e4m3fn; scale [G*N/128, K/128]
    float8_e8m0fnu; groups = G; N and K multiples of 128. mma: "fp8" | "bf16" as `mma_mode` (the activation is
    not on the e4m3 grid, so an "fp8" request runs the bf16 tensor-core dot; the interpreter its exact fp32 dot).
    gemv: the launch (default `gemv_config`; `GemvConfig`, prequant not allowed, or `RowsConfig` at M = 1).
    invariant: the batch-invariant launch (`_invariant_gemv`, as `fp8_linear`), any M (the prefill's wo_a in
    the mode too); gemv must be None.
    Returns: [M, G*N] bf16.
    Raises: ValueError naming the wrong argument (shape, dtype, layout, device, groups, M, gemv with invariant).
    """
    op = "fp8_grouped_gemv"
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        _fail(op, "groups", repr(groups), "an int >= 1")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] % groups:
        _fail(op, "weight", f"shape {tuple(getattr(weight, 'shape', ()))}", f"[G*N, K] with G={groups}")
    N = weight.shape[0] // groups
    K = weight.shape[1]
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != groups * K:
        _fail(op, "x", f"shape {tuple(getattr(x, 'shape', ()))}", f"[M, {groups * K}] (G*K)")
    M = x.shape[0]
    if M > GEMV_MAX_M and not invariant:
        _fail(op, "x", f"{M} rows", f"at most GEMV_MAX_M = {GEMV_MAX_M} (decode; any M with invariant=True)")
    if N == 0 or N % BLOCK:
        _fail(op, "weight", f"N = {N} rows per group", "a positive multiple of 128 (one scale row per 128 rows)")
    check_layout(op, {"x": x, "weight": weight, "scale": scale})
    check_fp8_linear_args(op, x.view(M * groups, K), weight, scale)
    mode = mma_mode(mma)
    mode = 1 if mode == 2 else mode
    out = torch.empty(M, groups * N, dtype=torch.bfloat16, device=x.device)
    if invariant and gemv is not None:
        _fail(op, "gemv", repr(gemv), "None with invariant=True (the mode fixes the launch)")
    if M == 0:
        return out
    if invariant:
        _invariant_gemv(x, weight, scale.view(torch.uint8), out, M, N, K, groups, mode, False)
        return out
    cfg = _check_gemv_config(op, gemv_config(M, N, K, groups, x.device) if gemv is None else gemv, M, groups)
    _gemv_launch(x, weight, scale.view(torch.uint8), out, M, N, K, groups, mode, False, cfg)
    return out


def _scaled_mm(q: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               out: torch.Tensor) -> torch.Tensor:
    """torch's blockwise FP8 GEMM (CUTLASS): x scales BlockWise1x128 [M, K/128] outer-dim-major, weight scales
    BlockWise128x128 [K/128, ceil(N/128)] (fp32, exact copies of the ue8m0 powers of two). The layout torch 2.11
    accepts on sm_90 (probed by benchmarks/bench_gemm.py); M and K/128 must be multiples of 4 (`fp8_linear` checks)."""
    sw = numerics.e8m0_to_float(scale)
    y = F.scaled_mm(q, weight.t(), sx.t().contiguous().t(), F.ScalingType.BlockWise1x128, sw.t(),
                    F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
    out.copy_(y)
    return out


# ---------------------------------------------------------------------------------------------------------
# The triton backend's entries (signatures of `linear_ref` / `grouped_linear_ref`; table in dsv4/backend.py)
# ---------------------------------------------------------------------------------------------------------

def _bf16_weight(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """[out, in] bf16 weight: a bf16 weight as it is, FP8 codes dequantized by the Triton kernel (`fp8_dequant`,
    exact; in % 128 == 0), other codes by `dequantize_ref` (exact)."""
    if weight.dtype == torch.float8_e4m3fn and weight.shape[1] % BLOCK == 0:
        return fp8_dequant(weight, scale)
    return dequantize_ref(weight, scale, torch.bfloat16)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, act_block: int = 0,
           fp32: bool = False) -> torch.Tensor:
    """The triton backend's `linear` entry (every `dsv4.model.Linear.forward`; spec §2), the signature and dtype
    contract of `linear_ref`: x [..., in], the weight as held (+ scale), act_block, fp32 -> [..., out] (fp32 for
    fp32 linears, x.dtype otherwise). Paths (dsv4/backend.py table): fp32 -> `kernels.fp32_linear.fp32_linear_op`;
    x not bf16 (the exact mode) -> `linear_ref`; FP8 codes with act_block and in % 128 == 0 -> `fp8_linear`;
    otherwise act quantization (the `act_quant` kernel at in % 128 == 0, `numerics.act_quant_sim` below) and a
    bf16 GEMM with fp32 accumulation on the exact bf16 weight (`_bf16_weight`). Above 64 rows both run at the
    bucketed row count of `kernels.launch.bucketed_gemm` (issue 29: a bounded set of cuBLAS shapes, all met by
    `dsv4.warmup`).
    act_block: as `linear_ref` (an int >= 0; the model passes 128, the row width below 128, or 0). Every value is
    honoured: 128 on a width that is a multiple of 128 runs the FP8 kernels above; any other block (the row
    width below 128, or a block the model does not pass such as 64) runs `numerics.act_quant_sim(x, act_block)`
    (the reference's quantizer) before the bf16 GEMM, so the result is `linear_ref`'s for every act_block.
    Raises: ValueError naming the argument: fp32 not a bool, act_block not an int >= 0 (a bool included), x not
    a float tensor or not as wide as the weight's in-features, scale None beside FP8 / FP4 codes, and the
    kernels' / `linear_ref`'s / `numerics`' argument checks (a width that is no multiple of act_block)."""
    op = "linear"
    check_linear_flags(op, act_block, fp32)
    if fp32:
        return fp32_linear_op(x, weight)
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() < 1:
        _fail(op, "x", f"{getattr(x, 'dtype', type(x))} shape {tuple(getattr(x, 'shape', ()))}",
              "a float tensor [..., in]")
    if x.dtype != torch.bfloat16:
        return linear_ref(x, weight, scale, act_block)
    if isinstance(weight, torch.Tensor) and weight.dtype in (torch.float8_e4m3fn, torch.int8) and scale is None:
        _fail(op, "scale", "None", f"the float8_e8m0fnu scales of the {weight.dtype} weight "
              f"{tuple(weight.shape)} (FP8 / FP4 codes need their scales)")
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        width = weight.shape[1] * (2 if weight.dtype == torch.int8 else 1)
        if x.shape[-1] != width:
            _fail(op, "x", f"width {x.shape[-1]} (shape {tuple(x.shape)})",
                  f"the weight's in-features {width} (weight {tuple(weight.shape)} {weight.dtype})")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    k = shape[-1]
    if weight.dtype == torch.float8_e4m3fn and act_block == BLOCK and k % BLOCK == 0:
        if x2.shape[0] < GEMM_MIN_ROWS:  # the decode GEMV (no cuBLAS, nothing to bucket)
            y = fp8_linear(x2, weight, scale)
        else:
            y = bucketed_gemm(lambda xp: fp8_linear(xp, weight, scale), x2, ("fp8_linear", tuple(weight.shape)))
    else:
        if act_block == BLOCK and k % BLOCK == 0:
            x2 = act_quant(x2, sim=True)[0]
        elif act_block:  # the row width below 128 (or any other block): the reference's quantizer
            x2 = numerics.act_quant_sim(x2, act_block)
        w = _bf16_weight(weight, scale)
        y = bucketed_gemm(lambda xp: xp @ w.T, x2, ("bf16_mm", tuple(w.shape)))
    return y.view(*shape[:-1], y.shape[-1])


def fp8_gemv_swiglu(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, limit: float, *,
                    gemv: RowsConfig | None = None) -> torch.Tensor:
    """The shared expert's joint projection and its SwiGLU in ONE launch at one row (issue 27):
    h = silu(min(u, limit)) * clamp(v, -limit, limit) with [u | v] = `fp8_linear(x, weight, scale)` rounded to bf16
    (spec §8.5; `kernels.moe.swiglu_joint_ref(fp8_linear_ref(...), limit)`), by `_fp8_gemv_rows_kernel` with
    SWIGLU: each program computes the same rows of u and v and the SwiGLU in its epilogue - bitwise `fp8_linear`
    (its one-row launch) followed by `kernels.moe.swiglu_joint`.

    Args: x [1, K] bf16 contiguous, K % 128 == 0; weight [2I, K] float8_e4m3fn (`dsv4.model.join_fp8` of w1, w3),
        I % 128 == 0; scale [2I/128, K/128] float8_e8m0fnu; limit >= 0 (swiglu_limit, 0 = no clamp); gemv: the
        RowsConfig (default `gemv_config(1, 2I, K, 1)`).
    Returns: h [1, I] bf16. No host sync.
    Raises: ValueError naming the wrong argument (x not one row, an odd or unaligned weight, limit, gemv)."""
    op = "fp8_gemv_swiglu"
    M, N2, K = check_fp8_linear_args(op, x, weight, scale)
    if M != 1:
        _fail(op, "x", f"shape {tuple(x.shape)}", "one row [1, K] (the one-row GEMV; more rows: fp8_linear + "
              "swiglu_joint)")
    if N2 % (2 * BLOCK):
        _fail(op, "weight", f"shape {tuple(weight.shape)}", f"[2I, K] with I % {BLOCK} == 0 (w1 and w3 joined)")
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit >= 0:
        _fail(op, "limit", repr(limit), "a float >= 0 (swiglu_limit; 0 = no clamp)")
    check_layout(op, {"x": x, "weight": weight, "scale": scale})
    if gemv is not None and not isinstance(gemv, RowsConfig):
        _fail(op, "gemv", repr(gemv), "None or a RowsConfig (the one-row launch)")
    cfg = gemv_config(1, N2, K, 1, x.device) if gemv is None else _check_rows_config(op, gemv, 1)
    I, KB = N2 // 2, K // BLOCK
    h = torch.empty(1, I, dtype=torch.bfloat16, device=x.device)
    _fp8_gemv_rows_kernel[(triton.cdiv(I, cfg.bn), 1)](x, weight, scale.view(torch.uint8), h, I, K, 1, KB,
                                                       BN=cfg.bn, BKB=cfg.bkb, QUANT_X=True,
                                                       MMA=0 if mma_mode(None) == 0 else 1,
                                                       EVEN=I % cfg.bn == 0 and KB % cfg.bkb == 0,
                                                       limit=float(limit), SWIGLU=True, HAS_LIMIT=limit > 0,
                                                       num_warps=cfg.num_warps)
    return h


def grouped_linear(o: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The triton backend's `grouped_linear` entry (the grouped `wo_a`, spec §5), the signature of
    `grouped_linear_ref`: o [b, s, G, i], wo_a as held [G*o, i] (+ scale) -> [b, s, G, o] in o.dtype. FP8 codes at
    b*s <= GEMV_MAX_M and i, o multiples of 128 -> `fp8_grouped_gemv` (one launch, no act quant); other bf16 ->
    the exact bf16 weight (`_bf16_weight`) and a bf16 bmm with fp32 accumulation (at the bucketed row count of
    `kernels.launch.bucketed_gemm`); fp32 (the exact mode) ->
    `grouped_linear_ref`.
    Raises: ValueError naming the argument: o not a float [b, s, G, i] tensor, a weight whose dequantized shape is
    not [G*o, i] (`check_grouped_linear_args`), and the kernels' / `dequantize_ref`'s argument checks."""
    b, s, G, i, n = check_grouped_linear_args("grouped_linear", o, weight)
    if o.dtype != torch.bfloat16:
        return grouped_linear_ref(o, weight, scale)
    if weight.dtype == torch.float8_e4m3fn and b * s <= GEMV_MAX_M and i % BLOCK == 0 and n % BLOCK == 0:
        y = fp8_grouped_gemv(o.reshape(b * s, G * i).contiguous(), weight, scale, G)
        return y.view(b, s, G, n)
    w = _bf16_weight(weight, scale).view(G, n, i)                        # [G, o, i]

    def gemm(o2: torch.Tensor) -> torch.Tensor:                          # [M, G, i] -> [M, G, o]
        return torch.bmm(o2.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)

    z = bucketed_gemm(gemm, o.reshape(b * s, G, i), ("grouped_bmm", tuple(w.shape)))
    return z.reshape(b, s, G, -1)
