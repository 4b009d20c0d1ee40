"""Ahead-of-time compilation of every Triton kernel in `kernels/` for a chosen GPU target (issue 14, item 5).

Triton compiles for a target other than the local GPU (`triton.compile(ASTSource(...), target=GPUTarget(...))`,
bundled ptxas, no GPU needed), so a CPU machine can prove that each kernel builds for Hopper (sm_90) and
Blackwell (sm_100) and list which hardware instructions the build uses. `compile_all(capability)` does it at
DeepSeek-V4 shapes (bf16, hd 512, 64 indexer heads x 128, hc 4) and returns, per kernel, the features found
in the PTX: `wgmma` (Hopper warpgroup MMA), `tcgen05` (Blackwell 5th-gen tensor core / TMEM), `mma.sync`
(warp-level MMA), `atom`/`red` (the one-launch semaphores), `cp.async` / `cp.async.bulk` (async copies, TMA),
`ld.global 2-byte` (scalar 2-byte global loads: an unvectorized gather).

Must run without TRITON_INTERPRET=1 (the interpreter replaces `@triton.jit` functions); tests run it in a
subprocess. Module state: none.
"""

from __future__ import annotations

import inspect
import os
import re

FEATURES = {"wgmma": r"\bwgmma\.", "tcgen05": r"\btcgen05\.", "mma.sync": r"\bmma\.sync\.", "atom": r"\batom\.",
            "red": r"\bred\.", "cp.async": r"\bcp\.async\.(?!bulk)", "cp.async.bulk (TMA)": r"\bcp\.async\.bulk",
            "shfl": r"\bshfl\.", "bar.sync": r"\bbar(rier)?\.sync",
            "ld.global 2-byte": r"\bld\.global[.\w]*\.(?:b16|u16|s16)\b"}


def _specs():
    """(name, jit function, {arg: pointer dtype}, {arg: float}, {arg: constexpr value}); other args are i32."""
    from kernels import attention, indexer, mhc  # triton is an optional dependency: their kernels exist only with it
    bf, f32, i32, i64 = "*bf16", "*fp32", "*i32", "*i64"
    specs = [
        ("attention._sparse_attn_kernel", attention._sparse_attn_kernel,
         dict(Q=bf, KV=bf, SINK=f32, IDX=i64, O=bf, PACC=f32, PML=f32, SEM=i32, POS=i64, FREQ="*fp64"), ["qk_scale"],
         dict(HD=512, BLOCK_H=16, BLOCK_N=32, SPLIT=True, DOT=0, ROPE=True, PER_ROW=False, BR=32)),
        ("indexer._indexer_scores_kernel", indexer._indexer_scores_kernel,
         dict(Q=bf, W=bf, K=bf, OUT=f32), ["wscale"], dict(D=128, BLOCK_H=64, BLOCK_N=64, DOT=0, SCALED=True)),
        ("indexer._indexer_topk_kernel", indexer._indexer_topk_kernel,
         dict(SC=f32, NV=i64, OUT=i64), [], dict(HAS_NV=True, BLOCK=16384, KP=1024, IN_REGISTERS=True)),
        ("indexer._indexer_topk_kernel[positions]", indexer._indexer_topk_kernel,
         dict(SC=f32, NV=i64, OUT=i64), [],
         dict(HAS_NV=True, BLOCK=1024, KP=512, IN_REGISTERS=True, SORTED=True, RATIO=4)),
        ("indexer._indexer_select_kernel", indexer._indexer_select_kernel,
         dict(Q=bf, W=f32, K=bf, SC=f32, NV=i64, OUT=i64, SEM=i32), [],
         dict(D=128, BLOCK_H=64, BLOCK_N=64, DOT=0, HAS_NV=True, BLOCK=16384, KP=512, IN_REGISTERS=True)),
        ("mhc._hc_mix_kernel", mhc._hc_mix_kernel, dict(h_ptr=bf, fn_ptr=f32, mix_ptr=f32, ss_ptr=f32), [],
         dict(N_MIX=24, NP=32, BT=64, BK=64, SPLIT3=True, MMA=1)),
        ("mhc._hc_finish_kernel", mhc._hc_finish_kernel,
         dict(h_ptr=bf, mix_ptr=f32, ss_ptr=f32, base_ptr=f32, scale_ptr=f32, x_ptr=bf, post_ptr=f32,
              comb_ptr=f32), ["hc_eps", "norm_eps", "inv_k"],
         dict(HC=4, NP=32, SP=128, IS_HEAD=False, BT=2, BD=1024)),  # SP: mhc.SPLIT_MAX
        ("mhc._hc_fused_kernel", mhc._hc_fused_kernel,
         dict(h_ptr=bf, fn_ptr=f32, base_ptr=f32, scale_ptr=f32, x_ptr=bf, post_ptr=f32, comb_ptr=f32,
              ws_ptr=f32, sem_ptr=i32, nw_ptr=f32), ["hc_eps", "norm_eps", "inv_k", "rms_eps"],
         dict(HC=4, N_MIX=24, NP=32, SP=128, IS_HEAD=False, BT=16, BK=64, TOK=2, BD=1024, SPLIT3=True, MMA=1,
              NORM=True)),
        ("mhc._hc_post_kernel", mhc._hc_post_kernel, dict(a_ptr=bf, h_ptr=bf, post_ptr=f32, comb_ptr=f32,
                                                         out_ptr=bf), [], dict(HC=4, BT=4, BD=512)),
        ("mhc._hc_post_pre_kernel", mhc._hc_post_pre_kernel,
         dict(a_ptr=bf, h_ptr=bf, post_ptr=f32, comb_ptr=f32, hn_ptr=bf, fn_ptr=f32, base_ptr=f32,
              scale_ptr=f32, x_ptr=bf, post2_ptr=f32, comb2_ptr=f32, ws_ptr=f32, sem_ptr=i32, nw_ptr=f32),
         ["hc_eps", "norm_eps", "inv_k", "rms_eps"],
         dict(HC=4, N_MIX=24, NP=32, SP=64, BT=16, BC=64, TOK=2, BD=1024, NORM=True)),
    ]
    from kernels import compressor, fp32_linear, gemm, moe, norm, quant, rope  # triton is an optional dependency
    from kernels import invariant, router  # triton is an optional dependency
    u8, f8 = "*u8", "*fp8e4nv"
    tile_up = dict(xq_ptr=bf, g_ptr=f32, row_pair_ptr=i32, tile_e_ptr=i32, w1_ptr="*i8", s1_ptr=u8, w3_ptr="*i8",
                   s3_ptr=u8, h_ptr=bf)  # the MoE tile kernels' pointers (every tile shape below)
    tile_down = dict(hq_ptr=bf, row_pair_ptr=i32, tile_e_ptr=i32, w2_ptr="*i8", s2_ptr=u8, y_ptr=bf)
    specs += [
        ("fp32_linear._bf16w_gemv_kernel", fp32_linear._bf16w_gemv_kernel,
         dict(x_ptr=f32, w_ptr=bf, y_ptr=f32, part_ptr=f32, sem_ptr=i32), [],
         dict(BM=8, BN=16, BK=256, DOT=False, EVEN_K=True, ACC2D=False, MMA=1)),
        ("fp32_linear._bf16w_gemv_kernel[m1]", fp32_linear._bf16w_gemv_kernel,
         dict(x_ptr=f32, w_ptr=bf, y_ptr=f32, part_ptr=f32, sem_ptr=i32), [],
         dict(BM=1, BN=16, BK=256, DOT=False, EVEN_K=True, ACC2D=True, MMA=1)),
        ("fp32_linear._bf16w_gemv_kernel[dot]", fp32_linear._bf16w_gemv_kernel,
         dict(x_ptr=f32, w_ptr=bf, y_ptr=f32, part_ptr=f32, sem_ptr=i32), [],
         dict(BM=32, BN=128, BK=64, DOT=True, EVEN_K=True, ACC2D=False, MMA=1)),
        ("gemm._act_quant_kernel", gemm._act_quant_kernel, dict(x_ptr=bf, q_ptr=u8, s_ptr=f32), [],
         dict(BR=16)),
        ("gemm._fp8_gemv_kernel", gemm._fp8_gemv_kernel,
         dict(x_ptr=bf, w_ptr=f8, ws_ptr=u8, y_ptr=bf, part_ptr=f32, sem_ptr=i32), [],
         dict(BM=16, BN=64, MMA=2, QUANT_X=True, DOT=True, UNROLL=1)),
        # the one-row launches (`kernels.gemm.RowsConfig`): ROWS_DEFAULT, the wq_b entry, the grouped wo_a
        ("gemm._fp8_gemv_rows_kernel", gemm._fp8_gemv_rows_kernel, dict(x_ptr=bf, w_ptr=f8, ws_ptr=u8, y_ptr=bf),
         ["limit"], dict(BN=8, BKB=8, QUANT_X=True, MMA=1, EVEN=True, SWIGLU=False, HAS_LIMIT=False)),
        ("gemm._fp8_gemv_rows_kernel[bn16-bkb4]", gemm._fp8_gemv_rows_kernel,
         dict(x_ptr=bf, w_ptr=f8, ws_ptr=u8, y_ptr=bf), ["limit"],
         dict(BN=16, BKB=4, QUANT_X=True, MMA=1, EVEN=False, SWIGLU=False, HAS_LIMIT=False)),
        ("gemm._fp8_gemv_rows_kernel[wo_a]", gemm._fp8_gemv_rows_kernel,
         dict(x_ptr=bf, w_ptr=f8, ws_ptr=u8, y_ptr=bf), ["limit"],
         dict(BN=16, BKB=4, QUANT_X=False, MMA=1, EVEN=True, SWIGLU=False, HAS_LIMIT=False)),
        ("gemm._fp8_gemv_rows_kernel[swiglu]", gemm._fp8_gemv_rows_kernel,
         dict(x_ptr=bf, w_ptr=f8, ws_ptr=u8, y_ptr=bf), ["limit"],
         dict(BN=8, BKB=8, QUANT_X=True, MMA=1, EVEN=True, SWIGLU=True, HAS_LIMIT=True)),
    ]
    # the other `GemvConfig` launches of the same kernel (kernels.gemm.gemv_config / the gemv_sweep variants)
    gemv_ptrs = dict(x_ptr=bf, w_ptr=f8, ws_ptr=u8, y_ptr=bf, part_ptr=f32, sem_ptr=i32)
    specs += [(f"gemm._fp8_gemv_kernel[{tag}]", gemm._fp8_gemv_kernel, gemv_ptrs, [], consts) for tag, consts in (
        ("dot unroll4 BN32 M32", dict(BM=32, BN=32, MMA=2, QUANT_X=True, DOT=True, UNROLL=4)),
        ("dot bf16 wo_a unroll2", dict(BM=16, BN=64, MMA=1, QUANT_X=False, DOT=True, UNROLL=2)),
        ("dot BN128 unroll2", dict(BM=16, BN=128, MMA=2, QUANT_X=True, DOT=True, UNROLL=2)),
        ("cuda-core M1 BN128 unroll4", dict(BM=1, BN=128, MMA=2, QUANT_X=True, DOT=False, UNROLL=4)),
        ("cuda-core M8 BN64 unroll2", dict(BM=8, BN=64, MMA=2, QUANT_X=True, DOT=False, UNROLL=2)),
        ("cuda-core wo_a M16 BN32", dict(BM=16, BN=32, MMA=1, QUANT_X=False, DOT=False, UNROLL=1)),
    )]
    specs += [
        ("gemm._fp8_dequant_kernel", gemm._fp8_dequant_kernel, dict(w_ptr=f8, ws_ptr=u8, out_ptr=bf), [],
         dict(BN=64)),
        ("gemm._fp8_gemm_kernel", gemm._fp8_gemm_kernel,
         dict(q_ptr=f8, sx_ptr=f32, w_ptr=f8, ws_ptr=u8, y_ptr=bf), [],
         dict(BM=gemm.PREFILL_TILE["BM"], BN=gemm.PREFILL_TILE["BN"], GROUP_M=gemm.PREFILL_TILE["GROUP_M"], MMA=2)),
        # the decode tiles of 9..64 rows (`kernels.gemm.DECODE_TILE`)
        ("gemm._fp8_gemm_kernel[decode]", gemm._fp8_gemm_kernel,
         dict(q_ptr=f8, sx_ptr=f32, w_ptr=f8, ws_ptr=u8, y_ptr=bf), [],
         dict(BM=gemm.DECODE_TILE["BM"], BN=gemm.DECODE_TILE["BN"], GROUP_M=gemm.DECODE_TILE["GROUP_M"], MMA=2)),
        ("compressor._compress_pool_kernel", compressor._compress_pool_kernel,
         dict(a_ptr=f32, z_ptr=f32, ape_ptr=f32, pos_ptr=i64, kv_ptr=f32, sc_ptr=f32, out_ptr=f32), [],
         dict(OVERLAP=True, BN=8, BD=512)),
        ("compressor._compress_commit_kernel", compressor._compress_commit_kernel,
         dict(new_ptr=bf, pos_ptr=i64, kv_ptr=f32, sc_ptr=f32, out_ptr=bf), [], dict(OVERLAP=True, BR=4, BD=1024)),
        ("norm._rms_norm_kernel", norm._rms_norm_kernel, dict(x_ptr=bf, w_ptr=f32, y_ptr=bf), ["eps"],
         dict(BD=4096)),
        ("rope._rope_tail_kernel", rope._rope_tail_kernel, dict(x_ptr=bf, pos_ptr=i64, f_ptr="*fp64"), ["SIGN"],
         dict(BR=32)),
        ("router._route_kernel", router._route_kernel, dict(l_ptr=f32, b_ptr=f32, h_ptr=f32, w_ptr=f32, ids_ptr=i64),
         ["route_scale"], dict(K=6, KP=8, BE=256, SCORE=0, HASH=False)),
        ("router._route_kernel[hash]", router._route_kernel,
         dict(l_ptr=f32, b_ptr=i64, h_ptr=i64, w_ptr=f32, ids_ptr=i64), ["route_scale"],
         dict(K=6, KP=8, BE=256, SCORE=0, HASH=True)),
        ("quant._quant_sim_kernel", quant._quant_sim_kernel, dict(x_ptr=bf, y_ptr=bf), [],
         dict(FP4=True, B=32, BR=16)),
        ("quant._quant_sim_kernel[halves]", quant._quant_sim_kernel, dict(x_ptr=bf, y_ptr=bf), [],
         dict(FP4=False, B=128, BR=16, HALVES=True)),
        ("moe._moe_up_gemv_kernel", moe._moe_up_gemv_kernel,
         dict(xq_ptr=bf, sx_ptr=f32, g_ptr=f32, order_ptr=i32, ids_ptr=i64, w1_ptr="*i8", s1_ptr=u8, w3_ptr="*i8", s3_ptr=u8,
              h_ptr=bf), ["limit"], dict(HAS_LIMIT=True, BN=16, BKH=256, SORTED=True)),
        ("moe._moe_down_gemv_kernel", moe._moe_down_gemv_kernel,
         dict(hq_ptr=bf, sh_ptr=f32, order_ptr=i32, ids_ptr=i64, w2_ptr="*i8", s2_ptr=u8, y_ptr=bf), [],
         dict(BN=16, BKH=256, SORTED=True)),
        ("moe._moe_up_tile_kernel", moe._moe_up_tile_kernel,
         tile_up, ["limit"], dict(HAS_LIMIT=True, BM=32, BN=128, BKH=64, MMA=1)),
        ("moe._moe_up_tile_kernel[mma2]", moe._moe_up_tile_kernel,
         tile_up, ["limit"], dict(HAS_LIMIT=True, BM=32, BN=128, BKH=64, MMA=2)),
        ("moe._moe_down_tile_kernel", moe._moe_down_tile_kernel,
         tile_down, [], dict(BM=32, BN=128, BKH=64, MMA=1)),
        # the packed PTX decode (mma="bf16x2", `moe._e2m1_bf16x2`): inline PTX assembles for sm_90 and sm_100
        ("moe._moe_down_tile_kernel[mma2]", moe._moe_down_tile_kernel,
         tile_down, [], dict(BM=32, BN=128, BKH=64, MMA=2)),
        # the large tiles of moe.TILES_LARGE (64 x 128 with 32-byte K steps, 128 x 128 with 64-byte steps and the
        # packed decode)
        ("moe._moe_up_tile_kernel[bm64]", moe._moe_up_tile_kernel,
         tile_up, ["limit"], dict(HAS_LIMIT=True, BM=64, BN=128, BKH=32, MMA=1)),
        ("moe._moe_up_tile_kernel[bm128]", moe._moe_up_tile_kernel,
         tile_up, ["limit"], dict(HAS_LIMIT=True, BM=128, BN=128, BKH=64, MMA=2)),
        ("moe._moe_down_tile_kernel[bm128]", moe._moe_down_tile_kernel,
         tile_down, [], dict(BM=128, BN=128, BKH=64, MMA=2)),
        ("moe._moe_up_tile_kernel[bm32 bn64]", moe._moe_up_tile_kernel,
         tile_up, ["limit"], dict(HAS_LIMIT=True, BM=32, BN=64, BKH=64, MMA=2)),
        ("moe._moe_down_tile_kernel[bm32 bn64]", moe._moe_down_tile_kernel,
         tile_down, [], dict(BM=32, BN=64, BKH=64, MMA=2)),
        ("norm._head_rms_kernel", norm._head_rms_kernel, dict(x_ptr=bf, y_ptr=bf), ["eps"],
         dict(BD=512, BF16=True, ROPE=False, PER_ROW=False, BR=16)),
        ("invariant._hadamard_kernel", invariant._hadamard_kernel, dict(x_ptr=f32, y_ptr=f32), [],
         dict(N=128, BR=16, MMA=1)),
        # issue 27: the decode step's fused small kernels
        ("norm._head_rms_kernel[fp32]", norm._head_rms_kernel, dict(x_ptr=f32, y_ptr=f32), ["eps"],
         dict(BD=512, BF16=False, ROPE=False, PER_ROW=False, BR=16)),
        ("norm._head_rms_kernel[rope]", norm._head_rms_kernel,
         dict(x_ptr=bf, y_ptr=bf, pos_ptr=i64, f_ptr="*fp64"), ["eps"],
         dict(BD=512, BF16=True, ROPE=True, PER_ROW=True, BR=32)),
        ("rope._kv_finish_kernel", rope._kv_finish_kernel,
         dict(x_ptr=f32, w_ptr=f32, pos_ptr=i64, f_ptr="*fp64", y_ptr=bf), ["eps"],
         dict(BD=512, BRD=32, NBP=8, BB=64, ROUND_IN=True, OUT_BF16=True, PER_ROW=True, QUANT=True, RING=False)),
        ("rope._kv_finish_kernel[ring]", rope._kv_finish_kernel,
         dict(x_ptr=bf, w_ptr=f32, pos_ptr=i64, f_ptr="*fp64", y_ptr=bf, ring_ptr=bf), ["eps"],
         dict(BD=512, BRD=32, NBP=8, BB=64, ROUND_IN=False, OUT_BF16=True, PER_ROW=True, QUANT=True, RING=True)),
        ("rope._qkv_finish_kernel", rope._qkv_finish_kernel,
         dict(q_ptr=bf, qy_ptr=bf, qpos_ptr=i64, qf_ptr="*fp64", x_ptr=bf, w_ptr=f32, pos_ptr=i64, f_ptr="*fp64",
              y_ptr=bf, ring_ptr=bf, ip_ptr=i64, icomp_ptr=i64, idx_ptr=i64), ["q_eps", "eps"],
         dict(QBD=512, QBF16=True, QPER_ROW=True, QBR=32, BD=512, BRD=32, NBP=8, BB=64, ROUND_IN=False,
              OUT_BF16=True, PER_ROW=True, QUANT=True, RING=True, INDEX=True, IINPLACE=True, IMODE=0,
              IBLOCK=256)),
        ("moe._swiglu_joint_kernel", moe._swiglu_joint_kernel, dict(uv_ptr=bf, h_ptr=bf), ["limit"],
         dict(HAS_LIMIT=True, BI=1024)),
        ("moe._sum_slots_kernel", moe._sum_slots_kernel, dict(y_ptr=bf, s_ptr=bf, out_ptr=f32), [],
         dict(K=6, HAS_SHARED=False, BD=1024)),
        ("moe._moe_up_gemv_kernel[unsorted]", moe._moe_up_gemv_kernel,
         dict(xq_ptr=bf, sx_ptr=f32, g_ptr=f32, order_ptr=i32, ids_ptr=i64, w1_ptr="*i8", s1_ptr=u8, w3_ptr="*i8", s3_ptr=u8,
              h_ptr=bf), ["limit"], dict(HAS_LIMIT=True, BN=16, BKH=256, SORTED=False)),
        # T = 1 (decode batch 1): x and h act-quantized inside the gemv kernels (moe.GEMV_QUANT_MAX_T), at the
        # launched shapes (moe.GEMV_SHAPES): Flash's element-wise nibble decode (DEC 1), Pro's packed one (DEC 4)
        ("moe._moe_up_gemv_kernel[quant]", moe._moe_up_gemv_kernel,
         dict(xq_ptr=bf, sx_ptr=f32, g_ptr=f32, order_ptr=i32, ids_ptr=i64, w1_ptr="*i8", s1_ptr=u8, w3_ptr="*i8", s3_ptr=u8,
              h_ptr=bf), ["limit"], dict(HAS_LIMIT=True, BN=32, BKH=256, SORTED=False, QUANT=1, DEC=1, STAGES=2)),
        ("moe._moe_up_gemv_kernel[quant-packed]", moe._moe_up_gemv_kernel,
         dict(xq_ptr=bf, sx_ptr=f32, g_ptr=f32, order_ptr=i32, ids_ptr=i64, w1_ptr="*i8", s1_ptr=u8, w3_ptr="*i8", s3_ptr=u8,
              h_ptr=bf), ["limit"], dict(HAS_LIMIT=True, BN=16, BKH=256, SORTED=False, QUANT=1, DEC=4, STAGES=2)),
        ("moe._moe_down_gemv_kernel[quant]", moe._moe_down_gemv_kernel,
         dict(hq_ptr=bf, sh_ptr=f32, order_ptr=i32, ids_ptr=i64, w2_ptr="*i8", s2_ptr=u8, y_ptr=bf), [],
         dict(BN=32, BKH=128, SORTED=False, QUANT=1, DEC=1, STAGES=2)),
        ("moe._moe_down_gemv_kernel[quant-packed]", moe._moe_down_gemv_kernel,
         dict(hq_ptr=bf, sh_ptr=f32, order_ptr=i32, ids_ptr=i64, w2_ptr="*i8", s2_ptr=u8, y_ptr=bf), [],
         dict(BN=32, BKH=128, SORTED=False, QUANT=1, DEC=4, STAGES=2)),
        # T > 1: x and h quantized once by act_quant (e4m3 codes + scales), the packed nibble decode (bf16 lanes: an
        # explicit mma "bf16x2"; fp16 lanes: the default), at the launched shapes
        ("moe._moe_up_gemv_kernel[codes]", moe._moe_up_gemv_kernel,
         dict(xq_ptr="*fp8e4nv", sx_ptr=f32, g_ptr=f32, order_ptr=i32, ids_ptr=i64, w1_ptr="*i8", s1_ptr=u8,
              w3_ptr="*i8", s3_ptr=u8, h_ptr=bf), ["limit"],
         dict(HAS_LIMIT=True, BN=32, BKH=128, SORTED=False, QUANT=2, DEC=2, STAGES=2)),
        ("moe._moe_up_gemv_kernel[codes-f16]", moe._moe_up_gemv_kernel,
         dict(xq_ptr="*fp8e4nv", sx_ptr=f32, g_ptr=f32, order_ptr=i32, ids_ptr=i64, w1_ptr="*i8", s1_ptr=u8,
              w3_ptr="*i8", s3_ptr=u8, h_ptr=bf), ["limit"],
         dict(HAS_LIMIT=True, BN=32, BKH=128, SORTED=False, QUANT=2, DEC=4, STAGES=2)),
        ("moe._moe_down_gemv_kernel[codes]", moe._moe_down_gemv_kernel,
         dict(hq_ptr="*fp8e4nv", sh_ptr=f32, order_ptr=i32, ids_ptr=i64, w2_ptr="*i8", s2_ptr=u8, y_ptr=bf), [],
         dict(BN=32, BKH=128, SORTED=False, QUANT=2, DEC=4)),
        ("attention._step_index_kernel", attention._step_index_kernel, dict(P="*i64", COMP="*i64", IDX="*i64"),
         [], dict(INPLACE=True, MODE=1, BLOCK=256)),
        ("indexer._rotate_fp4_kernel", indexer._rotate_fp4_kernel, dict(x_ptr=bf, y_ptr=bf, pos_ptr=i64,
                                                                         f_ptr="*fp64"), ["scale"],
         dict(N=128, BR=16, MMA=1, ROPE=False, PER_ROW=False)),
        ("indexer._rotate_fp4_kernel[rope]", indexer._rotate_fp4_kernel, dict(x_ptr=bf, y_ptr=bf, pos_ptr=i64,
                                                                               f_ptr="*fp64"), ["scale"],
         dict(N=128, BR=16, MMA=1, ROPE=True, PER_ROW=True)),
    ]
    for extra in getattr(attention, "TARGET_SPECS", ()):  # kernels added later register their own spec
        specs.append(extra)
    return specs


def constexprs(fn, consts: dict) -> dict:
    """The spec's constexpr values plus the defaults of the constexpr parameters it leaves out: the values a real
    launch gets (a left-out constexpr would otherwise compile as an i32 argument, both branches of its `if`s)."""
    out = {p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty}
    out.update(consts)
    return out


def signature(fn, ptrs: dict, floats: list, consts: dict) -> dict:
    """Triton's signature of a spec: constexpr / the pointer dtype / fp32 for `floats` / i32 for the rest."""
    return {arg: "constexpr" if arg in consts else ptrs.get(arg, "fp32" if arg in floats else "i32")
            for arg in fn.arg_names}


DIV16_INTS = {"moe._moe_up_tile_kernel": ("D", "I"), "moe._moe_down_tile_kernel": ("D", "I")}
"""Integer arguments a real launch specializes as multiples of 16, per kernel (base name; the spec's "[variant]"
suffix dropped): the MoE widths D and I (multiples of 128). With the pointers' 16-byte alignment (every pointer
argument, as torch's allocations give) this is the specialization `triton.jit` derives at launch, under which
the tile kernels' contiguous row loads become `cp.async` copies, software-pipelined; without it the build
checked here would be one no real launch takes."""


def attrs(name: str, fn, sig: dict) -> dict:
    """`ASTSource` attrs of a spec: tt.divisibility 16 for every pointer argument and for the ints of
    DIV16_INTS[name] (module docstring of `DIV16_INTS`)."""
    ints = DIV16_INTS.get(name.split("[")[0], ())
    names = list(fn.arg_names)
    return {(names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
            if t.startswith("*") or a in ints}


def compile_all(capability: int, names: list[str] | None = None) -> dict[str, dict]:
    """Compile every kernel (or those in `names`) for `GPUTarget("cuda", capability, 32)`, pointers 16-byte
    aligned and the ints of `DIV16_INTS` multiples of 16, as a real launch specializes them.

    Returns {kernel name: {"ok": bool, "features": [found FEATURES], "error": str}}; a kernel that fails to
    compile is reported with its error, never skipped. Raises RuntimeError under TRITON_INTERPRET=1.
    """
    import triton  # triton is an optional dependency: only this check needs its compiler
    from triton.backends.compiler import GPUTarget  # triton is an optional dependency
    from triton.compiler import ASTSource  # triton is an optional dependency

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("kernels.targets.compile_all: unset TRITON_INTERPRET (the interpreter replaces "
                           "@triton.jit functions and cannot compile)")
    target = GPUTarget("cuda", capability, 32)
    result = {}
    for name, fn, ptrs, floats, consts in _specs():
        if names is not None and name not in names:
            continue
        consts = constexprs(fn, consts)
        sig = signature(fn, ptrs, floats, consts)
        try:
            src = ASTSource(fn=fn, signature=sig, constexprs=dict(consts), attrs=attrs(name, fn, sig))
            cc = triton.compile(src, target=target)
            ptx = cc.asm["ptx"]
            feats = [f for f, pat in FEATURES.items() if re.search(pat, ptx)]
            result[name] = {"ok": bool(cc.asm.get("cubin")), "features": feats, "error": ""}
        except Exception as exc:  # reported per kernel by the caller; nothing is hidden
            result[name] = {"ok": False, "features": [], "error": f"{type(exc).__name__}: {exc}"[:2000]}
    return result


if __name__ == "__main__":
    import json
    import sys
    caps = [int(c) for c in (sys.argv[1:] or ["90", "100"])]
    report = {cap: compile_all(cap) for cap in caps}
    print(json.dumps(report, indent=1))
    failed = [f"sm_{cap}: {name}" for cap, r in report.items() for name, v in r.items() if not v["ok"]]
    if failed:
        print("kernels that do not build: " + ", ".join(failed), file=sys.stderr)
        sys.exit(1)
