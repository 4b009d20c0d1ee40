"""The triton backend in bf16 (the official numerics) with weights="quantized" against the reference, on a tiny
model whose widths are multiples of 128, so every fast path of the triton backend (table in `dsv4/backend.py`)
and of the decode step `dsv4/graph.py` captures runs its
kernel (issue 22 item 4; Triton interpreter on CPU):

  * FP8 linears: the decode GEMV (M <= GEMV_MAX_M) and the prefill path (M > GEMV_MAX_M: act_quant + dequant +
    GEMM); the fp32 linears held bf16 (head, compressors, router: `kernels.fp32_linear`, GEMV and torch.mm);
    the grouped `wo_a` (FP8 grouped GEMV and dequant + bmm); the routed experts (`kernels.moe`, gemv and tiles);
    every RMSNorm (`kernels.norm`);
  * the decode step (`Transformer.decode_step`, the step the CUDA graph records, run eagerly) with
    the kernels only it uses: RoPE tail (`kernels.rope`), the e4m3 / e2m1 simulations (`kernels.quant`), the
    compressor pooling and commit (`kernels.compressor`), across the tiny config's ratio-4 and ratio-128
    compression boundaries (positions 127 and 128: both compressors commit at 127, the entries are read at
    128) and the window ring wrap (window 8: every decode step here overwrites the oldest slot).

Why per call: in bf16 the model's own quantization simulations turn a one-ulp difference of any kernel into
flipped FP8 / FP4 codes downstream, so whole-model logits of two correct implementations differ by the order of
the bf16-vs-fp32 gap (tests/gpu/test_model_backends.py), far above what a subtle kernel bug adds. Every fast-path
call is therefore checked against its reference ON THE SAME INPUT, inside the model run (the inputs are the
model's real activations, not random draws), with a tolerance from the dtype:

  bf16 linears / grouped wo_a (one fp32 sum of exact products, rounded once to bf16 in both; only the summation
      order differs): |d| <= 2^-7 |ref| + 2^-7 * 2^-8 * rowmax|ref| (one bf16 ulp, plus one ulp of a 256x smaller
      element where cancellation makes an element small), and >= 90 % of the elements bitwise equal;
  fp32 linears: the fp32 summation bound 2 K (2^-24 |x| @ |w|^T + 2^-149) (tests/unit/test_fp32_linear.py);
  routed experts (h re-quantized to e4m3 before w2: a one-ulp difference of h can move one e4m3 code, 2^-3 of
      that channel): |d| <= 2^-3 rowmax|ref|, median relative error <= one bf16 ulp;
  RMSNorm, RoPE tail (same fp32 operations, rounded once): one bf16 ulp of the row's magnitude, >= 90 % bitwise;
  quantization simulations, compressor commit and state writes: bitwise (the kernels are exact);
  compressor pooling (fp32, one division instead of k): rtol 1e-6 of the row's magnitude.

The model-level logits are checked too (wiring: a path taken but not wrapped): the triton backend must stay within
2x the bf16 reference's own distance to the fp32 reference (mean over positions of max |d logit|, the GPU test's
criterion; measured 0.86x for the prefill + first step, 0.27x at 126-128 before the late run was shortened to 127-128).

Shapes are the smallest the kernels accept (dim 128, 2 layers with ratios 4 / 128). The M > 64 and P > 192 pair
branches are reached by a 10-token prefill with the three branch constants lowered to 8 for that call
(`kernels.gemm.GEMV_MAX_M`, `kernels.fp32_linear.GEMV_MAX_M`, `kernels.moe.GEMV_MAX_PAIRS`, read at call time):
the constants only pick the branch, so the same code runs as for a 70-token prefill at a fraction of the
interpreter's time. Positions 127-128 are reached by a reference-backend prefill of the same weights into the
twin's state (the prefill is backend-independent eager code; its triton form runs in the first test).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import weakref
from collections import Counter

import pytest
import torch

from dsv4 import quant
from dsv4.model import Attention, DecodeState, Gate, Linear, MoE, RMSNorm, Transformer, fp32_linear_ref
from dsv4.testing import assert_mostly_bitwise, fill_random_quantized_
from dsv4.tiny import tiny_args
from kernels import gemm as kgemm
from kernels import moe as kmoe
from kernels.gemm import grouped_linear_ref, linear_ref
from kernels.moe import moe_routed_ref
from kernels.norm import rms_norm_ref

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [pytest.mark.hardstop,  # every bf16 fast path of the triton backend equals its reference
              pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 (CPU) - CI sets it for the unit run")]

ULP = 2.0 ** -7
ARGS = dict(vocab_size=256, dim=128, moe_inter_dim=128, q_lora_rank=128, head_dim=128, rope_head_dim=64,
            o_lora_rank=128, index_head_dim=128, n_layers=2, compress_ratios=(4, 128, 0))
BATCH, PREFILL, LATE = 2, 10, 127      # the triton prefill; the late decode starts at 127 (the boundary), then 128


def _spread_scales_(model, seed: int) -> None:
    """Move every FP8 / FP4 block scale by a random power of two in 2^-2..2^1 (fill_random_quantized_ gives one
    scale per linear), so a kernel that applies the wrong block's scale, or none, changes the result."""
    g = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        if getattr(mod, "fmt", None) in ("fp8", "fp4"):
            s = mod._buffers["scale"].view(torch.uint8)
            s.copy_((s.to(torch.int16) + torch.randint(-2, 2, s.shape, generator=g, dtype=torch.int16)).to(torch.uint8))


class Checked:
    """Wraps the triton model's fast-path entries: each call runs the kernel AND the reference on the same
    input, asserts the module docstring's criterion and counts the path taken (`paths`)."""

    def __init__(self, model):
        self.paths: Counter = Counter()
        b = model.backend
        self.k = {"linear": b.linear, "fp32_linear": b.fp32_linear, "rms_norm": b.rms_norm,
                  "moe_routed": b.moe_routed, "grouped_linear": b.grouped_linear, "rope_tail": b.rope_tail,
                  "act_quant_sim": b.act_quant_sim, "fp4_act_quant_sim": b.fp4_act_quant_sim,
                  "compress_pool": b.compress_pool, "compress_commit": b.compress_commit,
                  "head_rms": b.head_rms, "step_index": b.step_index, "rotate_fp4": b.rotate_fp4,
                  "moe_combine": b.moe_combine, "swiglu_joint": b.swiglu_joint, "kv_finish": b.kv_finish,
                  "q_finish": b.q_finish, "linear_swiglu": b.linear_swiglu,
                  "moe_routed_combine": b.moe_routed_combine, "qkv_finish": b.qkv_finish,
                  "sparse_attn_rope": b.sparse_attn_rope, "rope_rotate_fp4": b.rope_rotate_fp4,
                  "indexer_scores_scaled": b.indexer_scores_scaled, "indexer_topk": b.indexer_topk}
        assert b.name == "triton" and self.k["linear"] is kgemm.linear and self.k["moe_routed"] is kmoe.moe_routed
        model.backend = dataclasses.replace(b, **{n: getattr(self, n) for n in self.k})
        for m in model.modules():
            if isinstance(m, Attention):  # the joint wq_a | wkv (`join_wq_a_wkv`, issue 27): not a submodule
                assert m.wqkv_a is not None, "the attention's joint wq_a | wkv must apply (issue 27)"
                m.wqkv_a.kernel = self.linear
            if isinstance(m, Linear):
                m.kernel = self.linear
            elif isinstance(m, Gate):
                m.kernel = self.fp32_linear
            elif isinstance(m, RMSNorm):
                m.kernel = self.rms_norm
            elif isinstance(m, MoE):
                assert getattr(m, "stacked", None) is not None, "the grouped FP4 experts must apply"
                m.routed = self.moe_routed
                m.combine = self.moe_combine
                assert m.routed_combine is b.moe_routed_combine is not None, "the routed + shared one-call path"
                m.routed_combine = self.moe_routed_combine
                e = m.shared_experts
                assert e.w13 is not None, "the shared expert's joint w1 | w3 must apply (issue 27)"
                e.w13.kernel, e.swiglu_joint = self.linear, self.swiglu_joint
                assert e.linear_swiglu is b.linear_swiglu is not None, "the shared expert's one-launch SwiGLU"
                e.linear_swiglu = self.linear_swiglu


    # ---------------------------------------------------------------------------------------- criteria
    @staticmethod
    def _bf16_once(got, want, what):
        assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape, what
        g, w = got.float().flatten(0, -2), want.float().flatten(0, -2)
        assert bool(torch.isfinite(w).all()), f"{what}: the reference is not finite (the input lost its meaning)"
        bound = ULP * w.abs() + ULP * 2.0 ** -8 * w.abs().amax(-1, keepdim=True)
        err = (g - w).abs()
        assert bool((err <= bound).all()), f"{what}: max |d|/bound {float((err / bound).max()):.3g} > 1"
        assert_mostly_bitwise(got, want, what)

    @staticmethod
    def _fp32_sum(got, want, x, w, what):
        from tests.unit.test_fp32_linear import within_fp32_sum_bound
        within_fp32_sum_bound(got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1]),
                              x.reshape(-1, x.shape[-1]).float(), w.float(), what)

    # ---------------------------------------------------------------------------------------- entries
    def linear(self, x, weight, scale=None, act_block=0, fp32=False):
        got, want = self.k["linear"](x, weight, scale, act_block, fp32), linear_ref(x, weight, scale, act_block, fp32)
        from kernels import fp32_linear as kf
        from kernels import gemm as kg
        M = x.numel() // x.shape[-1]
        if fp32:
            path = "fp32_gemv" if M <= kf.GEMV_MAX_M else "fp32_mm"
            self._fp32_sum(got, want, x, weight, f"{path} {tuple(weight.shape)}")
        else:
            kind = "fp8" if weight.dtype == torch.float8_e4m3fn and act_block and x.shape[-1] % 128 == 0 else "bf16w"
            path = f"{kind}_gemv" if kind == "fp8" and M <= kg.GEMV_MAX_M else f"{kind}_mm"
            path += "_row" if path == "fp8_gemv" and M == 1 else ""  # the one-row kernel (kernels.gemm.RowsConfig)
            self._bf16_once(got, want, f"{path} {tuple(weight.shape)} M={M}")
        self.paths[path] += 1
        return got

    def fp32_linear(self, x, weight):
        got, want = self.k["fp32_linear"](x, weight), fp32_linear_ref(x, weight)
        self._fp32_sum(got, want, x, weight, "router gate")
        self.paths["router"] += 1
        return got

    def rms_norm(self, x, weight, eps):
        got, want = self.k["rms_norm"](x, weight, eps), rms_norm_ref(x, weight, eps)
        if x.dtype == torch.bfloat16:
            self._bf16_once(got, want, f"rms_norm {tuple(x.shape)}")
        else:
            err, mag = (got - want).abs(), want.abs().amax(-1, keepdim=True)
            assert bool((err <= 2.0 ** -21 * mag).all()), f"rms_norm fp32 {tuple(x.shape)}"
        self.paths["rms_norm"] += 1
        return got

    def moe_routed(self, x, weights, ids, experts, limit, act_blocks):
        from kernels.moe import StackedExperts, moe_config
        n_experts = experts.w1.shape[0] if isinstance(experts, StackedExperts) else len(experts)
        got = self.k["moe_routed"](x, weights, ids, experts, limit, act_blocks)
        want = moe_routed_ref(x, weights, ids, experts, limit, act_blocks)
        path = "moe_" + moe_config(ids.numel(), n_experts).path
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape, path
        err, mag = (got - want).abs(), want.abs().amax(-1, keepdim=True)
        assert bool((err <= 2.0 ** -3 * mag).all()), f"{path}: max |d|/rowmax {float((err / mag).max()):.3g}"
        rel = float((err / want.abs().clamp_min(1e-6)).median())
        assert rel <= ULP, f"{path}: median relative error {rel:.2e} > one bf16 ulp"
        self.paths[path] += 1
        return got

    def grouped_linear(self, o, weight, scale=None):
        from kernels.gemm import GEMV_MAX_M
        got, want = self.k["grouped_linear"](o, weight, scale), grouped_linear_ref(o, weight, scale)
        path = "wo_a_gemv" if o.shape[0] * o.shape[1] <= GEMV_MAX_M else "wo_a_bmm"
        path += "_row" if o.shape[0] * o.shape[1] == 1 else ""  # the one-row kernel
        self._bf16_once(got, want, f"{path} {tuple(o.shape)}")
        self.paths[path] += 1
        return got

    def rope_tail(self, x, pos, inv_freq, rd, inverse=False):
        from kernels.rope import rope_tail_ref
        want = rope_tail_ref(x, pos, inv_freq, rd, inverse)
        got = self.k["rope_tail"](x, pos, inv_freq, rd, inverse)
        assert x.dtype == torch.bfloat16, "the bf16 model's RoPE tail"
        self._bf16_once(got, want, f"rope_tail {tuple(x.shape)} inverse={inverse}")
        self.paths["rope_tail"] += 1
        return got

    def _sim(self, name, ref, x, block):
        got, want = self.k[name](x, block), ref(x, block)
        assert got.dtype == want.dtype and torch.equal(torch.isnan(got), torch.isnan(want)), name
        same = (got == want) | torch.isnan(want)
        assert bool(same.all()), f"{name} {tuple(x.shape)} block {block}: {int((~same).sum())} elements differ"
        self.paths[name] += 1
        return got

    def act_quant_sim(self, x, block):
        return self._sim("act_quant_sim", quant.act_quant_sim, x, block)

    def fp4_act_quant_sim(self, x, block):
        return self._sim("fp4_act_quant_sim", quant.fp4_act_quant_sim, x, block)

    def kv_finish(self, x, weight, eps, pos, inv_freq, rd, nope_block=0, window=1, dtype=None, ring=None):
        """Bitwise the chain of the triton entries it fuses (cast, `rms_norm`, `rope_tail_`, `act_quant_sim` on the
        nope channels: the same fp32 operations, the norm's sum of squares in the same order) and, against the
        torch chain (`kv_finish_ref`), mostly bitwise with every element within one e4m3 step (2^-3 relative:
        a norm output one bf16 ulp apart can round to the neighbouring e4m3 code) or one bf16 ulp (RoPE)."""
        from kernels import norm as kn
        from kernels import quant as kq
        from kernels import rope as kr
        args = (x, weight, eps, pos, inv_freq, rd, nope_block, window, dtype)
        before = None if ring is None else ring.clone()
        got, want = self.k["kv_finish"](*args, ring=ring), kr.kv_finish_ref(*args)
        if ring is not None:  # the decode step's ring write: each row's slot pos % W holds the row, nothing else moved
            expect = before.clone()
            slot = (pos.reshape(-1) % ring.shape[1]).expand(ring.shape[0])
            expect[torch.arange(ring.shape[0], device=ring.device), slot] = got[:, 0]
            assert torch.equal(ring, expect), "kv_finish ring write"
        dt = dtype or x.dtype
        chain = kn.rms_norm(x.to(dt).contiguous(), weight, eps)
        chain = kr.rope_tail_(chain, pos if window == 1 else (pos // window) * window, inv_freq, rd)
        if nope_block:
            chain[..., :-rd] = kq.act_quant_sim(chain[..., :-rd].contiguous(), nope_block)
        assert got.dtype == dt and torch.equal(got, chain), f"kv_finish {tuple(x.shape)} vs the entries' chain"
        w = want.float()
        assert bool(((got.float() - w).abs() <= 2.0 ** -3 * w.abs() + 1e-30).all()), f"kv_finish {tuple(x.shape)}"
        assert_mostly_bitwise(got, want, f"kv_finish {tuple(x.shape)}")
        self.paths["kv_finish"] += 1
        return got

    def q_finish(self, q, eps, pos, inv_freq, rd):
        """Bitwise the two triton entries it fuses (`head_rms`, then `rope_tail_`), and `head_rms`'s criterion
        against the torch chain (this class's `head_rms`, which also counts that path)."""
        from kernels.rope import rope_tail_
        got = self.k["q_finish"](q, eps, pos, inv_freq, rd)
        chain = rope_tail_(self.head_rms(q, eps), pos, inv_freq, rd)
        assert torch.equal(got, chain), f"q_finish {tuple(q.shape)} vs head_rms + rope_tail_"
        self.paths["q_finish"] += 1
        return got

    def qkv_finish(self, q, q_eps, pos, inv_freq, rd, kv, weight, eps, nope_block=0, ring=None, index=None):
        """q and KV finish in one launch: bitwise the triton backend's `q_finish` and `kv_finish` (each checked
        here against its chain and reference; `kv_finish` also checks the ring write, repeated with the same
        values) and, with `index`, its `step_index` (checked against `step_index_ref`)."""
        before = None if ring is None else ring.clone()
        gq, gkv, gidx = self.k["qkv_finish"](q, q_eps, pos, inv_freq, rd, kv, weight, eps, nope_block, ring=ring,
                                             index=index)
        if index is not None and len(index) == 4:  # CSA: the window slots; the entry columns are the top-k's
            widx = self.step_index(pos, index[0], None, 0, 0)
            assert torch.equal(gidx[..., :index[0]], widx), f"qkv_finish index {index} window slots vs step_index"
            self.paths["qkv_finish_index_window"] += 1
        elif index is not None:
            widx = self.step_index(pos, index[0], None, index[1], index[2])
            assert torch.equal(gidx, widx), f"qkv_finish index {index} vs step_index"
            self.paths["qkv_finish_index"] += 1
        else:
            assert gidx is None
        after = None if ring is None else ring.clone()
        if ring is not None:
            ring.copy_(before)
        wq = self.q_finish(q, q_eps, pos, inv_freq, rd)
        wkv = self.kv_finish(kv, weight, eps, pos, inv_freq, rd, nope_block, ring=ring)
        assert torch.equal(gq, wq) and torch.equal(gkv, wkv), f"qkv_finish {tuple(q.shape)} vs q_finish + kv_finish"
        assert ring is None or torch.equal(ring, after), "qkv_finish ring write vs kv_finish's"
        self.paths["qkv_finish"] += 1
        return gq, gkv, gidx

    def sparse_attn_rope(self, q, kv, attn_sink, idx, scale, pos, inv_freq, rd):
        """The attention with its output de-rotated in one launch: bitwise the triton backend's `sparse_attn`
        followed by its `rope_tail(inverse=True)` (checked against its reference here)."""
        from kernels import attention as ka
        got = self.k["sparse_attn_rope"](q, kv, attn_sink, idx, scale, pos, inv_freq, rd)
        o = ka.sparse_attn(q, kv, attn_sink, idx, scale)
        two = self.rope_tail(o, pos, inv_freq, rd, True)
        assert got.dtype == two.dtype and torch.equal(got, two), f"sparse_attn_rope {tuple(q.shape)} vs the two"
        self.paths["sparse_attn_rope"] += 1
        return got

    def rope_rotate_fp4(self, x, pos, inv_freq, rd):
        """The indexer query's RoPE + rotation + FP4 rounding in one launch: bitwise the triton backend's
        `rope_tail` then its `rotate_fp4` (each checked against its reference here)."""
        got = self.k["rope_rotate_fp4"](x, pos, inv_freq, rd)
        two = self.rotate_fp4(self.rope_tail(x.clone(), pos, inv_freq, rd))
        assert torch.equal(got, two), f"rope_rotate_fp4 {tuple(x.shape)} vs rope_tail + rotate_fp4"
        self.paths["rope_rotate_fp4"] += 1
        return got

    def indexer_topk(self, scores, k, n_valid=None, *, check=False, ratio=0, out=None, offset=0, **kw):
        """The triton top-k: bitwise `indexer_topk_ref`'s picks (the documented rule), written as entry + offset
        (-1 kept) where the decode step has it fill the attention's index tensor."""
        from kernels.indexer import indexer_topk_ref
        got = self.k["indexer_topk"](scores, k, n_valid, check=check, ratio=ratio, out=out, offset=offset, **kw)
        want = indexer_topk_ref(scores, k, n_valid, check=False, ratio=ratio)
        assert torch.equal(got, torch.where(want >= 0, want + offset, want)), f"indexer_topk offset={offset}"
        assert out is None or got.data_ptr() == out.data_ptr()
        self.paths["indexer_topk_into_idx" if out is not None else "indexer_topk"] += 1
        return got

    def indexer_scores_scaled(self, q, weights, k, weight_scale):
        """The indexer's scores with the head-weight scale inside the launch: bitwise the triton backend's
        `indexer_scores` of the model's bf16 product `weights * weight_scale`."""
        from kernels import indexer as ki
        got = self.k["indexer_scores_scaled"](q, weights, k, weight_scale)
        two = ki.indexer_scores(q, weights * weight_scale, k)
        assert torch.equal(got, two), f"indexer_scores_scaled {tuple(q.shape)} vs the product then indexer_scores"
        self.paths["indexer_scores_scaled"] += 1
        return got

    def linear_swiglu(self, x, weight, scale, act_block, limit):
        """The joint w13 projection + SwiGLU: bitwise the triton backend's two steps (its `linear`, then its
        `swiglu_joint`, each checked against its reference here), whichever path it took."""
        got = self.k["linear_swiglu"](x, weight, scale, act_block, limit)
        two = self.swiglu_joint(self.linear(x, weight, scale, act_block), limit)
        assert got.dtype == two.dtype and got.shape == two.shape and torch.equal(
            got.view(torch.int16), two.view(torch.int16)), "linear_swiglu: not bitwise linear then swiglu_joint"
        self.paths["linear_swiglu_row" if x.numel() == x.shape[-1] else "linear_swiglu"] += 1
        return got

    def moe_routed_combine(self, x, weights, ids, experts, limit, act_blocks, shared):
        """Routed experts + the combine in one call: bitwise the triton backend's `moe_routed` then `moe_combine`
        (each checked against its reference here)."""
        got = self.k["moe_routed_combine"](x, weights, ids, experts, limit, act_blocks, shared)
        two = self.moe_combine(self.moe_routed(x, weights, ids, experts, limit, act_blocks), shared)
        assert got.dtype == two.dtype and got.shape == two.shape and torch.equal(
            got.view(torch.int16), two.view(torch.int16)), "moe_routed_combine: not bitwise moe_routed + combine"
        self.paths["moe_routed_combine"] += 1
        return got

    def swiglu_joint(self, uv, limit):
        from kernels.moe import swiglu_joint_ref
        got, want = self.k["swiglu_joint"](uv, limit), swiglu_joint_ref(uv, limit)
        self._bf16_once(got, want, f"swiglu_joint {tuple(uv.shape)}")
        self.paths["swiglu_joint"] += 1
        return got

    def moe_combine(self, y, shared):
        from kernels.moe import moe_combine_ref
        got, want = self.k["moe_combine"](y, shared), moe_combine_ref(y, shared)
        assert torch.equal(got, want), f"moe_combine {tuple(y.shape)}: one fp32 sum, one rounding"
        self.paths["moe_combine"] += 1
        return got

    def head_rms(self, x, eps):
        """Within 2 bf16 ulps of the torch chain (the sum of squares in another order moves the rounded mean by
        one ulp at most, the product by one more) and mostly bitwise against the same chain with each op in fp32
        and rounded to bf16 (CUDA torch's; the CPU's bf16 rsqrt is not correctly rounded: test_norm_kernel.py)."""
        from kernels.norm import head_rms_ref
        got, want = self.k["head_rms"](x, eps), head_rms_ref(x, eps)
        assert got.dtype == x.dtype == torch.bfloat16 and got.shape == x.shape, "head_rms"
        w = want.float()
        assert bool(((got.float() - w).abs() <= 2.0 ** -6 * w.abs()).all()), f"head_rms {tuple(x.shape)}"
        xf, d = x.float(), x.shape[-1]

        def r(t):
            return t.to(torch.bfloat16).float()
        chain = r(xf * r(torch.rsqrt(r(r(r(xf * xf).sum(-1, keepdim=True) / d) + eps))))
        assert_mostly_bitwise(got, chain.to(torch.bfloat16), f"head_rms {tuple(x.shape)}")
        self.paths["head_rms"] += 1
        return got

    def step_index(self, P, W, comp, ratio, n_entries):
        from kernels.attention import step_index_ref
        got, want = self.k["step_index"](P, W, comp, ratio, n_entries), step_index_ref(P, W, comp, ratio, n_entries)
        assert torch.equal(got, want), f"step_index P={P.tolist()} W={W} ratio={ratio}"
        self.paths["step_index"] += 1
        return got

    def rotate_fp4(self, x):
        from kernels.indexer import rotate_fp4_ref
        from tests.unit.test_indexer_kernels import assert_fp4_within_one_code
        got, want = self.k["rotate_fp4"](x), rotate_fp4_ref(x)
        assert_fp4_within_one_code(got, want, x, f"rotate_fp4 {tuple(x.shape)}")
        self.paths["rotate_fp4"] += 1
        return got

    def compress_pool(self, a, z, ape, pos, kv, score, r, overlap):
        from kernels.compressor import compress_pool_ref
        kv2, sc2 = kv.clone(), score.clone()
        want = compress_pool_ref(a, z, ape, pos, kv2, sc2, r, overlap)
        got = self.k["compress_pool"](a, z, ape, pos, kv, score, r, overlap)
        assert torch.equal(kv, kv2) and torch.equal(score, sc2), f"compress_pool state r={r}"
        mag = want.abs().amax(-1, keepdim=True)
        assert bool(((got - want).abs() <= 1e-6 * mag).all()), f"compress_pool pooled r={r}"
        self.paths["compress_pool"] += 1
        return got

    def compress_commit(self, new, pos, kv, score, out, r, overlap):
        from kernels.compressor import compress_commit_ref
        kv2, sc2, out2 = kv.clone(), score.clone(), out.clone()
        compress_commit_ref(new, pos, kv2, sc2, out2, r, overlap)
        self.k["compress_commit"](new, pos, kv, score, out, r, overlap)
        for name, a, b in (("kv", kv, kv2), ("score", score, sc2), ("out", out, out2)):
            assert torch.equal(a, b), f"compress_commit {name} r={r} pos={pos.tolist()}"
        at = pos.tolist()  # one position per row (issue 24): a boundary where any row completes a window
        self.paths[f"commit_r{r}" + ("_boundary" if any((p + 1) % r == 0 for p in at) else "")] += 1


@pytest.fixture
def models():
    """(triton bf16, reference bf16, reference fp32): the same quantized weights (built per test: 0.4 s; the
    triton model's entries are wrapped by `Checked`)."""
    args = tiny_args(**ARGS)
    tri = Transformer(args, dtype=torch.bfloat16, backend="triton", weights="quantized")
    fill_random_quantized_(tri, seed=11)
    _spread_scales_(tri, seed=12)
    sd = tri.state_dict()
    out = [tri]
    for dtype in (torch.bfloat16, torch.float32):
        m = Transformer(args, dtype=dtype, backend="reference", weights="quantized")
        m.load_state_dict(sd)
        out.append(m)
    return tuple(out)


def _noise_criterion(tri_logits, ref_logits, f32_logits, what):
    kernel_err = float((tri_logits - ref_logits).abs().amax(-1).mean())
    noise = float((ref_logits - f32_logits).abs().amax(-1).mean())
    assert bool(torch.isfinite(tri_logits).all()), what
    assert noise > 0 and kernel_err <= 2 * noise, f"{what}: triton-vs-reference {kernel_err:.3f} > 2 x " \
                                                   f"bf16-vs-fp32 {noise:.3f}"


def test_prefill_and_first_twin_step_every_path_matches_reference(models, monkeypatch, seed):
    """A triton prefill of 10 tokens x 2 sequences (the M > 64 / P > 192 branches, module docstring) and one
    graph-twin decode step from that state (the M <= 64 / gemv branches, and `_Static` built from a triton
    prefill): every fast-path call equals its reference; the logits are within the model's own bf16 noise."""
    import kernels.fp32_linear as kf
    import kernels.gemm as kg
    import kernels.moe as km
    tri, ref, f32 = models
    chk = Checked(tri)
    ids = torch.randint(0, ARGS["vocab_size"], (BATCH, PREFILL), generator=torch.Generator().manual_seed(seed))
    tok = torch.randint(0, ARGS["vocab_size"], (BATCH, 1), generator=torch.Generator().manual_seed(seed + 1))
    st = tri.new_state(BATCH, 256)
    with monkeypatch.context() as mp:
        for mod in (kg, kf):
            mp.setattr(mod, "GEMV_MAX_M", 8)
        mp.setattr(km, "GEMV_MAX_PAIRS", 8)
        a = tri(ids, st, all_logits=True)
    prefill_paths = dict(chk.paths)
    b = tri(tok, st)
    want = {"fp8_mm", "fp32_mm", "wo_a_bmm", "moe_tiles", "router", "rms_norm"}
    assert want <= set(prefill_paths), f"prefill paths {prefill_paths}"
    assert {"fp8_gemv", "fp32_gemv", "wo_a_gemv", "moe_gemv", "rope_tail", "kv_finish", "rotate_fp4",
            "head_rms", "step_index", "swiglu_joint", "moe_combine", "compress_pool", "commit_r4",
            "commit_r128"} <= set(chk.paths), \
        f"paths {dict(chk.paths)}"
    r_st, f_st = ref.new_state(BATCH), f32.new_state(BATCH)
    ra, fa = ref(ids, r_st, all_logits=True), f32(ids, f_st, all_logits=True)
    rb, fb = ref(tok, r_st), f32(tok, f_st)
    _noise_criterion(torch.cat((a, b[:, None]), 1), torch.cat((ra, rb[:, None]), 1),
                     torch.cat((fa, fb[:, None]), 1), "prefill + first decode logits")


def test_twin_decode_across_compression_boundaries_matches_reference(models, seed):
    """The graph twin decodes positions 127 and 128 (a reference prefill of the same weights before): both
    compressors commit at 127 (the commit kernels on a boundary), 128 reads the new entries, every step wraps the
    window ring; every fast-path call equals its reference and the logits stay within the bf16 noise."""
    tri, ref, f32 = models
    ids = torch.randint(0, ARGS["vocab_size"], (BATCH, LATE), generator=torch.Generator().manual_seed(seed))
    toks = torch.randint(0, ARGS["vocab_size"], (2, BATCH, 1), generator=torch.Generator().manual_seed(seed + 1))
    st = ref.new_state(BATCH, 256)
    ref(ids, st)                                    # a reference prefill of the same weights
    # the bf16 reference's own state: a copy of that prefill (a second prefill of the same ids gives the same
    # tensors bitwise)
    r_st = DecodeState(copy.deepcopy(st.layers), pos=st.pos, max_len=st.max_len, owner=weakref.ref(ref))
    # hand the state to the triton model: its caches hold the keys of the same weights (the models share them)
    st.owner, st.checked_by = weakref.ref(tri), None
    f_st = f32.new_state(BATCH)
    f32(ids, f_st)
    chk = Checked(tri)
    got, want, exact = [], [], []
    for tok in toks:
        got.append(tri(tok, st))
        want.append(ref(tok, r_st))
        exact.append(f32(tok, f_st))
    assert st.pos == LATE + 2
    assert {"commit_r4_boundary", "commit_r128_boundary", "fp8_gemv", "wo_a_gemv", "moe_gemv", "rope_tail",
            "kv_finish", "rotate_fp4", "head_rms", "step_index", "swiglu_joint", "moe_combine", "compress_pool",
            "fp32_gemv"} <= set(chk.paths), \
        dict(chk.paths)
    _noise_criterion(torch.stack(got), torch.stack(want), torch.stack(exact), "decode logits at 127, 128")


def test_one_row_decode_every_path_matches_reference(models, seed):
    """Batch-1 decode (the one-row FP8 GEMV, `kernels.gemm.RowsConfig`, for every FP8 linear and the grouped wo_a;
    the routed experts' unsorted gemv): a reference prefill of 126 tokens of one sequence, then the triton decode
    step at 126 and 127 (the ratio-4 and ratio-128 commits at 127): every fast-path call equals its reference and
    the logits stay within the bf16 noise."""
    tri, ref, f32 = models
    ids = torch.randint(0, ARGS["vocab_size"], (1, LATE - 1), generator=torch.Generator().manual_seed(seed))
    toks = torch.randint(0, ARGS["vocab_size"], (2, 1, 1), generator=torch.Generator().manual_seed(seed + 1))
    st = ref.new_state(1, 256)
    ref(ids, st)
    r_st = DecodeState(copy.deepcopy(st.layers), pos=st.pos, max_len=st.max_len, owner=weakref.ref(ref))
    st.owner, st.checked_by = weakref.ref(tri), None  # the reference prefill's caches: the models share weights
    f_st = f32.new_state(1)
    f32(ids, f_st)
    chk = Checked(tri)
    got, want, exact = [], [], []
    for tok in toks:
        got.append(tri(tok, st))
        want.append(ref(tok, r_st))
        exact.append(f32(tok, f_st))
    assert {"fp8_gemv_row", "wo_a_gemv_row", "moe_gemv", "fp32_gemv", "commit_r4_boundary",
            "commit_r128_boundary", "linear_swiglu_row", "moe_routed_combine", "qkv_finish",
            "qkv_finish_index", "sparse_attn_rope", "rope_rotate_fp4", "indexer_scores_scaled",
            "qkv_finish_index_window", "indexer_topk_into_idx"} <= set(chk.paths), \
        dict(chk.paths)
    assert "fp8_gemv" not in chk.paths and "wo_a_gemv" not in chk.paths, dict(chk.paths)
    _noise_criterion(torch.stack(got), torch.stack(want), torch.stack(exact), "one-row decode logits at 126, 127")


def test_ragged_decode_every_path_matches_reference(models, seed):
    """Issue 24 in bf16: rows at different positions (a reference prefill of 126 and of 127 tokens into the two
    row views) decode one token and then a verify-sized step of 3 tokens per row through the triton decode step
    with per-row positions: every fast-path call equals its reference (`Checked`: the per-row compressor pooling
    and commit, whose ratio-4 and ratio-128 boundaries fall at different steps in each row, RoPE with pos [b, s],
    the quantization simulations, the GEMVs), and the logits stay within the bf16 noise of the reference run on
    the same ragged state."""
    tri, ref, f32 = models
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ARGS["vocab_size"], (BATCH, LATE), generator=g)
    toks = [torch.randint(0, ARGS["vocab_size"], (BATCH, n), generator=g) for n in (1, 3)]
    states = []
    for m in (ref, ref, f32):
        st = m.new_state(BATCH, 256)
        m(ids[:1, :LATE - 1], st.row(0))
        m(ids[1:], st.row(1))
        states.append(st)
    st, r_st, f_st = states
    assert st.row_pos == [LATE - 1, LATE]
    st.owner, st.checked_by = weakref.ref(tri), None  # the reference prefill's caches: the models share weights
    chk = Checked(tri)
    got, want, exact = [], [], []
    for tok in toks:
        got.append(tri(tok, st, all_logits=True).flatten(0, 1))
        want.append(ref(tok, r_st, all_logits=True).flatten(0, 1))
        exact.append(f32(tok, f_st, all_logits=True).flatten(0, 1))
    assert st.row_pos == [LATE + 3, LATE + 4]
    assert {"commit_r4_boundary", "commit_r128_boundary", "compress_pool", "rope_tail"} <= set(chk.paths), \
        dict(chk.paths)
    _noise_criterion(torch.cat(got), torch.cat(want), torch.cat(exact), "ragged decode logits")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_reference_twin_equals_eager_decode_bitwise(dtype, seed):
    """The decode step (device position, static ring + entry slots, branch-free compressors, fixed-k indexer) on
    the reference backend against ONE prefill of the same tokens (another code path: whole-window pooling, the
    call's own keys), weights="quantized", across positions 120-131 (both compressors' boundaries at 123 / 127,
    the ring wrapping every step): fp32 within fp32 summation order (max |d| <= 1e-5); bf16 within the model's
    own bf16 noise (mean over positions of max |d logit| <= 2x the bf16-vs-fp32 distance of the prefill rows,
    `_noise_criterion`), with the same greedy token at >= 10 of the 12 positions (bf16 near-ties). A wrong
    position, slot or boundary anywhere in the step changes the logits far beyond both. (The name, from when the
    anchor was a second decode implementation, is kept: hard-stop ids are the merge gate's contract.)"""
    args = tiny_args(**ARGS)
    models = {}
    for dt in {dtype, torch.float32}:
        models[dt] = Transformer(args, dtype=dt, backend="reference", weights="quantized")
        fill_random_quantized_(models[dt], seed=seed % 1000)
        _spread_scales_(models[dt], seed=seed % 1000 + 1)
    m = models[dtype]
    ids = torch.randint(0, ARGS["vocab_size"], (BATCH, 132), generator=torch.Generator().manual_seed(seed))
    st = m.new_state(BATCH)
    got = [m(ids[:, :120], st)]
    for t in range(120, 131):
        got.append(m(ids[:, t:t + 1], st))
    got = torch.stack(got, 1)                                        # positions 119..130
    full = m(ids[:, :131], m.new_state(BATCH), all_logits=True)[:, 119:]
    if dtype == torch.float32:
        assert float((got - full).abs().max()) <= 1e-5, f"max |d| {float((got - full).abs().max())}"
    else:
        exact = models[torch.float32](ids[:, :131], models[torch.float32].new_state(BATCH), all_logits=True)[:, 119:]
        _noise_criterion(got, full, exact, "bf16 decode steps vs prefill")
        assert int((got.argmax(-1) == full.argmax(-1)).sum()) >= 10 * BATCH, "greedy tokens differ"
