"""Backends: which implementation of the hot paths the model runs (spec §4, §5, §7, §9).

`reference` = the plain-torch `*_ref` functions beside each kernel in `kernels/` (the executable spec).
`triton` = the Triton launchers of the same modules, and the model-level entries beside their references
(`kernels.gemm.linear` / `grouped_linear`, `kernels.fp32_linear.fp32_linear_op`, `kernels.norm.rms_norm_op`,
`kernels.moe.moe_routed`; table below). Both tables are built here from `kernels/` functions only. The choice is
explicit and checked: asking for the triton backend where it cannot run (no CUDA device and no
`TRITON_INTERPRET=1`, or triton not installed) is an error, never a silent fallback to the reference.

Which path the triton backend's model-level entries run (issue 13). The references are the executable spec;
these compute the same maths with kernels, with the same signatures (functions of tensors and plain numbers).
Which path runs is decided by the weight's dtype (its resident format), the arguments and the activation dtype,
never by a failure (nothing falls back silently; every row below is deliberate):

| what | bf16 mode (official numerics) | fp32 mode (exact) |
|---|---|---|
| FP8 linear (weight float8_e4m3fn, act_block > 0, in % 128 == 0) | `kernels.gemm.fp8_linear` (W8A8, ue8m0 blocks; one row: the no-split-K one-row GEMV; 2-8 rows the GEMV; 9-64 rows the 64-row tiles) | reference maths (fp32 GEMM) |
| other bf16 linears (weights_proj, dequantized mode) | act quant (if act_block > 0) + bf16 cuBLAS GEMM, fp32 accumulation | reference maths |
| fp32 linears (head, compressor wkv/wgate via `linear(fp32=True)`; router gate via `fp32_linear`), weight held bf16 (weights="quantized"), M <= 64 rows | `kernels.fp32_linear.fp32_linear` (bf16 bytes read once, fp32 products and sum) | same |
| those, weight held bf16, M > 64 (prefill of router / compressor) | bf16 x on CUDA: cuBLAS's bf16 GEMM with an fp32 output (exact products accumulated in fp32 on the tensor cores; `torch.mm(out_dtype=torch.float32)`); fp32 x or the CPU: exact fp32 upcasts + fp32 `torch.mm` (inside `kernels.fp32_linear.fp32_linear`) | same |
| those, weight held fp32 (weights="dequantized") | reference maths: fp32 in, fp32 GEMM, fp32 out (as officially) | reference maths |
| grouped wo_a, FP8, b*s <= 64 (decode) | `kernels.gemm.fp8_grouped_gemv` (FP8 codes read directly, one launch, no act quant) | reference maths |
| grouped wo_a otherwise | bf16 weight (`kernels.gemm.fp8_dequant`) + bf16 cuBLAS bmm, no act quant | reference maths |
| router after the logits (every `Gate`: scores, top-k or hash ids, normalisation, route_scale) | `kernels.router.route` (one launch, bitwise equal to `route_ref`) | `kernels.router.route` |
| RMSNorm (every norm) | `kernels.norm.rms_norm` (one launch, same fp32 maths) | `kernels.norm.rms_norm` |
| routed experts (FP4, widths % 128 == 0, all experts on this rank: stacked, `kernels.moe.stackable`) | `kernels.moe.moe_experts` (grouped, sync-free: CUDA-core GEMV path up to `GEMV_MAX_PAIRS` pairs with x and h act-quantized in its kernels, bf16 tensor-core tiles above, 32 / 64 / 128 token rows by pairs per expert) | reference loop |
| routed experts otherwise (bf16 / dequantized experts, tiny widths, expert parallel) | reference loop (`kernels.moe.moe_routed_ref` with the triton `linear`; host sync per expert) | reference loop |

Why the bf16 cuBLAS GEMM equals the reference: act-quantized activations (e4m3 code x power of two) and
dequantized FP8 / FP4 weights are exact in bf16, and cuBLAS multiplies bf16 with fp32 accumulation, so the
result equals the reference's fp32 product up to summation order (measured on an H200: 0.0% / 0.05% / 0.12%
of outputs differ by one bf16 rounding at M = 1 / 8 / 1024, K = 4096; benchmarks/RESULTS.md, issue 13).
Narrow widths (test-scale models, in % 128 != 0) quantize activations with `kernels.numerics.act_quant_sim` (as
`linear_ref` does) because the FP8 kernels need 128-channel blocks.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import attention, compressor, gemm, indexer, invariant, mhc, moe, norm, numerics, rope, router
from kernels import fp32_linear as kfp32

__all__ = ["Backend", "get_backend", "BACKENDS"]

BACKENDS = ("reference", "triton")


@dataclass(frozen=True)
class Backend:
    """The hot-path functions, each with the signature of its `*_ref` in kernels/ (see there for shapes)."""

    name: str
    hc_pre: Callable
    hc_post: Callable
    hc_head: Callable
    sparse_attn: Callable
    indexer_scores: Callable
    # issue 14: top-k selection (None = the model's shared `indexer_topk_ref`, looked up in dsv4.model at call
    # time, as the reference backend does) and the fused decode layer boundary
    # `hc_post_pre(a, H, post, comb, fn, base, scale, ...)` = hc_post of one site then hc_pre of the next.
    indexer_topk: Callable | None = None
    hc_post_pre: Callable | None = None
    # Model-level entries (issue 13; tensor signatures since issue 23), signatures of the references:
    #   linear(x, weight, scale, act_block, fp32) -> y   `kernels.gemm.linear_ref`  (every Linear.forward; the
    #                                                    weight as held: codes + ue8m0 scale, or a float weight)
    #   grouped_linear(o, weight, scale) -> z            `kernels.gemm.grouped_linear_ref`  (the grouped wo_a)
    #   moe_routed(x, weights, ids, experts, limit, act_blocks) -> y   `kernels.moe.moe_routed_ref`  (routed
    #                                                    experts, fp32 sum; experts: per-expert weights as held
    #                                                    or one `StackedExperts`)
    linear: Callable | None = None
    grouped_linear: Callable | None = None
    moe_routed: Callable | None = None
    #   fp32_linear(x, weight) -> y fp32                 `kernels.fp32_linear.fp32_linear_ref`  (the router
    #                                                    `Gate`; `linear(fp32=True)` computes it for the fp32
    #                                                    linears head / compressor)
    fp32_linear: Callable | None = None
    #   route(logits, bias, hash_ids, topk, score_func, route_scale) -> (weights, ids)   `kernels.router.route_ref`
    #                                                    (the router after its logits, every `Gate.forward`;
    #                                                    triton: `kernels.router.route`, one launch, bitwise equal;
    #                                                    one program per row, so batch invariant as it is)
    route: Callable | None = None
    # the compressor's decode step (graph decode): `kernels.compressor.compress_pool_ref` / `compress_commit_ref`
    compress_pool: Callable | None = None
    compress_commit: Callable | None = None
    #   rms_norm(x, weight, eps) -> y                    `kernels.norm.rms_norm_ref`  (every RMSNorm.forward)
    rms_norm: Callable | None = None
    # RoPE of the last rd columns (graph decode): `kernels.rope.rope_tail_ref(x, pos, inv_freq, rd, inverse)`
    # signature; the triton entry rotates x in place and returns it (callers pass a tensor they own)
    rope_tail: Callable | None = None
    # quantization simulations (graph decode): `kernels.numerics.act_quant_sim(x, block)` / `fp4_act_quant_sim`
    act_quant_sim: Callable | None = None
    fp4_act_quant_sim: Callable | None = None
    # the decode-sized threshold of the fused layer boundary: `Transformer` defers each hc_post into the next
    # hc_pre (`hc_post_pre`) when b*s <= this (triton: `kernels.mhc.POST_PRE_ONE_LAUNCH_MAX_T`, where the fused
    # kernel runs; reference: 0, never: its `hc_post_pre_ref` composes hc_post then hc_pre, the same maths)
    hc_post_pre_max_t: int = 0
    # stack_experts(experts) -> StackedExperts: `Transformer.__init__` stacks each layer's routed experts once
    # with it where `kernels.moe.stackable` holds and the activations are bf16 (`MoE.stackable`), and hands the
    # stack to `moe_routed` (triton: `kernels.moe.stack_experts`, for the grouped kernel; reference: None, never)
    stack_experts: Callable | None = None
    # head_rms(q [..., d], eps) -> q.dtype: the attention's unweighted per-head RMS of q (`kernels.norm.head_rms_ref`,
    # the official torch chain; triton: `kernels.norm.head_rms`, one launch, in both modes); hadamard(x fp32
    # [..., n]) -> fp32: the indexer's rotation `x @ hadamard_matrix(n).T`. None: the model's fp32 matmul; the
    # batch-invariant mode's per-row kernel (`kernels.invariant.hadamard`: an order fixed for every row count)
    head_rms: Callable = norm.head_rms_ref
    hadamard: Callable | None = None
    # pool_windows(Z, A [b, n, w, d] fp32) -> [b, n, d] fp32: the compressor's prefill pooling (`Compressor.extend`).
    # None: `(Z.softmax(2) * A).sum(2)` (torch); the batch-invariant mode's fixed-order form
    # (`kernels.invariant.pool_windows`: the same windows pooled in the same order whatever the call's length)
    pool_windows: Callable | None = None
    # q_finish(q [b, s, h, d], eps, pos, inv_freq, rd) -> q.dtype: `head_rms` then `rope_tail` in one launch (None:
    # the two entries; triton: `kernels.norm.head_rms_rope`)
    q_finish: Callable | None = None
    # kv_finish(x [b, s, D], weight, eps, pos, inv_freq, rd, nope_block, window, dtype) -> [b, s, D] dtype: a KV row's
    # norm, RoPE of the tail and e4m3 rounding of the nope channels (the attention's kv, a compressor's entries).
    # None: the model's chain of modules and entries (kv_norm / norm, rope_tail, act_quant_sim: the spec, and what
    # hooks observe); triton: `kernels.rope.kv_finish`, one launch (equal to that chain: `kv_finish_ref`)
    kv_finish: Callable | None = None
    # moe_combine(y fp32 [..., D], shared [..., D]) -> shared.dtype: the MoE layer's routed + shared output
    # (`kernels.moe.moe_combine_ref`; triton: `moe_combine`, one launch, bitwise equal); swiglu_joint(uv [..., 2I],
    # limit) -> [..., I]: the shared expert's SwiGLU on its joint projection [w1 x | w3 x] (`swiglu_joint_ref`;
    # triton: `swiglu_joint`, one launch); join_linears: `Transformer.__init__` holds the FP8 projections that read
    # the same input as one weight (`dsv4.model.join_fp8`: each shared expert's w1 / w3, each attention's wq_a /
    # wkv) so each pair is one launch (triton; the reference keeps them apart)
    moe_combine: Callable = moe.moe_combine_ref
    swiglu_joint: Callable = moe.swiglu_joint_ref
    # linear_swiglu(x, weight, scale, act_block, limit) -> [..., I]: the joint w13 projection and its SwiGLU
    # (`kernels.moe.linear_swiglu_ref`); triton: `kernels.moe.linear_swiglu`, one launch at one decode row (issue
    # 27); None (reference, batch-invariant): `Expert.forward` runs linear then swiglu_joint
    linear_swiglu: Callable | None = None
    # moe_routed_combine(x, weights, ids, experts, limit, act_blocks, shared) -> [N, D] shared.dtype: the routed
    # experts and the combine with the shared expert's output in one call (`kernels.moe.moe_routed_combine_ref`);
    # triton: `kernels.moe.moe_routed_combine` (the slot sum adds shared: one launch fewer, bitwise the two
    # entries); None (reference, batch-invariant): `MoE.forward` calls moe_routed then moe_combine
    moe_routed_combine: Callable | None = None
    # qkv_finish(q, q_eps, pos, inv_freq, rd, kv, weight, eps, nope_block, ring, index) -> (q, kv, idx): the
    # attention's q_finish and kv_finish (window 1) in one call, and with index = (W, ratio, n_entries) the decode
    # step's `step_index` of a window-only / HCA layer (else idx None); triton: `kernels.rope.qkv_finish`, one
    # launch, bitwise the separate entries; None: `Attention._qkv` / `step` call them apart
    qkv_finish: Callable | None = None
    # sparse_attn_rope(q, kv, attn_sink, idx, scale, pos, inv_freq, rd) -> o: the attention with its output's RoPE
    # channels de-rotated (`kernels.rope.sparse_attn_rope_ref`); triton: `kernels.attention.sparse_attn_rope`,
    # one launch, bitwise sparse_attn + rope_tail_(inverse); None: `Attention` calls sparse_attn then rope_tail
    sparse_attn_rope: Callable | None = None
    # rope_rotate_fp4(x, pos, inv_freq, rd) -> bf16: the indexer query's RoPE tail then its Hadamard rotation and
    # FP4 rounding (bf16 mode); triton: `kernels.indexer.rope_rotate_fp4`, one launch, bitwise rope_tail_ +
    # rotate_fp4; None: `Indexer.select` calls them apart
    rope_rotate_fp4: Callable | None = None
    # indexer_scores_scaled(q, weights, k, weight_scale) -> fp32 scores from the raw bf16 weights_proj output
    # (`kernels.indexer.indexer_scores_scaled_ref`); triton: `kernels.indexer.indexer_scores_scaled`, the scale
    # inside the scoring launch, bitwise; None: `Indexer.select` multiplies, then calls indexer_scores
    indexer_scores_scaled: Callable | None = None
    join_linears: bool = False
    # rotate_fp4(x bf16 [..., n]) -> bf16: the indexer's Hadamard rotation, bf16 rounding and FP4 rounding of q /
    # its keys in bf16 mode (`kernels.indexer.rotate_fp4_ref`; None: the model's chain of `hadamard` and
    # `fp4_act_quant_sim`; triton default mode: `kernels.indexer.rotate_fp4`, one launch)
    rotate_fp4: Callable | None = None
    # step_index(P [b, s] int64, W, comp [b, s, k] | None, ratio, n_entries) -> idx [b, s, W + k] int64: the key
    # slots of a decode step's queries (window in position order, then the entries; `kernels.attention.step_index_ref`;
    # triton: `kernels.attention.step_index`, one launch, the same integers)
    step_index: Callable = attention.step_index_ref
    # issue 25: the batch-invariant mode (`kernels.invariant`): every entry above is its invariant launch, the
    # model's torch reductions take their fixed-order forms (head_rms, hadamard above; `Gate`), and
    # `Transformer.__init__` refuses a MoE the grouped kernel cannot take
    batch_invariant: bool = False


def get_backend(name: str, device: torch.device, batch_invariant: bool = False) -> Backend:
    """Backend `name` for tensors on `device`; `batch_invariant=True` (triton only) builds the batch-invariant
    table (`kernels.invariant`: its guarantee and limits; README "Batch-invariant mode").

    Raises:
        ValueError: unknown name, "triton" on a non-CUDA device without TRITON_INTERPRET=1, batch_invariant not a
            bool, or batch_invariant=True with "reference" (cuBLAS picks its GEMM algorithm by the row count: not
            batch invariant, and dsv4 does not replace it there).
        ImportError: "triton" requested and the triton package is missing.
    """
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant={batch_invariant!r}: expected a bool")
    if batch_invariant and name == "reference":
        raise ValueError("batch_invariant=True needs backend='triton': the reference backend's matmuls are "
                         "cuBLAS / CPU BLAS, whose algorithm (and so the summation order) follows the row count")
    if name == "reference":
        return Backend("reference", mhc.hc_pre_ref, mhc.hc_post_ref, mhc.hc_head_ref,
                       attention.sparse_attn_ref, indexer.indexer_scores_ref,
                       indexer_topk=None, hc_post_pre=mhc.hc_post_pre_ref,
                       linear=gemm.linear_ref, grouped_linear=gemm.grouped_linear_ref,
                       moe_routed=moe.moe_routed_ref, fp32_linear=kfp32.fp32_linear_ref, route=router.route_ref,
                       compress_pool=compressor.compress_pool_ref,
                       compress_commit=compressor.compress_commit_ref, rms_norm=norm.rms_norm_ref,
                       rope_tail=rope.rope_tail_ref, act_quant_sim=numerics.act_quant_sim,
                       fp4_act_quant_sim=numerics.fp4_act_quant_sim)
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ImportError("backend 'triton' requested but the triton package is not installed "
                              "(pip install 'dsv4[triton]')")
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        if device.type != "cuda" and not interp:
            raise ValueError(f"backend 'triton' needs a CUDA device (got {device}); on CPU it runs only under "
                             "TRITON_INTERPRET=1. Use backend='reference' explicitly instead.")
        from kernels import quant as kquant  # triton is an optional dependency: kernels.quant imports it
        if batch_invariant:
            return Backend("triton", functools.partial(mhc.hc_pre, invariant=True), mhc.hc_post,
                           functools.partial(mhc.hc_head, invariant=True), attention.invariant_sparse_attn,
                           indexer.indexer_scores, indexer_topk=indexer.indexer_topk, hc_post_pre=mhc.hc_post_pre,
                           linear=invariant.linear, grouped_linear=invariant.grouped_linear,
                           moe_routed=invariant.moe_routed, fp32_linear=invariant.fp32_linear, route=router.route,
                           compress_pool=compressor.compress_pool,
                           compress_commit=compressor.compress_commit, rms_norm=norm.rms_norm_op,
                           rope_tail=rope.rope_tail_, act_quant_sim=kquant.act_quant_sim,
                           fp4_act_quant_sim=kquant.fp4_act_quant_sim,
                           hc_post_pre_max_t=0, stack_experts=moe.stack_experts, head_rms=invariant.head_rms,
                           hadamard=invariant.hadamard, pool_windows=invariant.pool_windows,
                           step_index=attention.step_index, moe_combine=moe.moe_combine,
                           swiglu_joint=moe.swiglu_joint, join_linears=True, kv_finish=rope.kv_finish,
                           q_finish=norm.head_rms_rope, batch_invariant=True)
        return Backend("triton", mhc.hc_pre, mhc.hc_post, mhc.hc_head, attention.sparse_attn,
                       indexer.indexer_scores, indexer_topk=indexer.indexer_topk, hc_post_pre=mhc.hc_post_pre,
                       linear=gemm.linear, grouped_linear=gemm.grouped_linear, moe_routed=moe.moe_routed,
                       fp32_linear=kfp32.fp32_linear_op, route=router.route,
                       compress_pool=compressor.compress_pool,
                       compress_commit=compressor.compress_commit, rms_norm=norm.rms_norm_op,
                       rope_tail=rope.rope_tail_, act_quant_sim=kquant.act_quant_sim,
                       fp4_act_quant_sim=kquant.fp4_act_quant_sim,
                       hc_post_pre_max_t=mhc.POST_PRE_ONE_LAUNCH_MAX_T, stack_experts=moe.stack_experts,
                       head_rms=norm.head_rms, step_index=attention.step_index, rotate_fp4=indexer.rotate_fp4,
                       moe_combine=moe.moe_combine, swiglu_joint=moe.swiglu_joint, join_linears=True,
                       kv_finish=rope.kv_finish, q_finish=norm.head_rms_rope, linear_swiglu=moe.linear_swiglu,
                       moe_routed_combine=moe.moe_routed_combine, qkv_finish=rope.qkv_finish,
                       sparse_attn_rope=attention.sparse_attn_rope, rope_rotate_fp4=indexer.rope_rotate_fp4,
                       indexer_scores_scaled=indexer.indexer_scores_scaled)
    raise ValueError(f"backend={name!r}: expected one of {BACKENDS}")
