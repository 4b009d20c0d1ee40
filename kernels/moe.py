"""The routed experts (spec §8.5-6): the model's reference loop, and a grouped MoE over FP4 (e2m1 + ue8m0 per 32)
experts with one launch per projection for all experts.

The reference of the model (`moe_routed_ref`, the reference backend's `moe_routed` entry) is a function of tensors
and plain numbers: the routed experts as a sequence of per-expert `ExpertWeights` (each linear's weight as held:
FP4 / FP8 codes + ue8m0 scales, or a float weight; None for an expert another rank holds, `dsv4.parallel`) or as
one `StackedExperts`, the SwiGLU limit, the two activation-quantization blocks, and the `linear` its GEMMs run
through (`kernels.gemm.linear_ref`, or the triton backend's `kernels.gemm.linear` for its fall-back loop). The
SwiGLU itself is `swiglu`, which `dsv4.model.Expert.forward` (the shared expert) calls too. The triton backend's
entry `moe_routed` runs `moe_experts` on stacked FP4 experts and that reference loop otherwise (table in
`dsv4/backend.py`).

Spec: `dsv4_reference_spec.md` §8 step 5-6 and §2 (FP4 weights, act_quant before every FP4 GEMM). Per (token t,
slot j) pair with expert e = indices[t, j] and routing weight g = weights[t, j]:
    u = bf16(act_quant_sim(x_t) . W1_e^T),  v = bf16(act_quant_sim(x_t) . W3_e^T)      (fp32 accumulation)
    limit > 0: v = clamp(v, -limit, limit), u = min(u, limit)
    h = bf16(silu(u) * v * g)                                                            (fp32)
    y_pair = bf16(act_quant_sim(h) . W2_e^T)
    y_t = sum_j y_pair[t, j]                                                             (fp32, returned)
exactly what `moe_routed_ref` (the model's routed experts: linear outputs rounded to bf16, fp32 index_add)
computes; the shared expert and the final bf16 cast stay with the caller (`dsv4.model.MoE.forward`).

Reading order (STYLE §1): the references (`swiglu`, `moe_routed_ref`, `moe_grouped_ref`), routing (`moe_route`,
plain torch, sync-free), the kernels, the launchers, `stack_experts` / `stackable`, the triton backend's entry
`moe_routed`.

Plan (issue 13 rewrite; vLLM fused_moe for the routing, STYLE §14). x is act-quantized once (the tile path:
`kernels.quant.act_quant_sim(halves=True)`, bf16 [T, D] holding the exact values e4m3 code x 2^k, bitwise
`numerics.act_quant_sim` in the halves layout; the gemv path: below), h likewise after the up launch; the kernels read those exact values.
Two paths, chosen by P = T*k (`GEMV_MAX_PAIRS`, measured) - never by a failure:
  * decode, "gemv": `_moe_up_gemv_kernel` / `_moe_down_gemv_kernel`, grid (P, out / BN): one short program per
    (pair, BN output rows), pairs in pair order: the pair is the grid's fastest axis, so the programs of all pairs
    for one BN block run side by side and pairs that share an expert share its rows through L2 in any order (the
    stable `torch.sort` of the ids that put them in expert order cost 12-31 µs per layer and saved nothing:
    `benchmarks/decode_knobs_probe.py --section order`, RESULTS.md; `order` still accepted). Each program
    runs the whole K loop in chunks of 2*BKH inputs on CUDA cores (software-pipelined where its launch shape has
    2 stages, `GEMV_SHAPES`: the next chunk's weight bytes in flight by cp.async): packed bytes [BN, BKH] decoded
    to exact fp32 values (low nibble = even input, high = odd; x is loaded as its even / odd inputs instead of
    interleaving the weights), FMA with x, a sum per 32-input group times that group's scale, then the SwiGLU epilogue
    (`_swiglu`). The input takes one of three forms with the same values (`moe_up_gemv`): at one token x itself,
    act-quantized in the kernel (`GEMV_QUANT_MAX_T`, two launches fewer); above, act_quant's e4m3 codes and block
    scales (`GEMV_CODES`: x quantized once); both multiply e4m3 code values by e2m1 * 2^-126 (`_fp4_gemv_codes`,
    nibbles decoded packed by PTX or element-wise: `GEMV_QUANT_PACKED_MIN_D`); the third, act_quant_sim's values
    through an fp16 bit pattern (`_fp4_gemv_chunk`), is what K chunks of less than one 128-input block take.
  * prefill, "tiles": `moe_route` sorts the pairs by expert and pads every expert's run to BM rows (static shapes,
    no host sync). `_moe_up_tile_kernel` / `_moe_down_tile_kernel`, grid (out / BN * tiles,): per chunk of 2*BKH
    inputs the FP4 tile is decoded to exact bf16 values e2m1 * 2^(s-127) and multiplied with the gathered rows of
    act-quantized x in TWO tensor-core dots (even and odd inputs; `_fp4_tile_dot`), fp32 accumulation, no per-group
    split. x and h reach the tiles in the halves layout (`kernels.quant.halves`, written by the act_quant_sim launch
    itself): a chunk's even inputs and its odd ones are each contiguous in a row, so the gathered rows load in
    16-byte vectors (a stride-2 gather of 2-byte elements before). The output block is the grid's fastest index (one
    grid axis: a second axis would cap the tiles at 65535), so the programs of one tile's N blocks run side by side
    and can share its gathered rows through L2 (with the tile fastest, the programs running together belonged to
    different tiles, and a tile's rows were fetched again for each of its N blocks - the likely reason for the
    1.11-1.29x per call measured, RESULTS.md eighth session of 2026-12-06; bitwise the same outputs). The tile is
    computed transposed ("swap AB": [BN weight rows, BM token rows]), so the decoded weight is the dot's LHS, held
    in registers by Hopper's wgmma (M = 128 weight rows, N = 32 tokens); the untransposed 32-row tile compiled to
    mma.sync and was 2.2-2.5x slower. A tile whose expert has no pair is never computed; an expert's bytes are read
    only by its own tiles.

Exactness (both paths): every product is exact in fp32 - an e2m1 value has 2 significant bits, an act-quantized
activation 4 (e4m3), and the scales are powers of two (ue8m0 screened for overflow at load:
`dsv4.model.check_dequantized_range`), so each weight value e2m1 * 2^(s-127) is exact in bf16 and fp32, and so is a
product of it with an activation (<= 6 significant bits, no underflow at realistic scales). Only the order of
the fp32 sums differs from `moe_grouped_ref` (and, on the tensor cores, the MMA's internal accumulation), so
the bf16 outputs u, v, h and y_pair differ from the reference at most where a rounding boundary falls between
the two sums: 1 bf16 ulp, in a small fraction of elements (tests/unit/test_gemm_moe_kernels.py). Under
TRITON_INTERPRET=1 the tile path multiplies the same values as fp32 with input_precision="ieee" (triton 3.9's
interpreter bf16 casts and dots are not faithful), and bf16 stores round through `round_bf16`.

`mma` names the nibble decode: None (the default) / "bf16x2" (the FP4 nibbles decoded two per 32-bit op by packed
inline PTX; the tile path: `_e2m1_bf16x2`, bf16 tensor cores, bitwise the element-wise decode's operands and
outputs on the H200, 1.08-1.27x faster per MoE call; the gemv path: fp16 lanes, `_e2m1_f16x2`, `GEMV_PACKED_F16`;
interpreter stand-ins under TRITON_INTERPRET=1), "bf16" (the element-wise decode `_e2m1`; fp32 "ieee" dots under
the interpreter); "fp8" is refused (`_moe_mma`: the per-32 weight scales have no exact one-dot e4m3 form).

Measured on one H200 (benchmarks/RESULTS.md, "Grouped FP4 MoE rewrite" and "swapped tile"): Flash T=1 90 µs per
call (78.5 µs of kernels; 364 µs before), T=1024 4.4 ms (10.2 ms with the untransposed tile, 21 ms before),
T=4096 13.7 ms (33.8 ms); with the tile size by pairs per expert (`TILES_LARGE`, session of 2026-12-04 (2)) T=2048
5.8 ms (7.9 with 32-row tiles), T=4096 9.7 ms. Both miss issue 13's targets (40 µs, 2.1 ms); the nibble decode's
instructions bound both paths (SASS of the sm_90 tile kernel: ~9 instructions per weight, the tensor cores idle).
The packed decode (`_e2m1_bf16x2`, mma "bf16x2": inline PTX, two weights per 32-bit op, the group scale as packed
bf16 multiplies; ~6.5 instructions per weight in SASS, the same operands bitwise) is the default since the H200
checked and timed it: Flash T = 1024 / 4096 4.29 -> 3.55 / 9.74 -> 8.99 ms per call, Pro 15.2 -> 12.6 / 31.0 ->
24.5 ms (benchmarks/RESULTS.md, second session of 2026-12-06; `benchmarks/moe_tile_decode_probe.py`).

Dimension legend: T tokens, k slots per token (top-k), P = T*k pairs, E experts, D model width (w1/w3 input,
w2 output), I = moe_inter_dim; D and I multiples of 128 (act_quant blocks).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the references stay importable without it; launching raises
    triton = None
    tl = None

from kernels import gemm, numerics
from kernels.gemm import act_quant, mma_mode
from kernels.launch import check_layout, interpreting
from kernels.launch import fail as _fail


class MoeRoute(NamedTuple):
    """Device-side routing of `moe_route`: row_pair [n_tiles * block_m] int32 (pair index t*k + j, or -1 for a
    padding row), tile_expert [n_tiles] int32 (the tile's expert; n_experts for an unused tile), block_m."""
    row_pair: torch.Tensor
    tile_expert: torch.Tensor
    block_m: int


class ExpertWeights(NamedTuple):
    """One routed expert's three linears as held (spec §2, §8.5; `dsv4.model.Expert`, `dsv4.model.Linear.codes` /
    `scales`): w1 (gate) and w3 (up) [I, D], w2 (down) [D, I], each FP4 codes int8 [out, in/2] + float8_e8m0fnu
    scale [out, in/32], FP8 codes float8_e4m3fn + float8_e8m0fnu scale [ceil(out/128), ceil(in/128)], or a float
    weight [out, in] with scale None (`kernels.gemm.dequantize_ref` reads all three)."""
    w1: torch.Tensor
    s1: torch.Tensor | None
    w3: torch.Tensor
    s3: torch.Tensor | None
    w2: torch.Tensor
    s2: torch.Tensor | None


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

def swiglu(u: torch.Tensor, v: torch.Tensor, limit: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The SwiGLU of an expert (spec §8.5), on its two projections: u = w1 x (gate), v = w3 x (up), fp32 [N, I] ->
    h = silu(min(u, limit)) * clamp(v, -limit, limit) * weight, fp32 [N, I], the clamps only when limit > 0
    (swiglu_limit; 0 = none). weight: [N, 1] fp32 routing weights of a routed expert, applied here, before w2 and
    its activation quantization (spec §8.5; docs/differences.md difference 4), or None (the shared expert).
    The one definition: `dsv4.model.Expert.forward`, `moe_routed_ref` and `moe_grouped_ref` call it (the kernels'
    `_swiglu` is its Triton form). Raises ValueError for a limit that is not a number >= 0, u and v of different
    shapes (they would broadcast), or a weight that is not one value per row ([N, 1])."""
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit >= 0:
        _fail("swiglu", "limit", repr(limit), "a number >= 0 (swiglu_limit; 0 = no clamp)")
    if not (isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor)) or u.shape != v.shape:
        _fail("swiglu", "u, v", f"shapes {tuple(getattr(u, 'shape', ()))}, {tuple(getattr(v, 'shape', ()))}",
              "two tensors of one shape [N, I] (w1 x and w3 x)")
    if weight is not None and (not isinstance(weight, torch.Tensor) or u.dim() < 1 or
                               tuple(weight.shape) != (*u.shape[:-1], 1)):
        _fail("swiglu", "weight", f"shape {tuple(getattr(weight, 'shape', ()))}",
              f"one routing weight per row: {(*u.shape[:-1], 1)} (u's shape with a last dim of 1)")
    if limit > 0:
        v = v.clamp(-limit, limit)
        u = u.clamp(max=limit)
    h = torch.nn.functional.silu(u) * v
    if weight is not None:
        h = h * weight
    return h


def _check_act_blocks(op: str, act_blocks) -> tuple[int, int]:
    ok = isinstance(act_blocks, (tuple, list)) and len(act_blocks) == 2 and all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in act_blocks)
    if not ok:
        _fail(op, "act_blocks", repr(act_blocks), "(block before w1 / w3, block before w2): two ints >= 0 "
              "(128, the width below 128, or 0 = no activation quantization)")
    return act_blocks[0], act_blocks[1]


def moe_routed_ref(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   experts: Sequence[ExpertWeights | None] | StackedExperts, limit: float,
                   act_blocks: tuple[int, int], *, linear: Callable | None = None) -> torch.Tensor:
    """The routed experts of one MoE layer (spec §8.5-6; the `moe_routed` entry of the reference backend): the sum
    over each token's k slots of g * expert(x), expert e = w2(swiglu(w1 x, w3 x, limit, g)).

    Args:
        x: [N, D] activations (bf16 in the official numerics, fp32 in the exact mode).
        weights: [N, k] fp32 routing weights (normalised and scaled by the gate); ids: [N, k] integer expert ids.
        experts: the layer's E routed experts: a sequence of `ExpertWeights` (None for an expert another rank
            holds, `dsv4.parallel`: its slots are skipped, the other ranks add them), or one `StackedExperts`
            (expert e = the e-th slice of each tensor: the same views the model's experts hold after
            `stack_experts`).
        limit: swiglu_limit (0 = no clamp; `swiglu`).
        act_blocks: (block before w1 / w3, block before w2) of the FP8 activation quantization each GEMM applies
            first: 128, the row width below 128, or 0 (none: the exact mode) - `linear`'s `act_block`.
        linear: the function each of the three GEMMs runs through, with the signature of
            `kernels.gemm.linear_ref(x, weight, scale, act_block, fp32)` (the weight as held, dequantized in x's
            dtype); default `kernels.gemm.linear_ref` (looked up at call time). The triton backend's fall-back
            passes `kernels.gemm.linear`, so the loop computes with that backend's linears exactly what the
            model's `Expert` modules computed through the backend's `linear` before issue 23.
    Returns: [N, D] fp32: each expert's output in x.dtype (as `dsv4.model.Expert.forward`: w1 / w3 outputs
        upcast to fp32 for the SwiGLU, h cast back to x.dtype before w2), summed in fp32 with `index_add_` (a slot
        that repeats an expert counts once per slot: docs/differences.md M5). Loops over the experts present
        (one host sync per expert: readable, not fast).
    Raises: ValueError naming the argument: x not 2-D, weights / ids not [N, k], an id outside [0, E), a bad
        act_blocks or limit; the ValueError of `linear` for a width that is no multiple of its act_block.
    """
    op = "moe_routed_ref"
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        _fail(op, "x", f"shape {tuple(getattr(x, 'shape', ()))}", "[N, D]")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        _fail(op, "ids", f"shape {tuple(getattr(ids, 'shape', ()))}", f"[{x.shape[0]}, k]")
    if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != tuple(ids.shape):
        _fail(op, "weights", f"shape {tuple(getattr(weights, 'shape', ()))}", f"{tuple(ids.shape)} (as ids)")
    up, down = _check_act_blocks(op, act_blocks)
    linear = gemm.linear_ref if linear is None else linear
    stacked = isinstance(experts, StackedExperts)
    E = experts.w1.shape[0] if stacked else len(experts)
    present = ids.unique().tolist()  # sorted
    if present and (present[0] < 0 or present[-1] >= E):
        _fail(op, "ids", f"range [{present[0]}, {present[-1]}]", f"expert ids in [0, {E})")
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in present:
        ex = ExpertWeights(*(t[e] for t in experts)) if stacked else experts[e]
        if ex is None:  # held by another rank (dsv4.parallel)
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        u = linear(xe, ex.w1, ex.s1, up, False).float()
        v = linear(xe, ex.w3, ex.s3, up, False).float()
        h = swiglu(u, v, limit, weights[tok, slot, None])
        y.index_add_(0, tok, linear(h.to(x.dtype), ex.w2, ex.s2, down, False).float())
    return y


def moe_grouped_ref(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: StackedExperts,
                    limit: float) -> torch.Tensor:
    """Routed experts as `moe_routed_ref` computes them on stacked FP4 experts in bf16 mode (spec §8.5-6; module
    docstring formulas; tests/unit/test_gemm_moe_kernels.py checks the two bitwise).

    Args: x [T, D] bf16; weights [T, k] fp32 (routing weights, already normalised and scaled); indices [T, k]
    int32/int64 expert ids in [0, E); experts: StackedExperts; limit: swiglu_limit (0 = no clamp).
    Returns: [T, D] fp32 = sum over slots of each slot's bf16 expert output. Loops over the experts present
    (host sync; a reference). Raises ValueError on wrong shapes/dtypes or an index outside [0, E).
    """
    op = "moe_grouped_ref"
    E, D, I = _check_experts(op, experts)
    T, k = _check_routing(op, x, weights, indices, D)
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= E):
        _fail(op, "indices", f"range [{int(indices.min())}, {int(indices.max())}]", f"ids in [0, {E})")
    y = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    xq = numerics.act_quant_sim(x, 128).float()
    for e in indices.unique().tolist():
        tok, slot = (indices == e).nonzero(as_tuple=True)
        w1, w3, w2 = (numerics.fp4_dequant(getattr(experts, f"w{i}")[e], getattr(experts, f"s{i}")[e])
                      for i in (1, 3, 2))
        u = (xq[tok] @ w1.T).to(torch.bfloat16).float()
        v = (xq[tok] @ w3.T).to(torch.bfloat16).float()
        h = swiglu(u, v, limit, weights[tok, slot, None]).to(torch.bfloat16)
        out = (numerics.act_quant_sim(h, 128).float() @ w2.T).to(torch.bfloat16)
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


E2M1_BF16X2_PTX = """{
.reg .b32 t0, t1, m, s;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shl.b32 m, t0, 6; and.b32 m, m, 0x01C001C0; shl.b32 s, t0, 12; and.b32 s, s, 0x80008000; or.b32 $0, m, s;
shl.b32 m, t1, 6; and.b32 m, m, 0x01C001C0; shl.b32 s, t1, 12; and.b32 s, s, 0x80008000; or.b32 $1, m, s;
shl.b32 m, t0, 2; and.b32 m, m, 0x01C001C0; shl.b32 s, t0, 8; and.b32 s, s, 0x80008000; or.b32 $2, m, s;
shl.b32 m, t1, 2; and.b32 m, m, 0x01C001C0; shl.b32 s, t1, 8; and.b32 s, s, 0x80008000; or.b32 $3, m, s;
}"""
"""The packed e2m1 -> bf16 decode of `_e2m1_bf16x2` (inline PTX; $4 = four int8 bytes, $0 / $1 = the low nibbles of
bytes 0, 1 / 2, 3 as bf16 pairs e2m1 * 2^-126, $2 / $3 the high nibbles). Module level so that the unit tests run it
on every byte through a small PTX emulator (`tests/unit/test_gemm_moe_kernels.py::test_e2m1_bf16x2_ptx_decodes_every_byte`):
the interpreter runs no PTX."""


E2M1_F16X2_PTX = """{
.reg .b32 t0, t1, m, s;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shl.b32 m, t0, 9; and.b32 m, m, 0x0E000E00; shl.b32 s, t0, 12; and.b32 s, s, 0x80008000; or.b32 $0, m, s;
shl.b32 m, t1, 9; and.b32 m, m, 0x0E000E00; shl.b32 s, t1, 12; and.b32 s, s, 0x80008000; or.b32 $1, m, s;
shl.b32 m, t0, 5; and.b32 m, m, 0x0E000E00; shl.b32 s, t0, 8; and.b32 s, s, 0x80008000; or.b32 $2, m, s;
shl.b32 m, t1, 5; and.b32 m, m, 0x0E000E00; shl.b32 s, t1, 8; and.b32 s, s, 0x80008000; or.b32 $3, m, s;
}"""
"""`E2M1_BF16X2_PTX` with fp16 lanes: the 3 magnitude bits to fp16 bits 9-11 and the sign to bit 15, so each lane is
the fp16 number e2m1 * 2^-14 (0.5 the subnormal 2^-15; `_e2m1`'s values), whose widening to fp32 is one
`HADD2.F32` per lane (a bf16 lane's high half costs a `PRMT` and an `IMAD.U32`). The gemv path's decode when
`GEMV_PACKED_F16` (`_e2m1_f16x2`); emulated on the CPU for every byte like the bf16 PTX."""


# ---------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------

if triton is not None:  # the kernels exist only where triton is installed (it is optional)
    from kernels.gemm import cast_for_store, e8m0_to_f32, round_bf16
    from kernels.quant import act_quant_sim  # a Triton launch (the tile path's input, halves layout)
    from kernels.jit_formats import act_quant_codes_pairs

    @triton.jit
    def _e2m1(b, HI: tl.constexpr):
        """Packed e2m1 bytes b (int32, from int8) -> the low (HI False: even input) or high (HI True: odd input)
        nibble's value times 2^-14, fp32, exact. The nibble's 3 magnitude bits go to fp16 bits 9-11 (exponent low
        bits + mantissa MSB) and its sign to bit 15: that fp16 number is e2m1 * 2^-14 for every code (0.5 lands on
        the fp16 subnormal 2^-15), and the fp16 -> fp32 widening is exact. 4 integer ops, no table, no multiply."""
        if HI:
            bits = ((b << 5) & 0x0E00) | ((b << 8) & 0x8000)
        else:
            bits = ((b << 9) & 0x0E00) | ((b << 12) & 0x8000)
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


    _E2M1_PTX = tl.constexpr(E2M1_BF16X2_PTX)

    @triton.jit
    def _e2m1_bf16x2(b8):
        """Packed e2m1 bytes b8 (int8: low nibble = even input, high = odd) -> (low, high) nibble values as bf16
        e2m1 * 2^-126, exact, by inline PTX on packed registers: four bytes per 32-bit register (`pack=4`), spread
        to two bf16 lanes per register by `prmt` (byte k -> bits 16*(k%2) of register k//2), then per register and
        nibble one shift of the 3 magnitude bits to bf16 bits 6-8 (exponent low bits + mantissa MSB: e2m1's
        (e, m) is exponent e, mantissa m/2, so 0.5 is the subnormal 2^-127 = 0.5 * 2^-126) and one of the sign to
        bit 15, masked and joined (`shl`, `and`, `or`: ptxas makes SHF / LOP3 of them) - two weights per integer
        op, where `_e2m1`'s element-wise route costs ~9 instructions per weight with its conversions (SASS of the
        tile kernel, sm_90, with the two scale-factor multiplies: 2328 -> 1675 instructions per K step of w1 and
        w3). GPU only: the interpreter runs no PTX (mma "bf16x2" runs `_e2m1_bf16x2_twin` there, MMA 3)."""
        return tl.inline_asm_elementwise(_E2M1_PTX, "=r,=r,=r,=r,r", [b8], dtype=(tl.bfloat16, tl.bfloat16),
                                         is_pure=True, pack=4)


    _E2M1_F16_PTX = tl.constexpr(E2M1_F16X2_PTX)

    @triton.jit
    def _e2m1_f16x2(b8):
        """Packed e2m1 bytes b8 (int8) -> (low, high) nibble values as fp16 e2m1 * 2^-14, exact, by inline PTX
        (`E2M1_F16X2_PTX`, two weights per integer op as `_e2m1_bf16x2`). GPU only; under the interpreter the
        element-wise `_e2m1` gives the same values (`_fp4_gemv_codes` DEC 5)."""
        return tl.inline_asm_elementwise(_E2M1_F16_PTX, "=r,=r,=r,=r,r", [b8], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=4)


    @triton.jit
    def _e2m1_bf16x2_twin(b8):
        """`_e2m1_bf16x2`'s bit patterns element-wise in plain Triton (int16 shifts and masks, the PTX's constants),
        as exact fp32 values (`_as_bf16` MMA 3): what the interpreter runs for mma "bf16x2" (MMA 3), so that the
        unit suite exercises the packed path's scale factors and dots; the PTX itself is checked by its CPU
        emulation."""
        b16 = b8.to(tl.int16)  # sign-extended: the high nibble's sign (bit 7) reaches bit 15
        lo = ((b16 << 6) & 0x01C0) | ((b16 << 12) & -32768)
        hi = ((b16 << 2) & 0x01C0) | (b16 & -32768)
        return _as_bf16(lo, 3), _as_bf16(hi, 3)


    @triton.jit
    def _as_bf16(bits, MMA: tl.constexpr):
        """bf16 bit patterns (in the low 16 bits of an integer tensor) -> their values: bf16 by a bitcast of the
        int16 (the explicit narrowing matters: triton 3.6 promotes int16 arithmetic with literals to int32, and a
        32 -> 16-bit bitcast does not compile - found on the H200 at 88f9915), or for MMA 3 (the interpreter, whose
        int16 -> bf16 bitcast, bf16 subnormals and bf16 products are not faithful in triton 3.9) the fp32 whose top
        half they are (exact), so that the products with the scale factors are the GPU's exact bf16 products."""
        if MMA == 3:
            return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


    @triton.jit
    def _fp4_gemv_chunk(w_ptr, s_ptr, rows64, kh0, KH, KS, xe, xo, BN: tl.constexpr, BKH: tl.constexpr):
        """sum over inputs 2*kh0 .. 2*(kh0+BKH) of `xq . W[row]` for the BN FP4 rows `rows64`: [BN] fp32.
        xe / xo [BKH] fp32 are the even / odd inputs of the chunk (matching the low / high nibbles, so the packed
        bytes are never interleaved). Per 32-input group (16 bytes): fp32 sum of the exact products
        (e2m1 * 2^-14) * xq, times the group's 2^(s-127) * 2^14 (a power of two: exact)."""
        offs = kh0 + tl.arange(0, BKH)
        b = tl.load(w_ptr + rows64[:, None] * KH + offs[None, :]).to(tl.int32)
        p = _e2m1(b, False) * xe[None, :] + _e2m1(b, True) * xo[None, :]
        grp = tl.sum(tl.reshape(p, (BN, BKH // 16, 16)), axis=2)
        s = tl.load(s_ptr + rows64[:, None] * KS + kh0 // 16 + tl.arange(0, BKH // 16)[None, :]).to(tl.int32)
        return tl.sum(grp * (e8m0_to_f32(s) * 16384.0), axis=1)


    @triton.jit
    def _fp4_gemv_codes(w_ptr, s_ptr, rows64, kh0, KH, KS, qe, qo, sx, BN: tl.constexpr, BKH: tl.constexpr,
                        DEC: tl.constexpr = 1):
        """`_fp4_gemv_chunk` on act-quantized inputs given as e4m3 CODE values qe / qo [BKH] (even / odd inputs) and
        their blocks' scales sx [BKH / 64] (`act_quant_codes_pairs`): the same [BN] fp32 result, bitwise, with no
        float conversion in the nibble decode. Each nibble goes straight to the fp32 bits of e2m1 * 2^-126 (3
        magnitude bits to bits 22-24, sign to bit 31; 0.5 lands on the fp32 denormal 2^-127): 4-5 integer ops,
        where the fp16 route (`_e2m1`) needs an fp16 -> fp32 conversion per input. Exactness: a product
        (e2m1 * 2^-126) * q is an integer times 2^-137 below 2^-115 (2 e2m1 <= 12, 512 q <= 229376), so every product
        and every partial sum below 2^-113 is exact (denormal or not: fp32 FMA keeps denormals, no flush in these
        kernels - the GPU test at real widths would see a flush as zero rows); above, fp32 rounds relative to the
        magnitude exactly as for the products times 2^(126 + k): the group sum times 2^126, then the weight's group
        scale, then the block's 2^k (each a power of two, in that order: no intermediate overflow before the true
        value's) is the fp16 route's value bitwise.
        DEC: how the nibbles become those fp32 values - 0 / 1 element-wise integer ops on each byte widened to 32
        bits (~3 integer ops per weight, SASS); 2 the packed PTX decode of the tile path (`_e2m1_bf16x2`: the same
        values as bf16, two weights per integer op, then the exact bf16 -> fp32 widening; GPU only); 3 its plain
        Triton twin (`_e2m1_bf16x2_twin`, exact fp32: the interpreter's stand-in for 2); 4 the packed PTX with fp16
        lanes (`_e2m1_f16x2`: e2m1 * 2^-14, widened by one `HADD2.F32` per weight; `GEMV_PACKED_F16`), 5 the same
        values element-wise (`_e2m1`, its interpreter stand-in). With 4 / 5 every product and partial sum is 2^112
        times its DEC 0-3 value and the group sum is scaled by 2^14 instead of 2^126: the products are >= 2^-24
        (0.5 * 2^-14 * 2^-9, the smallest e4m3 code), so no value is denormal; a sum below 2^-14 is a multiple of
        2^-24 under 2^10 of them (exact, as the DEC 0-3 sums below 2^-126 are), and above, rounding relative to the
        magnitude commutes with the power-of-two factor. All six give the same outputs bit for bit
        (tests/unit/test_gemm_moe_kernels.py::test_moe_gemv_decodes_agree_bitwise)."""
        offs = kh0 + tl.arange(0, BKH)
        b8 = tl.load(w_ptr + rows64[:, None] * KH + offs[None, :])
        if DEC == 2:
            lo16, hi16 = _e2m1_bf16x2(b8)
            lo = lo16.to(tl.float32)
            hi = hi16.to(tl.float32)
        elif DEC == 3:
            lo, hi = _e2m1_bf16x2_twin(b8)
        elif DEC == 4:  # e2m1 * 2^-14 (fp16 lanes): products >= 2^-24, no denormal; the group sum times 2^14 below
            lo16, hi16 = _e2m1_f16x2(b8)
            lo = lo16.to(tl.float32)
            hi = hi16.to(tl.float32)
        elif DEC == 5:
            b5 = b8.to(tl.int32)
            lo = _e2m1(b5, False)
            hi = _e2m1(b5, True)
        else:
            b = b8.to(tl.int32)  # sign-extended: bit 7 -> bit 31
            lo = (((b << 22) & 0x01C00000) | ((b << 28) & -2147483648)).to(tl.float32, bitcast=True)
            hi = (((b << 18) & 0x01C00000) | (b & -2147483648)).to(tl.float32, bitcast=True)
        p = lo * qe[None, :] + hi * qo[None, :]
        if DEC >= 4:
            grp = tl.sum(tl.reshape(p, (BN, BKH // 16, 16)), axis=2) * 16384.0  # 2^14
        else:
            grp = tl.sum(tl.reshape(p, (BN, BKH // 16, 16)), axis=2) * 8.507059173023462e37  # 2^126
        s = tl.load(s_ptr + rows64[:, None] * KS + kh0 // 16 + tl.arange(0, BKH // 16)[None, :]).to(tl.int32)
        sxg = tl.reshape(tl.broadcast_to(sx[:, None], (BKH // 64, 4)), (BKH // 16,))  # 4 groups per 128 block
        return tl.sum(grp * e8m0_to_f32(s) * sxg[None, :], axis=1)


    @triton.jit
    def _load_codes(ptr, FP8_NAN: tl.constexpr):
        """e4m3 codes at ptr -> fp32 values (exact). FP8_NAN: restore the NaN codes (0x7F / 0xFF) afterwards - the
        interpreter's fp8 -> fp32 conversion turns them into numbers (seen in triton 3.9), the GPU's keeps them."""
        raw = tl.load(ptr)
        v = raw.to(tl.float32)
        if FP8_NAN:
            v = tl.where((raw.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F, float("nan"), v)
        return v


    @triton.jit
    def _gemv_chunk_input(row_ptr, s_ptr, s_row, kh0, BKH: tl.constexpr, QUANT: tl.constexpr,
                          FP8_NAN: tl.constexpr):
        """The decode kernels' input for the K chunk at packed byte kh0 of one row (x of a token, h of a pair):
        (even inputs, odd inputs) [BKH] fp32 and the chunk's act_quant block scales [BKH / 64]. row_ptr: the row
        of act_quant_sim values (QUANT 0; the scales are unused), of the raw bf16 row (1: quantized here,
        `act_quant_codes_pairs`) or of act_quant's e4m3 codes (2: its scales at s_ptr + s_row; s_ptr is None for
        the other forms and is only touched here)."""
        offs = 2 * (kh0 + tl.arange(0, BKH))
        if QUANT == 2:
            e = _load_codes(row_ptr + offs, FP8_NAN)
            o = _load_codes(row_ptr + offs + 1, FP8_NAN)
            sx = tl.load(s_ptr + s_row + kh0 // 64 + tl.arange(0, BKH // 64))
        else:
            e = tl.load(row_ptr + offs).to(tl.float32)
            o = tl.load(row_ptr + offs + 1).to(tl.float32)
            if QUANT == 1:
                e, o, sx = act_quant_codes_pairs(e, o, BKH // 64)
            else:
                sx = tl.zeros((1,), dtype=tl.float32)  # unused by the fp16 route (BKH may be < 64 there)
        return e, o, sx


    @triton.jit
    def _moe_up_gemv_kernel(xq_ptr, sx_ptr, g_ptr, order_ptr, ids_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr,
                            E, D, I, K_SLOTS, limit,
                            HAS_LIMIT: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr,
                            SORTED: tl.constexpr = True, QUANT: tl.constexpr = 0, DEC: tl.constexpr = 1,
                            FP8_NAN: tl.constexpr = False, STAGES: tl.constexpr = 1):
        """Decode up projection, grid (P, I / BN): program (i, j) computes h[pair, j*BN ...] for pair = order[i]
        (SORTED: a given visiting order, e.g. expert order; measured no faster than pair order, module docstring).
        xq [T, D] bf16 act-quantized x (exact values); h [P, I] bf16 in pair order. An expert id outside [0, E)
        reads expert 0 and writes NaN (fail loud, never a plausible row). SORTED False (`moe_experts`' launch at
        every T): pair = program id (no order array). STAGES: the K loop's software pipeline (`MoeConfig.num_stages`;
        1 none; the same values at every setting). QUANT 0: xq_ptr holds act_quant_sim(x)
        (bf16 values; the fp16 decode route `_fp4_gemv_chunk`; sx_ptr unused); 1: xq_ptr holds x itself (bf16),
        act-quantized here per 128-input block in registers (`act_quant_codes_pairs`: the same exact values as the
        act_quant_sim launch it replaces, kept as codes and scales for `_fp4_gemv_codes`; BKH a multiple of 64);
        2: xq_ptr holds `kernels.gemm.act_quant(x)`'s e4m3 codes [T, D] and sx_ptr its fp32 scales [T, D / 128]
        (the codes route without re-quantizing x in every program; BKH a multiple of 64). DEC: the codes route's
        nibble decode (`_fp4_gemv_codes`)."""
        if SORTED:
            pair = tl.load(order_ptr + tl.program_id(0)).to(tl.int64)
        else:
            pair = tl.program_id(0).to(tl.int64)
        e = tl.load(ids_ptr + pair).to(tl.int64)
        bad = (e < 0) | (e >= E)
        e = tl.where(bad, 0, e)
        tok = pair // K_SLOTS
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        rows64 = e * I + offs_n
        KH = D // 2
        KS = D // 32
        u = tl.zeros((BN,), dtype=tl.float32)
        v = tl.zeros((BN,), dtype=tl.float32)
        for kh0 in tl.range(0, KH, BKH, num_stages=STAGES):
            xe, xo, sx = _gemv_chunk_input(xq_ptr + tok * D, sx_ptr, tok * (D // 128), kh0, BKH, QUANT, FP8_NAN)
            if QUANT != 0:
                u += _fp4_gemv_codes(w1_ptr, s1_ptr, rows64, kh0, KH, KS, xe, xo, sx, BN, BKH, DEC)
                v += _fp4_gemv_codes(w3_ptr, s3_ptr, rows64, kh0, KH, KS, xe, xo, sx, BN, BKH, DEC)
            else:
                u += _fp4_gemv_chunk(w1_ptr, s1_ptr, rows64, kh0, KH, KS, xe, xo, BN, BKH)
                v += _fp4_gemv_chunk(w3_ptr, s3_ptr, rows64, kh0, KH, KS, xe, xo, BN, BKH)
        h = _swiglu(u, v, tl.load(g_ptr + pair), limit, HAS_LIMIT)
        h = tl.where(bad, float("nan"), h)
        tl.store(h_ptr + pair * I + offs_n, round_bf16(h).to(tl.bfloat16))


    @triton.jit
    def _moe_down_gemv_kernel(hq_ptr, sh_ptr, order_ptr, ids_ptr, w2_ptr, s2_ptr, y_ptr, E, D, I,
                              BN: tl.constexpr, BKH: tl.constexpr, SORTED: tl.constexpr = True,
                              QUANT: tl.constexpr = 0, DEC: tl.constexpr = 1, FP8_NAN: tl.constexpr = False,
                              STAGES: tl.constexpr = 1):
        """Decode down projection, grid (P, D / BN): y_pair[pair, n] = bf16(hq[pair] . W2_e[n]) (hq act-quantized h,
        exact bf16 values; pair order as in `_moe_up_gemv_kernel`; a bad expert id writes NaN). QUANT 1: hq_ptr
        holds h itself, act-quantized here as in the up kernel; 2: hq_ptr holds act_quant(h)'s e4m3 codes [P, I]
        and sh_ptr its scales [P, I / 128]; DEC and STAGES as in the up kernel."""
        if SORTED:
            pair = tl.load(order_ptr + tl.program_id(0)).to(tl.int64)
        else:
            pair = tl.program_id(0).to(tl.int64)
        e = tl.load(ids_ptr + pair).to(tl.int64)
        bad = (e < 0) | (e >= E)
        e = tl.where(bad, 0, e)
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        rows64 = e * D + offs_n
        KH = I // 2
        KS = I // 32
        acc = tl.zeros((BN,), dtype=tl.float32)
        for kh0 in tl.range(0, KH, BKH, num_stages=STAGES):
            he, ho, sx = _gemv_chunk_input(hq_ptr + pair * I, sh_ptr, pair * (I // 128), kh0, BKH, QUANT, FP8_NAN)
            if QUANT != 0:
                acc += _fp4_gemv_codes(w2_ptr, s2_ptr, rows64, kh0, KH, KS, he, ho, sx, BN, BKH, DEC)
            else:
                acc += _fp4_gemv_chunk(w2_ptr, s2_ptr, rows64, kh0, KH, KS, he, ho, BN, BKH)
        acc = tl.where(bad, float("nan"), acc)
        tl.store(y_ptr + pair * D + offs_n, round_bf16(acc).to(tl.bfloat16))


    @triton.jit
    def _swiglu(u, v, g, limit, HAS_LIMIT: tl.constexpr):
        """h = silu(u) * v * g in fp32 after rounding u and v to bf16 (the Linear outputs) and the clamps: v two-sided,
        u from above only (spec §8.5). Any shape; g broadcasts. The clamps keep NaN as torch.clamp does (the GPU's
        plain min / max return the other operand: a NaN activation would leave as a plausible +-limit)."""
        u = round_bf16(u)
        v = round_bf16(v)
        if HAS_LIMIT:
            v = tl.maximum(v, -limit, propagate_nan=tl.PropagateNan.ALL)
            v = tl.minimum(v, limit, propagate_nan=tl.PropagateNan.ALL)
            u = tl.minimum(u, limit, propagate_nan=tl.PropagateNan.ALL)
        return u * tl.sigmoid(u) * v * g


    @triton.jit(do_not_specialize=["M"])
    def _swiglu_joint_kernel(uv_ptr, h_ptr, M, I, limit, HAS_LIMIT: tl.constexpr, BI: tl.constexpr):
        """Grid (M, cdiv(I, BI)): h[m, i] = silu(min(u, limit)) * clamp(v, -limit, limit) rounded to h's dtype,
        u = uv[m, i], v = uv[m, I + i] (`swiglu_joint`)."""
        m = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BI + tl.arange(0, BI)
        mask = offs < I
        u = tl.load(uv_ptr + m * 2 * I + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(uv_ptr + m * 2 * I + I + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_LIMIT:
            v = tl.maximum(v, -limit, propagate_nan=tl.PropagateNan.ALL)
            v = tl.minimum(v, limit, propagate_nan=tl.PropagateNan.ALL)
            u = tl.minimum(u, limit, propagate_nan=tl.PropagateNan.ALL)
        h = u / (1.0 + tl.exp(-u)) * v
        tl.store(h_ptr + m * I + offs, cast_for_store(h, h_ptr), mask=mask)

    @triton.jit(do_not_specialize=["T"])
    def _sum_slots_kernel(y_ptr, s_ptr, out_ptr, T, D, K: tl.constexpr, HAS_SHARED: tl.constexpr,
                          BD: tl.constexpr):
        """Grid (T, cdiv(D, BD)): out[t] = sum_j y[t, j] (fp32, j = 0 .. K-1 left to right) [+ shared[t]], stored
        in out's dtype (`sum_slots`, `moe_combine`)."""
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BD + tl.arange(0, BD)
        mask = offs < D
        acc = tl.load(y_ptr + t * K * D + offs, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(1, K):
            acc += tl.load(y_ptr + (t * K + j) * D + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_SHARED:
            acc += tl.load(s_ptr + t * D + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * D + offs, cast_for_store(acc, out_ptr), mask=mask)


    @triton.jit
    def _fp4_tile_dot(acc, xe, xo, w_ptr, s_ptr, rows64, kh0, KH, KS, BN: tl.constexpr, BKH: tl.constexpr,
                      MMA: tl.constexpr):
        """acc [BN, BM] += W[rows, chunk] . xq[:, chunk]^T for one chunk of 2*BKH inputs (fp32 accumulation): xe / xo
        [BKH, BM] the even / odd inputs of the tile's gathered rows (bf16 exact values); W's bytes [BN, BKH] decoded
        to exact e2m1 * 2^(s-127) values (`_e2m1` times the group's scale times 2^14; the [BN, BKH/16] group scales
        are loaded once and broadcast to their 16 bytes), the even inputs from the low nibbles and the odd ones from
        the high nibbles, so the product is TWO dots. "Swap AB": the decoded weight tile is the dot's LHS (M = BN
        weight rows), which Hopper's wgmma takes from registers - no shared-memory round trip of the decoded tile,
        and an M of 128 instead of the tile's 32 token rows (which compiled to mma.sync; 2.2-2.5x slower at Flash
        and Pro width, benchmarks/RESULTS.md). MMA 1: both operands bf16 (exact: e2m1 has 2 significant bits, the
        scales are screened at load), tensor-core dots; MMA 0 (the interpreter, whose bf16 casts and dots are not
        faithful in triton 3.9): fp32 dots with input_precision="ieee" on the same values."""
        offs = kh0 + tl.arange(0, BKH)
        if MMA >= 2:  # the packed decode (`_e2m1_bf16x2`), times the group scale as two exact bf16 factors
            b8 = tl.load(w_ptr + rows64[:, None] * KH + offs[None, :])
            sq = tl.load(s_ptr + rows64[:, None] * KS + kh0 // 16 + tl.arange(0, BKH // 16)[None, :]).to(tl.int16)
            m1 = _as_bf16((tl.minimum(sq, 128) + 126) << 7, MMA)  # 2^(min(s, 128) - 1)
            m2 = _as_bf16(tl.where(sq == 255, 0x7FC0, (tl.maximum(sq, 128) - 1) << 7), MMA)  # 2^(max(s, 128) - 128)
            m1 = tl.reshape(tl.broadcast_to(m1[:, :, None], (BN, BKH // 16, 16)), (BN, BKH))
            m2 = tl.reshape(tl.broadcast_to(m2[:, :, None], (BN, BKH // 16, 16)), (BN, BKH))
            if MMA == 2:
                lo, hi = _e2m1_bf16x2(b8)
                acc = tl.dot(lo * m1 * m2, xe, acc)
                acc = tl.dot(hi * m1 * m2, xo, acc)
            else:  # MMA 3, the interpreter: the PTX's bits element-wise, the same factors, fp32 "ieee" dots
                lo, hi = _e2m1_bf16x2_twin(b8)
                acc += tl.dot(lo * m1 * m2, xe.to(tl.float32), input_precision="ieee")
                acc += tl.dot(hi * m1 * m2, xo.to(tl.float32), input_precision="ieee")
            return acc
        b = tl.load(w_ptr + rows64[:, None] * KH + offs[None, :]).to(tl.int32)
        sg = tl.load(s_ptr + rows64[:, None] * KS + kh0 // 16 + tl.arange(0, BKH // 16)[None, :]).to(tl.int32)
        sg = e8m0_to_f32(sg) * 16384.0
        s = tl.reshape(tl.broadcast_to(sg[:, :, None], (BN, BKH // 16, 16)), (BN, BKH))
        lo = _e2m1(b, False) * s
        hi = _e2m1(b, True) * s
        if MMA == 0:
            acc += tl.dot(lo, xe.to(tl.float32), input_precision="ieee")
            acc += tl.dot(hi, xo.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(lo.to(tl.bfloat16), xe, acc)
            acc = tl.dot(hi.to(tl.bfloat16), xo, acc)
        return acc


    @triton.jit
    def _moe_up_tile_kernel(xq_ptr, g_ptr, row_pair_ptr, tile_e_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr,
                            E, D, I, K_SLOTS, limit, HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            BKH: tl.constexpr, MMA: tl.constexpr):
        """Prefill up projection, grid (I / BN * n_tiles,): h[r, n] for the BM padded rows of tile pid // (I / BN)
        (rows of one expert, `moe_route`), output block pid % (I / BN), gathered from xq [T, D] bf16 (act-quantized
        x), computed as the transposed tile [BN, BM] (`_fp4_tile_dot`). Padding rows (g = 0) and the rows of unused tiles are written as 0, so every row
        of h [n_tiles * BM, I] bf16 is defined."""
        pid = tl.program_id(0)  # one axis (2^31 - 1 programs): the output block fastest, then the tile
        tile = pid // (I // BN)
        e = tl.load(tile_e_ptr + tile)
        offs_r = tile * BM + tl.arange(0, BM)
        offs_n = (pid % (I // BN)) * BN + tl.arange(0, BN)
        out = h_ptr + offs_r.to(tl.int64)[None, :] * I + offs_n[:, None]
        if e < E:
            pair = tl.load(row_pair_ptr + offs_r)
            valid = pair >= 0
            tok = tl.where(valid, pair // K_SLOTS, 0).to(tl.int64)
            rows64 = e.to(tl.int64) * I + offs_n
            KH = D // 2
            KS = D // 32
            offs_j = tl.arange(0, BKH)
            u = tl.zeros((BN, BM), dtype=tl.float32)
            v = tl.zeros((BN, BM), dtype=tl.float32)
            for kh0 in range(0, KH, BKH):
                xp = xq_ptr + tok[None, :] * D + (kh0 + offs_j)[:, None]  # halves layout: contiguous chunks
                xe = tl.load(xp, mask=valid[None, :], other=0.0)
                xo = tl.load(xp + KH, mask=valid[None, :], other=0.0)
                u = _fp4_tile_dot(u, xe, xo, w1_ptr, s1_ptr, rows64, kh0, KH, KS, BN, BKH, MMA)
                v = _fp4_tile_dot(v, xe, xo, w3_ptr, s3_ptr, rows64, kh0, KH, KS, BN, BKH, MMA)
            g = tl.load(g_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0)
            h = _swiglu(u, v, g[None, :], limit, HAS_LIMIT)
            tl.store(out, round_bf16(h).to(tl.bfloat16))
        else:
            tl.store(out, tl.zeros((BN, BM), dtype=tl.bfloat16))


    @triton.jit
    def _moe_down_tile_kernel(hq_ptr, row_pair_ptr, tile_e_ptr, w2_ptr, s2_ptr, y_ptr, E, D, I,
                              BM: tl.constexpr, BN: tl.constexpr, BKH: tl.constexpr, MMA: tl.constexpr):
        """Prefill down projection, grid (D / BN * n_tiles,) ordered as the up kernel's: y_pair[pair, n] =
        bf16(hq[r] . W2_e[n]) for the tile's valid rows (hq [n_tiles * BM, I] bf16, act-quantized h; transposed
        tile as in the up kernel), scattered to pair order."""
        pid = tl.program_id(0)  # one axis, the output block fastest, as in the up kernel
        tile = pid // (D // BN)
        e = tl.load(tile_e_ptr + tile)
        if e < E:
            offs_r = tile * BM + tl.arange(0, BM)
            pair = tl.load(row_pair_ptr + offs_r)
            valid = pair >= 0
            offs_n = (pid % (D // BN)) * BN + tl.arange(0, BN)
            rows64 = e.to(tl.int64) * D + offs_n
            KH = I // 2
            KS = I // 32
            offs_j = tl.arange(0, BKH)
            r64 = offs_r.to(tl.int64)
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            for kh0 in range(0, KH, BKH):
                hp = hq_ptr + r64[None, :] * I + (kh0 + offs_j)[:, None]  # halves layout
                acc = _fp4_tile_dot(acc, tl.load(hp), tl.load(hp + KH), w2_ptr, s2_ptr, rows64, kh0, KH, KS, BN, BKH,
                                    MMA)
            p64 = tl.where(valid, pair, 0).to(tl.int64)
            tl.store(y_ptr + p64[None, :] * D + offs_n[:, None], round_bf16(acc).to(tl.bfloat16), mask=valid[None, :])


# ---------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------

class MoeConfig(NamedTuple):
    """Launch choice of `moe_experts`: path "gemv" (decode kernels, one program per pair and block) or "tiles" (prefill
    kernels on `moe_route`'s padded tiles); block_m rows per tile (tiles only; 16, 32, 64 or 128), block_n weight
    rows per program, block_kh packed bytes per K step (2 * block_kh inputs; a power of two >= 16, reduced to
    divide D/2 and I/2), num_warps, num_stages (the tiles' pipeline; on the gemv path the K loop's software
    pipeline, `tl.range(num_stages=...)`: 1 none, 2 the next K chunk's weight bytes loaded by cp.async while the
    current chunk is decoded - the same sums in the same order, bitwise the same outputs)."""
    path: str
    block_m: int
    block_n: int
    block_kh: int
    num_warps: int
    num_stages: int


GEMV_MAX_PAIRS = 192
"""Pairs (T * k) up to which `moe_experts` takes the decode path. One H200, Flash width, whole call in a CUDA graph
(benchmarks/RESULTS.md, session of 2026-12-01, `bench_gemm.py --quick --sections moe_crossover`): gemv against the
swapped tiles at T = 1 ... 128: gemv faster up to T = 16 (849 vs 1046 µs for 16 x 64 tiles), even at T = 32
(1659 vs 1709 µs), tiles faster from T = 64 (2485 vs 3229 µs) and at T = 128 (3018 vs 6340 µs)."""

GEMV_QUANT_MAX_T = 1
"""Tokens up to which the decode kernels act-quantize x and h themselves (two act_quant launches fewer). Every
program of a row re-quantizes its whole input, so the work grows with the programs: measured on one H200
(`benchmarks/moe_decode_probe.py`, whole call in a CUDA graph, RESULTS.md session of 2026-12-04 (2)), in-kernel /
two launches: Flash T = 1 69.1 / 70.0 µs, T = 8 473.5 / 440.1, T = 32 1790.6 / 1650.9; Pro T = 1 180.2 / 172.8,
T = 8 1203.6 / 1102.3. Kept at one token: in the model's CUDA graph each launch also costs a kernel boundary."""

GEMV_QUANT_PACKED_MIN_D = 7168
"""Model width D from which the in-kernel quantization route (T <= GEMV_QUANT_MAX_T) decodes the nibbles packed
(`_fp4_gemv_codes` DEC 2, or 4 with GEMV_PACKED_F16) when mma is None; below it element-wise (DEC 1). Measured on
one H100 (whole call in a CUDA graph, `benchmarks/moe_decode_probe.py`, RESULTS.md third session of 2026-12-06,
four runs): Flash (D 4096) element-wise 68.8-69.4 µs against packed 75.8-76.3 (bf16 lanes) and 76.1 (fp16 lanes);
Pro (D 7168) 181.8-183.2 against 162.3-163.4 and 162.7. Above one token the packed decode is faster at both widths
(GEMV_CODES). Same values either way."""

GEMV_SHAPES = ((MoeConfig("gemv", 1, 32, 256, 4, 2), MoeConfig("gemv", 1, 32, 128, 4, 2)),
               (MoeConfig("gemv", 1, 16, 256, 4, 2), MoeConfig("gemv", 1, 32, 128, 4, 2)),
               (MoeConfig("gemv", 1, 32, 128, 2, 2), MoeConfig("gemv", 1, 32, 128, 2, 1)))
"""`moe_experts`' default launch shapes (block_n, block_kh, num_warps, num_stages) of the (up, down) decode kernels
on the gemv path: at one token with the element-wise nibble decode (below GEMV_QUANT_PACKED_MIN_D), at one token
with the packed decode, and above one token (act_quant's codes). Shapes measured on one H100
(`benchmarks/moe_decode_probe.py --section configs`: each kernel alone in a CUDA graph, 27 shapes, 8 routings of
top-6 of random scores, all unpipelined; benchmarks/RESULTS.md, fourth session of 2026-12-06), µs per call, the
shape before (16, 256, 4 for both) -> the fourth session's (up above one token (8, 512, 2), since replaced):
Flash T = 1 up 49.3 -> 40.6, down 25.0 -> 22.2; T = 8 up 212.1 -> 197.6, down 114.8 -> 103.4; T = 32 up 793.2 ->
752.6, down 438.9 -> 377.3; Pro T = 1 up 101.1 (kept), down 59.3 -> 54.6; T = 32 up 2104.1 -> 1944.1, down 1119.0
-> 972.4. block_kh sets the fp32 summation order of a row (outputs within ~1e-3 of the old shapes' relative to
their largest); a shape that does not divide the layer's D and I is not used (`gemv_shapes`). The batch-invariant
mode and a forced `config` keep one shape for both kernels.
num_stages (the K loop software-pipelined, `MoeConfig`; sixth session of 2026-12-06 - benchmarks/RESULTS.md, one
H100, `benchmarks/moe_decode_probe.py --section stages`, each kernel alone in a CUDA graph, 8 routings, every
output bitwise its 1-stage output): 2 where it was faster - Flash T = 1 up (32, 256, 4) 40.3 -> 36.1 µs, down
(32, 128, 4) 22.3 -> 21.4; Pro T = 1 up (16, 256, 4) 100.9 -> 91.4, down 54.1 -> 51.5; above one token the up
kernel moves to (32, 128, 2) at 2 stages (Flash T = 8 198.1 -> 194.0 µs, T = 32 755.0 -> 705.6 against (8, 512,
2) unpipelined; Pro T = 8 506.2 -> 498.6, T = 32 ~1944 -> 1834); the down kernel above one token gains nothing
from stages (375.7 / 379.3 / 377.8 / 379.9 µs at 1-4 stages, Flash T = 32) and stays unpipelined. 3 and 4 stages
were never more than 1 % faster than 2 (and mostly slower). The batch-invariant mode's one shape (`moe_config`)
stays unpipelined (not measured)."""

GEMV_PACKED_F16 = True
"""Whether the gemv path's packed nibble decode (mma None / "bf16x2") uses fp16 lanes (`_e2m1_f16x2`,
`_fp4_gemv_codes` DEC 4; DEC 5 under the interpreter) instead of the tile path's bf16 lanes (DEC 2 / 3): the
widening to fp32 is one `HADD2.F32` per weight (874 -> 807 instructions per K step of the up kernel, 477 -> 445 of
the down kernel, SASS of sm_90, `benchmarks/sass_count.py`); the same outputs bitwise. GPU check and timing
(`tests/gpu/test_gemm_moe_kernels.py::test_moe_gemv_input_forms_and_decodes_are_bitwise_gpu`,
`benchmarks/moe_decode_probe.py`): benchmarks/RESULTS.md, third session of 2026-12-06."""

GEMV_CODES = True
"""Above GEMV_QUANT_MAX_T tokens, whether the decode kernels take x and h as act_quant's e4m3 codes and scales
(one quantization launch each, as before; the code-value products of `_fp4_gemv_codes` with the packed nibble
decode: 807 instructions per K step of the up kernel against 1047 for the fp16 route of act_quant_sim's values,
SASS of sm_90, `benchmarks/sass_count.py`; -21 % / -23 % per Flash MoE call at T = 8 / 32 on the H100) - the same
outputs bitwise. False: the fp16 route (kept for the A/B of `benchmarks/moe_decode_probe.py`)."""

TILES_SMALL_MAX_PAIRS = 768
"""Pairs up to which the tile path uses 16-row x 64-column tiles (T = 64 / 128: 2485 / 3018 µs against 3133 / 3808
µs for 32 x 128); above, the large tiles of `TILES_LARGE` by pairs per expert. Crossover between 768 and 6144
pairs not measured."""

TILES_LARGE = ((32, MoeConfig("tiles", 32, 64, 64, 4, 3)),
               (64, MoeConfig("tiles", 64, 128, 32, 4, 3)),
               (None, MoeConfig("tiles", 128, 128, 64, 8, 3)))
"""Above TILES_SMALL_MAX_PAIRS: (largest average pairs per expert P / E, tiles) in order, None = any. Each tile
decodes its expert's FP4 rows once for its BM token rows, so the decode work (the CUDA-core bound of these
kernels) falls as BM grows, while the rows padded up to BM are computed anyway: the best BM follows how many rows
an expert holds. Measured on one H200 (`bench_gemm.py --sections moe_tiles --geoms flash,pro --tokens
1024,2048,3072,4096 --tile-shapes ...`, whole `moe_experts` call in a CUDA graph, top-6 of random scores;
benchmarks/RESULTS.md, session of 2026-12-04 (2)), µs for 32 x 128 / 64 x 128 (kh 32, 4 warps) / 128 x 128 (kh 32,
8 warps): Flash (E = 256) P/E 24: 4310 / 5666 / 9268; 48: 7898 / 5821 / 9457; 72: 10975 / 9738 / 9568; 96:
13398 / 10848 / 9736. Pro (E = 384) P/E 32: 21806 / 21306 / 34184; 48: 29677 / 21828 / 34675; 64: 36471 /
30594 / 35097. The rule picks the fastest at each point but Pro P/E 32 (2 % slower than 64 x 128). Routed loads
of a real model are skewed (per-expert tile sizes would then win; not built).
Re-measured after the halves layout (x and h loaded in 16-byte vectors; eighth session of 2026-12-06, one H100,
the same sweep, benchmarks/RESULTS.md), µs of the old rule's tiles -> the new rule's: Flash P/E 24 (32 x 128 kh 64
->) 32 x 64 kh 64: 3619 -> 2989; 48: 64 x 128 kh 32 4398 (kept); 72 (128 x 128 kh 32 ->) kh 64: 7305 -> 6886; 96:
7467 -> 7067; Pro P/E 16: 13548 -> 11763; 32: 18135 -> 15831; 48 / 64: 64 x 128 kh 32 (kept) 16999 / 22799. The
32 x 64 tiles were the fastest of ten shapes at P/E 16 - 32, 64 x 128 kh 32 at 48 - 64 (64 x 128 kh 64 next, 2 %
slower at Flash 48: 4466 / 4380), 128 x 128 kh 64 above. The grid's order changed after this sweep (the output
block fastest; 1.11-1.29x per call at the defaults, bitwise the same); the rule was not re-swept after that."""


INVARIANT_GEMV_MAX_T = 64
INVARIANT_TILES = MoeConfig("tiles", 32, 128, 64, 4, 3)
"""The batch-invariant mode's routed experts (`moe_experts(invariant=True)`): the "gemv" path (one program per
(pair, output block)) up to INVARIANT_GEMV_MAX_T tokens (a decode step of up to 64 rows), these tiles above (a
prefill: one tile shape for every T > 64, whatever the pairs per expert - not `TILES_LARGE`'s choice). A pair's
output depends on its own token and expert only on either side: a gemv program never mixes pairs; in a tile a
token is one column of the swapped dot (M = weight rows), whose sum over K is that column's alone in the same order
wherever the column sits and whatever the padding."""


def moe_config(n_pairs: int, n_experts: int) -> MoeConfig:
    """Default launch for P = n_pairs pairs over E = n_experts experts, the fastest measured (RESULTS.md; one
    H200, `TILES_LARGE` re-measured on one H100): the decode path (`MoeConfig("gemv", 1, 16, 256, 4, 1)`; the
    default launch then takes the per-kernel shapes of `gemv_shapes`) while P <= GEMV_MAX_PAIRS; else the
    swapped tiles, 16 x 64 while P <= TILES_SMALL_MAX_PAIRS, then `TILES_LARGE` by the average pairs per expert
    P / E. Raises ValueError for n_experts < 1."""
    if not isinstance(n_experts, int) or isinstance(n_experts, bool) or n_experts < 1:
        _fail("moe_config", "n_experts", repr(n_experts), "an int >= 1 (routed experts of the layer)")
    if n_pairs <= GEMV_MAX_PAIRS:
        return MoeConfig("gemv", 1, 16, 256, 4, 1)
    if n_pairs <= TILES_SMALL_MAX_PAIRS:
        return MoeConfig("tiles", 16, 64, 64, 4, 3)
    for most, cfg in TILES_LARGE:
        if most is None or n_pairs <= most * n_experts:
            return cfg
    raise AssertionError("TILES_LARGE ends with None")


def tile_thresholds(n_experts: int, k: int) -> list[int]:
    """The token counts T at which `moe_config(T * k, n_experts)` changes its launch (the first T of each new
    choice): for `dsv4.warmup`'s prefill probes."""
    out = [GEMV_MAX_PAIRS // k + 1, TILES_SMALL_MAX_PAIRS // k + 1]
    out += [most * n_experts // k + 1 for most, _ in TILES_LARGE if most is not None]
    return sorted(set(out))


def _chunk(block_kh: int, half_width: int) -> int:
    """The largest power of two <= block_kh that divides half_width (D/2 or I/2, multiples of 64)."""
    b = block_kh
    while half_width % b:
        b //= 2
    return b


def _moe_mma(mma: str | None) -> int:
    """Dot flavour of the tile path: on the GPU 2 for mma None (the default) or "bf16x2" (bf16 operands on the
    tensor cores, the FP4 nibbles decoded two per 32-bit integer op by inline PTX: `_e2m1_bf16x2`; bitwise the
    element-wise decode's operands and outputs on the H200, 1.08-1.27x faster per call at Flash / Pro T = 1024 /
    4096: benchmarks/RESULTS.md, second session of 2026-12-06), 1 for "bf16" (the element-wise decode through
    `_e2m1`); under TRITON_INTERPRET=1 3 for None / "bf16x2" (the packed path's bit patterns element-wise through
    `_e2m1_bf16x2_twin`, its scale factors, fp32 "ieee" dots: the interpreter runs no PTX) and 0 for "bf16" (fp32
    "ieee" dots on the element-wise values; `kernels.gemm.dot_q_w`). "fp8" is refused: an e4m3 dot
    would need one dot per 32-input group (the per-32 weight scales are not powers of two of one 128 block), the
    slow layout this path replaced. Raises ValueError for any other value."""
    if mma not in (None, "bf16", "bf16x2"):
        _fail("moe_experts", "mma", repr(mma),
              "None, 'bf16' or 'bf16x2' (the FP4 tile path multiplies exact bf16 operands)")
    mode = mma_mode("bf16")
    if mma in (None, "bf16x2"):
        return 2 if mode == 1 else 3
    return mode


def _gemv_input(op: str, xq: torch.Tensor, sx: torch.Tensor | None, quant: bool, width: int, name: str,
                cfg: MoeConfig) -> int:
    """Checks the gemv launchers' input mode (module docstring of `moe_up_gemv`); returns the kernels' QUANT."""
    if sx is None:
        mode = 1 if quant else 0
    elif quant:
        _fail(op, "quant", "True with sx given", "quant=False when xq holds act_quant's codes (sx)")
    else:
        mode = 2
        if xq.dtype != torch.float8_e4m3fn:
            _fail(op, name, f"dtype {xq.dtype} with sx given", "float8_e4m3fn codes of kernels.gemm.act_quant")
        want = (xq.shape[0], width // 128)
        if sx.dtype != torch.float32 or tuple(sx.shape) != want:
            _fail(op, "sx", f"{sx.dtype} shape {tuple(sx.shape)}", f"float32 scales of shape {want}")
        check_layout(op, {name: xq, "sx": sx})
    if mode and _chunk(cfg.block_kh, width // 2) % 64:
        _fail(op, "block_kh", cfg.block_kh, "a chunk of >= 64 bytes (whole 128-input blocks) with quant or sx")
    return mode


def _one_token_mma(mma: str | None, D: int) -> str | None:
    """The nibble decode of the in-kernel quantization route (up to GEMV_QUANT_MAX_T tokens) at model width D:
    mma None is element-wise ("bf16") below GEMV_QUANT_PACKED_MIN_D (measured faster there), else mma itself."""
    return "bf16" if mma is None and D < GEMV_QUANT_PACKED_MIN_D else mma


def _gemv_operand(t: torch.Tensor, cfg: MoeConfig, mma: str | None, T: int, D: int) -> tuple[torch.Tensor, dict]:
    """The gemv launchers' input for t [rows, width] (x, then h) of a T-token call and its keywords, by
    `moe_experts`' rule: K chunks of whole 128-input blocks take the code-value products - t itself, quantized in
    the kernels, up to GEMV_QUANT_MAX_T tokens (nibble decode `_one_token_mma`), else act_quant's codes and
    scales (GEMV_CODES); other chunks act_quant_sim's values (the fp16 route). Every form gives the same values."""
    if _chunk(cfg.block_kh, t.shape[1] // 2) % 64 == 0:
        if T <= GEMV_QUANT_MAX_T:
            return t, dict(quant=True, mma=_one_token_mma(mma, D))
        if GEMV_CODES:
            q, s = act_quant(t)
            return q, dict(sx=s, mma=mma)
    return act_quant(t, sim=True)[0], {}


def _gemv_dec(mma: str | None) -> int:
    """`_fp4_gemv_codes`' DEC for the gemv kernels: `_moe_mma`'s flavour, the packed one (2 / 3) in fp16 lanes
    (4 / 5) when GEMV_PACKED_F16."""
    dec = _moe_mma(mma)
    return dec + 2 if GEMV_PACKED_F16 and dec in (2, 3) else dec


def moe_up_gemv(xq: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, order: torch.Tensor,
                experts: StackedExperts, limit: float, cfg: MoeConfig, *, quant: bool = False,
                sx: torch.Tensor | None = None, mma: str | None = None) -> torch.Tensor:
    """h [P, I] bf16 in pair order (pair = t * k + j) of `_moe_up_gemv_kernel`. The input, one of three forms
    with the same values: xq [T, D] bf16 act_quant_sim(x) (quant=False, sx None: the fp16 decode route); x itself
    (quant=True: act-quantized in every program, no act_quant launch); or `kernels.gemm.act_quant(x)`: xq the
    float8_e4m3fn codes [T, D] and sx their float32 scales [T, D / 128] (the codes route, x quantized once).
    order [P] the pairs in the order the programs visit them (e.g. expert order, `torch.sort(..., stable=True)` of
    the flattened ids), or None: pair order (the same values; what `moe_experts` passes: measured as fast).
    mma: the codes route's nibble decode, as `moe_experts`' mma (None / "bf16x2": the packed PTX decode, in fp16
    lanes when GEMV_PACKED_F16; "bf16": element-wise; `_gemv_dec`); every choice gives the same values. Raises
    ValueError on a bad block or input form."""
    E, D, I = _check_experts("moe_up_gemv", experts)
    P = indices.numel()
    if I % cfg.block_n:
        _fail("moe_up_gemv", "block_n", cfg.block_n, f"a divisor of I = {I}")
    mode = _gemv_input("moe_up_gemv", xq, sx, quant, D, "xq", cfg)
    h = torch.empty(P, I, dtype=torch.bfloat16, device=xq.device)
    u8 = lambda t: t.view(torch.uint8)  # noqa: E731 - ue8m0 bytes
    _moe_up_gemv_kernel[(P, I // cfg.block_n)](
        xq, sx, weights, indices if order is None else order, indices, experts.w1, u8(experts.s1), experts.w3,
        u8(experts.s3), h, E, D, I, indices.shape[1], float(limit), HAS_LIMIT=limit > 0, BN=cfg.block_n,
        BKH=_chunk(cfg.block_kh, D // 2), SORTED=order is not None, QUANT=mode, DEC=_gemv_dec(mma),
        FP8_NAN=mode == 2 and interpreting(), STAGES=cfg.num_stages, num_warps=cfg.num_warps)
    return h


def moe_down_gemv(hq: torch.Tensor, indices: torch.Tensor, order: torch.Tensor, experts: StackedExperts,
                  cfg: MoeConfig, *, quant: bool = False, sx: torch.Tensor | None = None,
                  mma: str | None = None) -> torch.Tensor:
    """y_pair [P, D] bf16 in pair order of `_moe_down_gemv_kernel`; hq [P, I] in one of `moe_up_gemv`'s three
    input forms (act_quant_sim(h); h itself with quant=True; act_quant(h)'s codes with sx [P, I / 128]); order
    and mma as `moe_up_gemv`."""
    E, D, I = _check_experts("moe_down_gemv", experts)
    P = indices.numel()
    if D % cfg.block_n:
        _fail("moe_down_gemv", "block_n", cfg.block_n, f"a divisor of D = {D}")
    mode = _gemv_input("moe_down_gemv", hq, sx, quant, I, "hq", cfg)
    y = torch.empty(P, D, dtype=torch.bfloat16, device=hq.device)
    _moe_down_gemv_kernel[(P, D // cfg.block_n)](
        hq, sx, indices if order is None else order, indices, experts.w2, experts.s2.view(torch.uint8), y, E, D, I,
        BN=cfg.block_n, BKH=_chunk(cfg.block_kh, I // 2), SORTED=order is not None, QUANT=mode,
        DEC=_gemv_dec(mma), FP8_NAN=mode == 2 and interpreting(), STAGES=cfg.num_stages, num_warps=cfg.num_warps)
    return y


def moe_up_tiles(xq: torch.Tensor, weights: torch.Tensor, route: MoeRoute, experts: StackedExperts, limit: float,
                 cfg: MoeConfig, mma: str | None = None) -> torch.Tensor:
    """h [n_tiles * BM, I] bf16 of `_moe_up_tile_kernel` (row r belongs to pair route.row_pair[r]; padding and
    unused rows are 0; natural channel order); xq [T, D] bf16 act-quantized x in the halves layout
    (`kernels.quant.halves`: even channels, then odd; `act_quant_sim(x, 128, halves=True)`)."""
    E, D, I = _check_experts("moe_up_tiles", experts)
    if I % cfg.block_n or cfg.block_m != route.block_m:
        _fail("moe_up_tiles", "cfg", repr(cfg), f"block_n dividing I = {I}, block_m = route.block_m")
    h = torch.empty(route.row_pair.numel(), I, dtype=torch.bfloat16, device=xq.device)
    u8 = lambda t: t.view(torch.uint8)  # noqa: E731 - ue8m0 bytes
    _moe_up_tile_kernel[(I // cfg.block_n * route.tile_expert.numel(),)](
        xq, weights, route.row_pair, route.tile_expert, experts.w1, u8(experts.s1), experts.w3, u8(experts.s3), h,
        E, D, I, weights.shape[1], float(limit), HAS_LIMIT=limit > 0, BM=cfg.block_m, BN=cfg.block_n,
        BKH=_chunk(cfg.block_kh, D // 2), MMA=_moe_mma(mma), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return h


def moe_down_tiles(hq: torch.Tensor, route: MoeRoute, experts: StackedExperts, n_pairs: int, cfg: MoeConfig,
                   mma: str | None = None) -> torch.Tensor:
    """y_pair [n_pairs, D] bf16 of `_moe_down_tile_kernel` (every pair's row written once); hq [n_tiles * BM, I]
    bf16 act-quantized h in the halves layout (`kernels.quant.halves`)."""
    E, D, I = _check_experts("moe_down_tiles", experts)
    if D % cfg.block_n or cfg.block_m != route.block_m:
        _fail("moe_down_tiles", "cfg", repr(cfg), f"block_n dividing D = {D}, block_m = route.block_m")
    y = torch.empty(n_pairs, D, dtype=torch.bfloat16, device=hq.device)
    _moe_down_tile_kernel[(D // cfg.block_n * route.tile_expert.numel(),)](
        hq, route.row_pair, route.tile_expert, experts.w2, experts.s2.view(torch.uint8), y, E, D, I,
        BM=cfg.block_m, BN=cfg.block_n, BKH=_chunk(cfg.block_kh, I // 2), MMA=_moe_mma(mma),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def gemv_shapes(T: int, D: int, I: int, mma: str | None) -> tuple[MoeConfig, MoeConfig]:
    """The (up, down) launch shapes of `moe_experts`' decode kernels for a T-token call at model width D and expert
    width I (GEMV_SHAPES: one token with the element-wise nibble decode - `_one_token_mma` "bf16" -, one token
    packed, more tokens); a shape whose block_n does not divide I (up) or D (down) is replaced by
    `moe_config(1, 1)`'s."""
    if T > GEMV_QUANT_MAX_T:
        up, down = GEMV_SHAPES[2]
    else:
        up, down = GEMV_SHAPES[0 if _one_token_mma(mma, D) == "bf16" else 1]
    if I % up.block_n or D % down.block_n:
        base = moe_config(1, 1)
        up, down = (up if I % up.block_n == 0 else base), (down if D % down.block_n == 0 else base)
    return up, down


def _check_config(cfg, D: int, I: int) -> None:
    ok = isinstance(cfg, MoeConfig) and cfg.path in ("gemv", "tiles") and cfg.block_n >= 1 and \
        D % cfg.block_n == 0 and I % cfg.block_n == 0 and cfg.block_kh >= 16 and \
        cfg.block_kh & (cfg.block_kh - 1) == 0 and cfg.block_n & (cfg.block_n - 1) == 0 and \
        (cfg.path == "gemv" or cfg.block_m in (16, 32, 64, 128))
    if ok and (not isinstance(cfg.num_stages, int) or isinstance(cfg.num_stages, bool) or
               not 1 <= cfg.num_stages <= 4):
        _fail("moe_experts", "config.num_stages", repr(cfg.num_stages),
              "an int in 1..4 (pipeline stages of the K loop)")
    if not ok:
        _fail("moe_experts", "config", repr(cfg), f"a MoeConfig: path 'gemv'/'tiles', power-of-two block_n "
              f"dividing D = {D} and I = {I}, power-of-two block_kh >= 16, tiles: block_m in 16/32/64/128")


def moe_experts(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: StackedExperts,
                limit: float, *, mma: str | None = None, config: MoeConfig | None = None,
                invariant: bool = False, shared: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts of one MoE layer on the device, no host sync: act-quantize x, the up launch (w1, w3, SwiGLU
    with clamps and routing weight), act-quantize h, the down launch (w2), then the fp32 sum over slots.

    Args: x [T, D] bf16; weights [T, k] fp32; indices [T, k] int32/int64 in [0, E); experts: StackedExperts
    (`stack_experts`); limit: swiglu_limit (0 = no clamp); mma: None | "bf16" | "bf16x2", the nibble decode
    (`_moe_mma`: "bf16x2" decodes the same values by packed PTX, "bf16" element-wise; "fp8" is refused) - the tile
    path's dot flavour, and the gemv path's decode (`_gemv_dec`; None at one token below
    GEMV_QUANT_PACKED_MIN_D takes the element-wise decode, measured faster there); config: a MoeConfig to force
    a path / tiles (tests, benchmarks; one shape for both kernels), default `moe_config(T * k, E)`, the gemv
    path's up and down kernels then launched with `gemv_shapes(T, D, I, mma)` (measured per kernel); invariant:
    the batch-invariant mode (README "Batch-invariant mode"): the "gemv" path (`moe_config(1, E)`) up to
    INVARIANT_GEMV_MAX_T tokens, INVARIANT_TILES above (a pair's output never depends on which other pairs share
    its expert, nor on T on either side; the default's path, tile shape and padding follow the pair count), and
    the k slots summed left to right by elementwise adds (no reduction kernel whose
    configuration follows T); config must be None.
    shared: the shared expert's output [T, D] (bf16 / fp32, contiguous) or None: the slot sum then adds it and
    rounds to shared.dtype in the same launch (`moe_combine` of the routed sum, bitwise; issue 27).
    Returns: [T, D] fp32 (shared None), equal to `moe_grouped_ref` up to fp32 summation order (see tests for the
    tolerance); with shared, `moe_combine_ref(that, shared)` in shared.dtype.
    An id outside [0, E): the gemv path writes NaN rows; the tile path trips `moe_route`'s device-side assert.
    Raises: ValueError naming the wrong argument (shape, dtype, layout, device, mma, config).
    """
    op = "moe_experts"
    E, D, I = _check_experts(op, experts)
    T, k = _check_routing(op, x, weights, indices, D)
    check_layout(op, {"x": x, "weights": weights, "indices": indices, **experts._asdict()})
    if not isinstance(limit, (int, float)) or isinstance(limit, bool) or not limit >= 0:
        _fail(op, "limit", repr(limit), "a float >= 0 (swiglu_limit; 0 = no clamp)")
    _moe_mma(mma)  # validate before any launch
    if shared is not None:
        _rows_check(op, "shared", shared, (torch.bfloat16, torch.float32), 2)
        if tuple(shared.shape) != (T, D):
            _fail(op, "shared", f"shape {tuple(shared.shape)}", f"[T, D] = {(T, D)} (the shared expert's output)")
        check_layout(op, {"x": x, "shared": shared})
    P = T * k
    if invariant and config is not None:
        _fail(op, "config", repr(config), "None with invariant=True (the mode fixes the path)")
    if invariant:
        cfg = moe_config(1, E) if T <= INVARIANT_GEMV_MAX_T else INVARIANT_TILES
    else:
        cfg = moe_config(P, E) if config is None else config
    _check_config(cfg, D, I)
    if P == 0:
        y0 = torch.zeros(T, D, dtype=torch.float32, device=x.device)
        return y0 if shared is None else moe_combine(y0, shared)
    if cfg.path == "gemv":
        # pairs in pair order at every T (module docstring: the pair is the grid's fastest axis, so pairs of one
        # expert share its rows through L2 without a sort; the sort cost 12-31 µs and saved nothing). Where the K
        # chunk holds whole 128-input blocks, the code-value products of `_fp4_gemv_codes` (packed nibble decode
        # by default): x and h act-quantized inside the gemv kernels up to GEMV_QUANT_MAX_T tokens (two launches
        # fewer), else by one act_quant launch each that writes the e4m3 codes and scales (x quantized once, not
        # in every program); other chunks take the act_quant_sim values and the fp16 decode route. Same values.
        up_cfg, down_cfg = (cfg, cfg) if invariant or config is not None else gemv_shapes(T, D, I, mma)
        xin, xkw = _gemv_operand(x, up_cfg, mma, T, D)
        h = moe_up_gemv(xin, weights, indices, None, experts, limit, up_cfg, **xkw)
        hin, hkw = _gemv_operand(h, down_cfg, mma, T, D)
        y = moe_down_gemv(hin, indices, None, experts, down_cfg, **hkw)
    else:
        # act_quant_sim's values stored in the halves layout (`kernels.quant.halves`), the tile kernels' input
        xq = act_quant_sim(x, 128, halves=True)
        route = moe_route(indices, E, cfg.block_m)
        h = moe_up_tiles(xq, weights, route, experts, limit, cfg, mma)
        y = moe_down_tiles(act_quant_sim(h, 128, halves=True), route, experts, P, cfg, mma)
    return sum_slots(y.view(T, k, D), shared)  # the k slots left to right in fp32 (+ shared), one launch


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


def stackable(experts: Sequence[ExpertWeights | None]) -> bool:
    """Whether `stack_experts` and `moe_experts` apply to one layer's routed experts, from the tensors' dtypes and
    shapes alone: every expert present (none held by another rank), held FP4 (int8 e2m1 codes; checked on the
    first expert, `stack_experts` refuses any other loudly), D and I multiples of 128 (the kernels' act_quant
    blocks). The model stacks where this holds and its activations are bf16 (`dsv4.model.MoE.stackable`)."""
    ex = list(experts)
    if not ex or any(e is None for e in ex):
        return False
    e0 = ex[0]
    return e0.w1.dtype == torch.int8 and e0.w1.shape[1] * 2 % 128 == 0 and e0.w2.shape[1] * 2 % 128 == 0


# ---------------------------------------------------------------------------------------------------------
# The triton backend's entry
# ---------------------------------------------------------------------------------------------------------

def moe_routed(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               experts: Sequence[ExpertWeights | None] | StackedExperts, limit: float,
               act_blocks: tuple[int, int]) -> torch.Tensor:
    """The triton backend's `moe_routed` entry, the signature of `moe_routed_ref` (table in `dsv4/backend.py`):
    x [N, D], weights / ids [N, k] -> [N, D] fp32.

    `StackedExperts` (the model stacked its FP4 experts: `stackable`, `stack_experts`) with bf16 x ->
    `moe_experts` (grouped, reads nothing back to the host: CUDA-graph capturable; x and h act-quantized in
    128-channel blocks, so act_blocks must be (128, 128)). Anything else (per-expert weights: bf16 / dequantized
    experts, tiny widths, expert parallel; or fp32 x) -> `moe_routed_ref` with `linear=kernels.gemm.linear`, the
    triton backend's linear: the same loop, each expert's GEMMs on that backend's paths (a host sync per
    expert). Raises ValueError as `moe_experts` / `moe_routed_ref`, and for act_blocks other than (128, 128) on
    the grouped path."""
    if isinstance(experts, StackedExperts) and x.dtype == torch.bfloat16:
        if tuple(act_blocks) != (128, 128):
            _fail("moe_routed", "act_blocks", repr(act_blocks), "(128, 128) for stacked FP4 experts and bf16 x (the "
                  "grouped kernels act-quantize x and h in 128-channel blocks)")
        return moe_experts(x.contiguous(), weights.contiguous(), ids.contiguous(), experts, limit)
    return moe_routed_ref(x, weights, ids, experts, limit, act_blocks, linear=gemm.linear)


# ---------------------------------------------------------------------------------------------------------
# Small fused epilogues of the MoE layer (issue 27: one launch each instead of torch's two to five)
# ---------------------------------------------------------------------------------------------------------
def _rows_check(op: str, name: str, t: torch.Tensor, dtypes, dim: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or t.dim() != dim:
        _fail(op, name, f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}",
              f"a {dim}-d tensor of dtype in {[str(d) for d in dtypes]}")


def sum_slots(y: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, k, D] (the routed experts' per-slot outputs, bf16 or fp32) -> [T, D] fp32: sum over the k slots in
    fp32, left to right (slot 0 first; one order for every T, so batch invariant). One launch; torch's
    `y.float().sum(1)` (two launches) sums the same terms in an order of its choosing (spec §8: the routed experts'
    outputs summed in fp32). shared [T, D] (bf16 / fp32 contiguous on y's device, the shared expert's output):
    added to the fp32 sum and rounded to shared.dtype in the same launch - bitwise `moe_combine(sum_slots(y),
    shared)`. Raises ValueError for a bad y or shared (dtype, shape, layout, device)."""
    op = "sum_slots"
    _rows_check(op, "y", y, (torch.bfloat16, torch.float32), 3)
    check_layout(op, {"y": y})
    T, k, D = y.shape
    if shared is not None:
        _rows_check(op, "shared", shared, (torch.bfloat16, torch.float32), 2)
        if tuple(shared.shape) != (T, D):
            _fail(op, "shared", f"shape {tuple(shared.shape)}", f"[T, D] = {(T, D)} (one row per token of y)")
        check_layout(op, {"y": y, "shared": shared})
    if shared is not None and not k:
        return moe_combine(torch.zeros(T, D, dtype=torch.float32, device=y.device), shared)
    out = torch.empty(T, D, dtype=torch.float32 if shared is None else shared.dtype, device=y.device)
    if T and D and k:
        _sum_slots_kernel[(T, triton.cdiv(D, 1024))](y, y if shared is None else shared, out, T, D, K=k,
                                                     HAS_SHARED=shared is not None, BD=1024)
    elif T and D:
        out.zero_()
    return out


def moe_combine_ref(y: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """The MoE layer's output (spec §8; `dsv4.model.MoE.forward`): routed sum y [..., D] fp32 plus the shared
    expert's output shared [..., D] (activation dtype), in fp32, rounded to shared.dtype. Raises ValueError when
    the shapes differ (they would broadcast) or y is not fp32."""
    if not isinstance(y, torch.Tensor) or not isinstance(shared, torch.Tensor) or y.shape != shared.shape or \
            y.dtype != torch.float32 or not shared.is_floating_point():
        _fail("moe_combine_ref", "y, shared", f"{getattr(y, 'dtype', type(y))} {tuple(getattr(y, 'shape', ()))}, "
              f"{getattr(shared, 'dtype', type(shared))} {tuple(getattr(shared, 'shape', ()))}",
              "y fp32 and shared floating point, of one shape [..., D]")
    return (y + shared.float()).to(shared.dtype)


def moe_combine(y: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """`moe_combine_ref` in one launch (torch: three): the same fp32 sum and one rounding, bitwise equal.
    Args: y [..., D] fp32, shared [..., D] bf16 / fp32 of the same shape, contiguous, on one device.
    Returns: [..., D] in shared.dtype. Raises ValueError naming a bad argument."""
    op = "moe_combine"
    if not isinstance(y, torch.Tensor) or y.dtype != torch.float32:
        _fail(op, "y", f"{getattr(y, 'dtype', type(y))}", "float32 (the routed sum)")
    if (not isinstance(shared, torch.Tensor) or shared.dtype not in (torch.bfloat16, torch.float32)
            or tuple(shared.shape) != tuple(y.shape) or y.dim() < 1):
        _fail(op, "shared", f"{getattr(shared, 'dtype', type(shared))} {tuple(getattr(shared, 'shape', ()))}",
              f"bf16 / float32 of y's shape {tuple(y.shape)}")
    check_layout(op, {"y": y, "shared": shared})
    D = y.shape[-1]
    T = y.numel() // max(D, 1)
    out = torch.empty_like(shared)
    if T and D:
        _sum_slots_kernel[(T, triton.cdiv(D, 1024))](y, shared, out, T, D, K=1, HAS_SHARED=True, BD=1024)
    return out


def swiglu_joint_ref(uv: torch.Tensor, limit: float) -> torch.Tensor:
    """The shared expert's SwiGLU on its joint projection uv [..., 2I] = [w1 x | w3 x] (the two GEMMs as one,
    `dsv4.model.Expert.w13`; activation dtype): `swiglu(u.float(), v.float(), limit)` (spec §8.5) rounded to
    uv.dtype, [..., I]. Raises ValueError naming the argument: uv not a float tensor with an even last dim,
    limit not a number >= 0."""
    op = "swiglu_joint_ref"
    if not isinstance(uv, torch.Tensor) or not uv.dtype.is_floating_point or uv.dim() < 1 or uv.shape[-1] % 2:
        _fail(op, "uv", f"{getattr(uv, 'dtype', type(uv))} {tuple(getattr(uv, 'shape', ()))}",
              "a float tensor [..., 2I] (an even last dim)")
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit >= 0:
        _fail(op, "limit", repr(limit), "a number >= 0 (swiglu_limit; 0 = no clamp)")
    u, v = uv.chunk(2, -1)
    return swiglu(u.float(), v.float(), limit).to(uv.dtype)


def swiglu_joint(uv: torch.Tensor, limit: float) -> torch.Tensor:
    """`swiglu_joint_ref` in one launch (torch: seven - two casts, two clamps, silu, product, cast): the same fp32
    maths (silu as u / (1 + e^-u)) except exp: Triton's is ex2.approx after a multiply by log2(e) on the GPU, a
    relative error up to ~|u| 2^-23 where torch's is correctly rounded (fp32 outputs within 2^-16; bf16 outputs
    bitwise equal except at a rounding boundary: tests/unit/test_gemm_moe_kernels.py; the routed kernels' SwiGLU
    uses the same exp).
    Args: uv [..., 2I] bf16 / fp32 contiguous; limit a number >= 0 (swiglu_limit; 0 = no clamp).
    Returns: [..., I] in uv.dtype. Raises ValueError naming a bad argument."""
    op = "swiglu_joint"
    if (not isinstance(uv, torch.Tensor) or uv.dtype not in (torch.bfloat16, torch.float32) or uv.dim() < 1
            or uv.shape[-1] % 2):
        _fail(op, "uv", f"{getattr(uv, 'dtype', type(uv))} {tuple(getattr(uv, 'shape', ()))}",
              "a bf16 / float32 tensor [..., 2I]")
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit >= 0:
        _fail(op, "limit", repr(limit), "a number >= 0 (swiglu_limit; 0 = no clamp)")
    check_layout(op, {"uv": uv})
    I = uv.shape[-1] // 2
    M = uv.numel() // max(2 * I, 1)
    h = torch.empty(*uv.shape[:-1], I, dtype=uv.dtype, device=uv.device)
    if M and I:
        BI = min(1024, triton.next_power_of_2(I))
        _swiglu_joint_kernel[(M, triton.cdiv(I, BI))](uv, h, M, I, float(limit), HAS_LIMIT=limit > 0, BI=BI)
    return h


def linear_swiglu_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, act_block: int,
                      limit: float) -> torch.Tensor:
    """The shared expert's joint projection and SwiGLU (spec §8.5): `swiglu_joint_ref(linear_ref(x, weight, scale,
    act_block), limit)`; x [..., D], weight the joint [w1; w3] as held ([2I, D] FP8 codes + ue8m0 scale, or a
    float weight) -> [..., I] in x.dtype. The two steps `dsv4.model.Expert.forward` runs where the backend has no
    `linear_swiglu`."""
    return swiglu_joint_ref(gemm.linear_ref(x, weight, scale, act_block), limit)


def linear_swiglu(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, act_block: int,
                  limit: float) -> torch.Tensor:
    """The triton backend's `linear_swiglu` entry (`dsv4.model.Expert.forward` with the joint w13), the signature
    of `linear_swiglu_ref`: ONE launch where the decode has one row (`kernels.gemm.fp8_gemv_swiglu`: bf16 x, FP8
    weight with act_block, D and I multiples of 128; bitwise the two launches below, issue 27), else
    `swiglu_joint(kernels.gemm.linear(...))` (two launches; their own paths). Raises ValueError from the kernels'
    argument checks."""
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() < (1 if name == "x" else 2):
            _fail("linear_swiglu", name, f"{type(t).__name__} {tuple(getattr(t, 'shape', ()))}",
                  "a tensor (x [..., D], weight [2I, D] as held)")
    D = x.shape[-1]
    if (x.dtype == torch.bfloat16 and weight.dtype == torch.float8_e4m3fn and act_block and D % 128 == 0
            and x.numel() == D and weight.shape[0] % 256 == 0):
        h = gemm.fp8_gemv_swiglu(x.reshape(1, D).contiguous(), weight, scale, limit)
        return h.view(*x.shape[:-1], h.shape[-1])
    return swiglu_joint(gemm.linear(x, weight, scale, act_block), limit)


def moe_routed_combine_ref(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts, limit: float,
                           act_blocks: tuple[int, int], shared: torch.Tensor) -> torch.Tensor:
    """The MoE layer's output at world size 1 (spec §8): `moe_combine_ref(moe_routed_ref(...), shared)`; x [N, D],
    shared [N, D] the shared expert's output -> [N, D] in shared.dtype. What `dsv4.model.MoE.forward` computes in
    two calls where the backend has no `moe_routed_combine`."""
    return moe_combine_ref(moe_routed_ref(x, weights, ids, experts, limit, act_blocks), shared)


def moe_routed_combine(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts, limit: float,
                       act_blocks: tuple[int, int], shared: torch.Tensor) -> torch.Tensor:
    """The triton backend's `moe_routed_combine` entry, the signature of `moe_routed_combine_ref`: on the grouped
    path (`moe_routed`'s conditions) `moe_experts(..., shared=shared)` - the slot sum adds the shared output and
    rounds in its one launch (issue 27: one launch fewer per layer), bitwise `moe_combine(moe_routed(...),
    shared)`; elsewhere those two calls. Raises ValueError as they do."""
    op = "moe_routed_combine"
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        _fail(op, "x", f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}", "a tensor [N, D]")
    if not isinstance(shared, torch.Tensor) or tuple(shared.shape) != tuple(x.shape):
        _fail(op, "shared", f"{type(shared).__name__} {tuple(getattr(shared, 'shape', ()))}",
              f"a tensor of x's shape {tuple(x.shape)} (the shared expert's output)")
    if not isinstance(act_blocks, (tuple, list)) or len(act_blocks) != 2:
        _fail(op, "act_blocks", repr(act_blocks), "a pair (x's block, h's block)")
    if isinstance(experts, StackedExperts) and x.dtype == torch.bfloat16:
        if tuple(act_blocks) != (128, 128):
            _fail(op, "act_blocks", repr(act_blocks), "(128, 128) for stacked FP4 experts and "
                  "bf16 x (the grouped kernels act-quantize x and h in 128-channel blocks)")
        return moe_experts(x.contiguous(), weights.contiguous(), ids.contiguous(), experts, limit,
                           shared=shared.contiguous())
    return moe_combine(moe_routed(x, weights, ids, experts, limit, act_blocks), shared)
