"""The grouped FP4 MoE kernels as shipped before issue 13's rewrite (commit a25eefc), kept ONLY so that
benchmarks/bench_gemm.py can time "before" and "after" in one run. Not imported by dsv4 or kernels; not tested.
Original module docstring follows.

Grouped routed-expert MoE over FP4 (e2m1 + ue8m0 per 32) experts: one launch per projection for all experts.

Spec: `dsv4_reference_spec.md` §8 step 5-6 and §2 (FP4 weights, act_quant before every FP4 GEMM). Per (token t,
slot j) pair with expert e = indices[t, j] and routing weight g = weights[t, j]:
    u = bf16(act_quant_sim(x_t) . W1_e^T),  v = bf16(act_quant_sim(x_t) . W3_e^T)      (fp32 accumulation)
    limit > 0: v = clamp(v, -limit, limit), u = min(u, limit)
    h = bf16(silu(u) * v * g)                                                            (fp32)
    y_pair = bf16(act_quant_sim(h) . W2_e^T)
    y_t = sum_j y_pair[t, j]                                                             (fp32, returned)
exactly what `dsv4.model.Expert` (Linear outputs rounded to bf16) and `MoE.forward` (fp32 index_add) compute;
the shared expert and the final bf16 cast stay with the caller.

Reading order (STYLE §1): `moe_grouped_ref`, routing (`moe_route`, plain torch, sync-free), the kernels, the
launchers, `stack_experts`.

Plan (vLLM fused_moe, STYLE §14): `moe_route` sorts the T*k pairs by expert on the device and pads each expert's
run to the row tile BM; rows are `row_pair[r]` (pair index or -1), tiles `tile_expert[i]` (E = unused tile).
Every shape is static (`n_tiles = cdiv(P, BM) + min(E, P)` bounds the padded tiles), nothing reads back to the
host, so the whole thing can be captured in a CUDA graph. `_moe_up_kernel` (grid tiles x I-blocks) gathers its
tokens' rows of x, act-quantizes them in registers, widens the FP4 tiles of W1 and W3 of the tile's expert to
e4m3 per 32-input group (as the official Hopper path: e2m1 * 2^-6 is exact in e4m3, the group's ue8m0 scale
applied to the fp32 group product), runs both dots and the SwiGLU epilogue (clamps, routing
weight) and writes h [rows, I] bf16. `_moe_down_kernel` (grid tiles x D-blocks) act-quantizes h and writes y_pair
[P, D] bf16 scattered to pair order. A tile whose expert has no tokens is never launched work; an expert's bytes
are read only by its own tiles, so decode reads only the selected experts.

Dimension legend: T tokens, k slots per token (top-k), P = T*k pairs, E experts, D model width (w1/w3 input,
w2 output), I = moe_inter_dim; D and I multiples of 128 (act_quant blocks).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.gemm import act_apply, act_scale, dot_q_w, e8m0_to_f32, mma_mode, round_bf16
from kernels.launch import check_layout
from kernels.launch import fail as _fail


class MoeRoute(NamedTuple):
    """Device-side routing of `moe_route`: row_pair [n_tiles * block_m] int32 (pair index t*k + j, or -1 for a
    padding row), tile_expert [n_tiles] int32 (the tile's expert; n_experts for an unused tile), block_m."""
    row_pair: torch.Tensor
    tile_expert: torch.Tensor
    block_m: int


class StackedExperts(NamedTuple):
    """Routed experts of one layer stacked on a leading E axis (on-disk formats, spec §2):
    w1, w3 int8 [E, I, D/2] (e2m1 pairs, low nibble = even column), s1, s3 float8_e8m0fnu [E, I, D/32],
    w2 int8 [E, D, I/2], s2 float8_e8m0fnu [E, D, I/32]."""
    w1: torch.Tensor
    s1: torch.Tensor
    w3: torch.Tensor
    s3: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor


def _check_experts(op: str, ex: StackedExperts) -> tuple[int, int, int]:
    """(E, D, I) of a StackedExperts; raises ValueError naming the wrong field."""
    if not isinstance(ex, StackedExperts):
        _fail(op, "experts", type(ex).__name__, "a kernels.moe.StackedExperts")
    for name in ("w1", "w3", "w2"):
        t = getattr(ex, name)
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.dtype != torch.int8:
            _fail(op, name, f"{getattr(t, 'dtype', type(t))} shape {tuple(getattr(t, 'shape', ()))}",
                  "int8 [E, out, in/2] (packed e2m1)")
    E, I, half = ex.w1.shape
    D = 2 * half
    if D % 128 or I % 128:
        _fail(op, "w1", f"shape {tuple(ex.w1.shape)} (D={D}, I={I})", "D and I multiples of 128 (act_quant blocks)")
    want = {"w1": (E, I, D // 2), "w3": (E, I, D // 2), "w2": (E, D, I // 2),
            "s1": (E, I, D // 32), "s3": (E, I, D // 32), "s2": (E, D, I // 32)}
    for name, shape in want.items():
        t = getattr(ex, name)
        if tuple(t.shape) != shape:
            _fail(op, name, f"shape {tuple(t.shape)}", f"{shape}")
        if name[0] == "s" and t.dtype != torch.float8_e8m0fnu:
            _fail(op, name, f"dtype {t.dtype}", "torch.float8_e8m0fnu (ue8m0 per 32 inputs)")
    return E, D, I


def _check_routing(op: str, x, weights, indices, D: int) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != D:
        _fail(op, "x", f"{getattr(x, 'dtype', type(x))} shape {tuple(getattr(x, 'shape', ()))}", f"bf16 [T, {D}]")
    T = x.shape[0]
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2 or indices.shape[0] != T or \
            indices.dtype not in (torch.int32, torch.int64):
        _fail(op, "indices", f"{getattr(indices, 'dtype', type(indices))} shape "
              f"{tuple(getattr(indices, 'shape', ()))}", f"int32/int64 [{T}, k]")
    k = indices.shape[1]
    if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (T, k) or weights.dtype != torch.float32:
        _fail(op, "weights", f"{getattr(weights, 'dtype', type(weights))} shape "
              f"{tuple(getattr(weights, 'shape', ()))}", f"float32 [{T}, {k}]")
    return T, k


# ---------------------------------------------------------------------------------------------------------
# Reference (plain torch): the executable spec
# ---------------------------------------------------------------------------------------------------------

def moe_grouped_ref(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: StackedExperts,
                    limit: float) -> torch.Tensor:
    """Routed experts as `dsv4.model.MoE` computes them in bf16 mode (spec §8.5-6; module docstring formulas).

    Args: x [T, D] bf16; weights [T, k] fp32 (routing weights, already normalised and scaled); indices [T, k]
    int32/int64 expert ids in [0, E); experts: StackedExperts; limit: swiglu_limit (0 = no clamp).
    Returns: [T, D] fp32 = sum over slots of each slot's bf16 expert output. Loops over the experts present
    (host sync; a reference). Raises ValueError on wrong shapes/dtypes or an index outside [0, E).
    """
    from dsv4 import quant
    op = "moe_grouped_ref"
    E, D, I = _check_experts(op, experts)
    T, k = _check_routing(op, x, weights, indices, D)
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= E):
        _fail(op, "indices", f"range [{int(indices.min())}, {int(indices.max())}]", f"ids in [0, {E})")
    y = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    xq = quant.act_quant_sim(x, 128).float()
    for e in indices.unique().tolist():
        tok, slot = (indices == e).nonzero(as_tuple=True)
        w1, w3, w2 = (quant.fp4_dequant(getattr(experts, f"w{i}")[e], getattr(experts, f"s{i}")[e])
                      for i in (1, 3, 2))
        u = (xq[tok] @ w1.T).to(torch.bfloat16).float()
        v = (xq[tok] @ w3.T).to(torch.bfloat16).float()
        if limit > 0:
            v = v.clamp(-limit, limit)
            u = u.clamp(max=limit)
        h = (torch.nn.functional.silu(u) * v * weights[tok, slot, None]).to(torch.bfloat16)
        out = (quant.act_quant_sim(h, 128).float() @ w2.T).to(torch.bfloat16)
        y.index_add_(0, tok, out.float())
    return y


# ---------------------------------------------------------------------------------------------------------
# Routing (plain torch, sync-free, static shapes)
# ---------------------------------------------------------------------------------------------------------

def moe_route(indices: torch.Tensor, n_experts: int, block_m: int) -> MoeRoute:
    """Sort the P = T*k (token, slot) pairs by expert and pad every expert's run to `block_m` rows, on the device.

    Returns MoeRoute with n_tiles = cdiv(P, block_m) + min(E, P) (an upper bound of sum_e cdiv(count_e, block_m)),
    so every shape depends on (T, k, E, block_m) only. No host sync: sort, scatter_add, cumsum, searchsorted.
    An id outside [0, E) trips the device-side index assert of scatter_add (never a silent wrong row).
    """
    P = indices.numel()
    dev = indices.device
    flat = indices.reshape(-1).to(torch.int64)
    n_tiles = -(-P // block_m) + min(n_experts, P)
    sorted_e, order = torch.sort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pend = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    dest = (pend - padded)[sorted_e] + torch.arange(P, device=dev) - start[sorted_e]
    row_pair = torch.full((n_tiles * block_m,), -1, dtype=torch.int32, device=dev)
    row_pair.scatter_(0, dest, order.to(torch.int32))
    tile_start = torch.arange(n_tiles, device=dev, dtype=torch.int64) * block_m
    tile_expert = torch.searchsorted(pend, tile_start, right=True).to(torch.int32)
    return MoeRoute(row_pair, tile_expert, block_m)


# ---------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------

@triton.jit
def _split4(t, R: tl.constexpr):
    """[R, 128] -> the four [R, 32] column groups 0..3 (reshape / permute / split; no memory traffic)."""
    t = tl.permute(tl.reshape(t, (R, 2, 2, 32)), (0, 3, 1, 2))  # [R, 32, g // 2, g % 2]
    a, b = tl.split(t)
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _split4s(s, R: tl.constexpr):
    """[R, 4] -> its four columns, each [R]."""
    a, b = tl.split(tl.reshape(s, (R, 2, 2)))
    s0, s2 = tl.split(a)
    s1, s3 = tl.split(b)
    return s0, s1, s2, s3


@triton.jit
def _e4m3(c):
    return c.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _fp4_kblock(q, sx, wb, ws, R: tl.constexpr, BN: tl.constexpr, MMA: tl.constexpr):
    """One 128-input block of `act_quant(x) . W^T` for FP4 W, as the official Hopper path widens it (spec §2):
    q [R, 128] fp32 on the e4m3 grid with row scales sx [R]; wb [BN, 64] packed bytes; ws [BN, 4] ue8m0 bytes.

    Each nibble's 3 magnitude bits moved to bits 2-4 of an e4m3 byte and its sign to bit 7 give exactly the e4m3
    number e2m1 * 2^-6 (normal for e >= 1, the e4m3 subnormal 2^-7 for 0.5): ~3.5 integer ops per weight, no
    multiply. Low nibble = even column (join + reshape). Per 32-input group j: `dot(q_j, w_j) * 2^(s_j-127) * 2^6`
    in fp32; the sum of the four times sx. Returns [R, BN] fp32."""
    b = wb.to(tl.int32)
    lo = ((b & 7) << 2) | ((b & 8) << 4)
    hi = ((b >> 2) & 0x1C) | (b & 0x80)
    w0, w1, w2, w3 = _split4(tl.reshape(tl.join(lo, hi), (BN, 128)), BN)
    s0, s1, s2, s3 = _split4s(e8m0_to_f32(ws.to(tl.int32) & 0xFF) * 64.0, BN)
    q0, q1, q2, q3 = _split4(q, R)
    acc = dot_q_w(q0, _e4m3(w0), MMA) * s0[None, :]
    acc += dot_q_w(q1, _e4m3(w1), MMA) * s1[None, :]
    acc += dot_q_w(q2, _e4m3(w2), MMA) * s2[None, :]
    acc += dot_q_w(q3, _e4m3(w3), MMA) * s3[None, :]
    return acc * sx[:, None]


@triton.jit
def _fp4_load(w_ptr, s_ptr, rows64, kb, KH, KS, wmask):
    """K block `kb` (128 inputs) of the FP4 rows `rows64`: packed e2m1 codes [BN, 64] int8 (two per byte) and
    their ue8m0 scales [BN, 4] (one per 32 inputs); masked rows read code 0 and scale 127 (= 1.0)."""
    codes = tl.load(w_ptr + rows64[:, None] * KH + kb * 64 + tl.arange(0, 64)[None, :], mask=wmask, other=0)
    scales = tl.load(s_ptr + rows64[:, None] * KS + kb * 4 + tl.arange(0, 4)[None, :], mask=wmask, other=127)
    return codes, scales


@triton.jit
def _moe_up_kernel(x_ptr, g_ptr, row_pair_ptr, tile_e_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr,
                   E, D, I, K_SLOTS, limit,
                   HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, MMA: tl.constexpr):
    """h[r, n] for the BM rows of tile program_id(0) and I-columns program_id(1)*BN.. (module docstring).
    The next K block's weight bytes and scales are loaded before the current block is computed (prefetch)."""
    tile = tl.program_id(0)
    e = tl.load(tile_e_ptr + tile)
    if e < E:
        offs_r = tile * BM + tl.arange(0, BM)
        pair = tl.load(row_pair_ptr + offs_r)
        valid = pair >= 0
        tok = tl.where(valid, pair // K_SLOTS, 0).to(tl.int64)
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        mask_n = offs_n < I
        rows64 = e.to(tl.int64) * I + offs_n
        offs_k = tl.arange(0, 128)
        KH = D // 2
        KS = D // 32
        KB = D // 128
        wmask = mask_n[:, None]
        w1b, s1b = _fp4_load(w1_ptr, s1_ptr, rows64, 0, KH, KS, wmask)
        w3b, s3b = _fp4_load(w3_ptr, s3_ptr, rows64, 0, KH, KS, wmask)
        u = tl.zeros((BM, BN), dtype=tl.float32)
        v = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, KB):
            kn = tl.minimum(kb + 1, KB - 1)  # the last iteration re-loads its own block (cached, unused)
            w1n, s1n = _fp4_load(w1_ptr, s1_ptr, rows64, kn, KH, KS, wmask)
            w3n, s3n = _fp4_load(w3_ptr, s3_ptr, rows64, kn, KH, KS, wmask)
            x = tl.load(x_ptr + tok[:, None] * D + kb * 128 + offs_k[None, :], mask=valid[:, None],
                        other=0.0).to(tl.float32)
            inv, sx = act_scale(x)
            q = act_apply(x, inv)
            u += _fp4_kblock(q, sx, w1b, s1b, BM, BN, MMA)
            v += _fp4_kblock(q, sx, w3b, s3b, BM, BN, MMA)
            w1b, w3b, s1b, s3b = w1n, w3n, s1n, s3n
        u = round_bf16(u)
        v = round_bf16(v)
        if HAS_LIMIT:
            v = tl.minimum(tl.maximum(v, -limit), limit)
            u = tl.minimum(u, limit)
        g = tl.load(g_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0)
        h = u * tl.sigmoid(u) * v * g[:, None]
        tl.store(h_ptr + offs_r.to(tl.int64)[:, None] * I + offs_n[None, :], round_bf16(h).to(tl.bfloat16),
                 mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, row_pair_ptr, tile_e_ptr, w2_ptr, s2_ptr, y_ptr, E, D, I,
                     BM: tl.constexpr, BN: tl.constexpr, MMA: tl.constexpr):
    """y_pair[pair, n] = bf16(act_quant_sim(h_row) . W2_e[n]) for the tile's rows, D-columns program_id(1)*BN..
    (next K block prefetched as in `_moe_up_kernel`)."""
    tile = tl.program_id(0)
    e = tl.load(tile_e_ptr + tile)
    if e < E:
        offs_r = tile * BM + tl.arange(0, BM)
        pair = tl.load(row_pair_ptr + offs_r)
        valid = pair >= 0
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        mask_n = offs_n < D
        rows64 = e.to(tl.int64) * D + offs_n
        offs_k = tl.arange(0, 128)
        KH = I // 2
        KS = I // 32
        KB = I // 128
        wmask = mask_n[:, None]
        r64 = offs_r.to(tl.int64)
        wb, sb = _fp4_load(w2_ptr, s2_ptr, rows64, 0, KH, KS, wmask)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, KB):
            kn = tl.minimum(kb + 1, KB - 1)  # the last iteration re-loads its own block (cached, unused)
            wn, sn = _fp4_load(w2_ptr, s2_ptr, rows64, kn, KH, KS, wmask)
            h = tl.load(h_ptr + r64[:, None] * I + kb * 128 + offs_k[None, :], mask=valid[:, None],
                        other=0.0).to(tl.float32)
            inv, sh = act_scale(h)
            acc += _fp4_kblock(act_apply(h, inv), sh, wb, sb, BM, BN, MMA)
            wb, sb = wn, sn
        p64 = tl.where(valid, pair, 0).to(tl.int64)
        tl.store(y_ptr + p64[:, None] * D + offs_n[None, :], round_bf16(acc).to(tl.bfloat16),
                 mask=valid[:, None] & mask_n[None, :])


# ---------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------

def _tiles(P: int) -> tuple[int, int]:
    """(BM, BN): 16-row tiles while P <= 256 pairs (decode: most tiles hold 1-2 rows), else 64; N blocks of 64
    weight rows (each K block then loads 4 KiB of FP4 bytes per projection, prefetched one block ahead)."""
    return (16, 64) if P <= 256 else (64, 64)


def moe_up(x: torch.Tensor, weights: torch.Tensor, route: MoeRoute, experts: StackedExperts, limit: float,
           block_n: int, mma: str | None = None) -> torch.Tensor:
    """h [n_tiles * BM, I] bf16 of `_moe_up_kernel`; rows with row_pair = -1 are left unwritten (never read)."""
    E, D, I = _check_experts("moe_up", experts)
    h = torch.empty(route.row_pair.numel(), I, dtype=torch.bfloat16, device=x.device)
    grid = (route.tile_expert.numel(), triton.cdiv(I, block_n))
    u8 = lambda t: t.view(torch.uint8)  # noqa: E731 - ue8m0 bytes
    _moe_up_kernel[grid](x, weights, route.row_pair, route.tile_expert, experts.w1, u8(experts.s1), experts.w3,
                         u8(experts.s3), h, E, D, I, weights.shape[1], float(limit), HAS_LIMIT=limit > 0,
                         BM=route.block_m, BN=block_n, MMA=mma_mode(mma), num_warps=4)
    return h


def moe_down(h: torch.Tensor, route: MoeRoute, experts: StackedExperts, n_pairs: int, block_n: int,
             mma: str | None = None) -> torch.Tensor:
    """y_pair [n_pairs, D] bf16 of `_moe_down_kernel` (every pair's row written once)."""
    E, D, I = _check_experts("moe_down", experts)
    y = torch.empty(n_pairs, D, dtype=torch.bfloat16, device=h.device)
    grid = (route.tile_expert.numel(), triton.cdiv(D, block_n))
    _moe_down_kernel[grid](h, route.row_pair, route.tile_expert, experts.w2, experts.s2.view(torch.uint8), y,
                           E, D, I, BM=route.block_m, BN=block_n, MMA=mma_mode(mma), num_warps=4)
    return y


def moe_experts(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: StackedExperts,
                limit: float, *, mma: str | None = None) -> torch.Tensor:
    """Routed experts of one MoE layer in three device steps and no host sync: `moe_route` (torch), the up
    launch (w1, w3, SwiGLU with clamps and routing weight), the down launch (w2), then the fp32 sum over slots.

    Args: x [T, D] bf16; weights [T, k] fp32; indices [T, k] int32/int64 in [0, E) (out of range: device assert);
    experts: StackedExperts (`stack_experts`); limit: swiglu_limit (0 = no clamp); mma: "fp8" | "bf16" dot flavour
    (`kernels.gemm.mma_mode`; same result).
    Returns: [T, D] fp32, equal to `moe_grouped_ref` up to fp32 summation order (see tests for the tolerance).
    Raises: ValueError naming the wrong argument (shape, dtype, layout, device).
    """
    op = "moe_experts"
    E, D, I = _check_experts(op, experts)
    T, k = _check_routing(op, x, weights, indices, D)
    check_layout(op, {"x": x, "weights": weights, "indices": indices, **experts._asdict()})
    if not isinstance(limit, (int, float)) or isinstance(limit, bool) or not limit >= 0:
        _fail(op, "limit", repr(limit), "a float >= 0 (swiglu_limit; 0 = no clamp)")
    P = T * k
    if P == 0:
        return torch.zeros(T, D, dtype=torch.float32, device=x.device)
    BM, BN = _tiles(P)
    route = moe_route(indices, E, BM)
    mma_mode(mma)  # validate before any launch
    h = moe_up(x, weights, route, experts, limit, BN, mma)
    y = moe_down(h, route, experts, P, BN, mma)
    return y.view(T, k, D).float().sum(1)


def stack_experts(experts, *, rebind: bool = True) -> StackedExperts:
    """Stack the FP4 routed experts of one layer (`MoE.experts`: modules with `w1/w2/w3` Linear in fmt "fp4") into
    [E, ...] tensors, once (e.g. after loading).

    Memory: `torch.stack` copies. With `rebind=True` every expert's `weight`/`scale` buffers are then replaced by
    views into the stacked tensors, so the originals are freed and the layer holds its experts once (peak during
    the call: two copies of this layer's routed experts, ~3.2 GB at Flash width). Later `load_state_dict` writes
    through the views. `rebind=False` keeps both copies (2x this layer's expert memory).
    Raises ValueError if an expert is missing (held by another rank) or not stored as "fp4".
    """
    mods = list(experts)
    names = {"w1": ("w1", "s1"), "w3": ("w3", "s3"), "w2": ("w2", "s2")}
    out = {}
    for lin, (wn, sn) in names.items():
        parts_w, parts_s = [], []
        for i, ex in enumerate(mods):
            m = getattr(ex, lin, None) if ex is not None else None
            if m is None or getattr(m, "fmt", None) != "fp4":
                _fail("stack_experts", f"experts[{i}].{lin}", "missing" if m is None else f"fmt {m.fmt!r}",
                      "a Linear held as 'fp4' (Transformer(weights='quantized'))")
            parts_w.append(m._buffers["weight"])
            parts_s.append(m._buffers["scale"])
        out[wn], out[sn] = torch.stack(parts_w), torch.stack(parts_s)
        if rebind:
            for i, ex in enumerate(mods):
                m = getattr(ex, lin)
                m._buffers["weight"], m._buffers["scale"] = out[wn][i], out[sn][i]
    return StackedExperts(out["w1"], out["s1"], out["w3"], out["s3"], out["w2"], out["s2"])
