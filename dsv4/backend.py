"""Backends: which implementation of the hot paths the model runs (spec §4, §5, §7, §9).

`reference` = the plain-torch `*_ref` functions beside each kernel in `kernels/` (the executable spec; the one
exception, the routed experts' loop over the model's `Expert` modules, is `dsv4/ops_ref.py`).
`triton` = the Triton launchers of the same modules, and the model-level fast paths of `dsv4/fast.py` (FP8 /
FP4 GEMMs of `kernels/gemm.py` and `kernels/moe.py`, the bf16-weight fp32 GEMV of `kernels/fp32_linear.py`, bf16
cuBLAS GEMMs; table there). The choice is explicit and checked: asking for the
triton backend where it cannot run (no CUDA device and no `TRITON_INTERPRET=1`, or triton not installed) is
an error, never a silent fallback to the reference.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch

from dsv4.ops_ref import moe_routed_ref
from kernels import attention, compressor, indexer, mhc, numerics, rope
from kernels.fp32_linear import fp32_linear_ref
from kernels.gemm import grouped_linear_ref, linear_ref
from kernels.norm import rms_norm_ref

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
    #   moe_routed(moe, x, weights, ids) -> y            `dsv4.ops_ref.moe_routed_ref`  (routed experts, fp32
    #                                                    sum; the one entry that takes a module, reason there)
    linear: Callable | None = None
    grouped_linear: Callable | None = None
    moe_routed: Callable | None = None
    #   fp32_linear(x, weight) -> y fp32                 `kernels.fp32_linear.fp32_linear_ref`  (the router
    #                                                    `Gate`; `linear(fp32=True)` computes it for the fp32
    #                                                    linears head / compressor)
    fp32_linear: Callable | None = None
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
    # prepare(moes): called once by `Transformer.__init__` with the model's MoE modules (triton:
    # `dsv4.fast.prepare` stacks the FP4 routed experts for the grouped kernel; reference: nothing to do)
    prepare: Callable = lambda moes: None
    # issue 25: the batch-invariant mode (`dsv4.invariant`): every entry above is its invariant launch, and the
    # model's decode-path torch reductions take their fixed-order forms (`Attention`, `Indexer`, `Gate`)
    batch_invariant: bool = False


def get_backend(name: str, device: torch.device, batch_invariant: bool = False) -> Backend:
    """Backend `name` for tensors on `device`; `batch_invariant=True` (triton only) builds the batch-invariant
    table (`dsv4.invariant`: its guarantee and limits; README "Batch-invariant mode").

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
                       linear=linear_ref, grouped_linear=grouped_linear_ref,
                       moe_routed=moe_routed_ref, fp32_linear=fp32_linear_ref,
                       compress_pool=compressor.compress_pool_ref,
                       compress_commit=compressor.compress_commit_ref, rms_norm=rms_norm_ref,
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
        from dsv4 import fast  # triton is an optional dependency: dsv4.fast and kernels.quant import it
        from kernels import quant as kquant  # triton is an optional dependency (as above)
        if batch_invariant:
            from dsv4 import invariant as inv
            return Backend("triton", functools.partial(mhc.hc_pre, invariant=True), mhc.hc_post,
                           functools.partial(mhc.hc_head, invariant=True), attention.invariant_sparse_attn,
                           indexer.indexer_scores, indexer_topk=indexer.indexer_topk, hc_post_pre=mhc.hc_post_pre,
                           linear=inv.linear, grouped_linear=inv.grouped_linear, moe_routed=inv.moe_routed,
                           fp32_linear=inv.fp32_linear, compress_pool=compressor.compress_pool,
                           compress_commit=compressor.compress_commit, rms_norm=fast.rms_norm,
                           rope_tail=rope.rope_tail_, act_quant_sim=kquant.act_quant_sim,
                           fp4_act_quant_sim=kquant.fp4_act_quant_sim,
                           hc_post_pre_max_t=0, prepare=inv.prepare, batch_invariant=True)
        return Backend("triton", mhc.hc_pre, mhc.hc_post, mhc.hc_head, attention.sparse_attn,
                       indexer.indexer_scores, indexer_topk=indexer.indexer_topk, hc_post_pre=mhc.hc_post_pre,
                       linear=fast.linear, grouped_linear=fast.grouped_linear, moe_routed=fast.moe_routed,
                       fp32_linear=fast.fp32_linear,
                       compress_pool=compressor.compress_pool,
                       compress_commit=compressor.compress_commit, rms_norm=fast.rms_norm,
                       rope_tail=rope.rope_tail_, act_quant_sim=kquant.act_quant_sim,
                       fp4_act_quant_sim=kquant.fp4_act_quant_sim,
                       hc_post_pre_max_t=mhc.POST_PRE_ONE_LAUNCH_MAX_T, prepare=fast.prepare)
    raise ValueError(f"backend={name!r}: expected one of {BACKENDS}")
