"""The seeded faults: one function per mutant, `apply(mp: pytest.MonkeyPatch) -> None`.

Each patch is small and reversible (`mp.undo()` restores the product code) and changes exactly one thing
against the reference spec. Patches replace the attribute where the product code looks it up at call time:
a module global (`dsv4.model.apply_rope`, `kernels.mhc.sinkhorn_ref`, ...) or a class method. Backends
(`dsv4.backend.get_backend`) read `kernels.*.*_ref` when a model is built, which happens after the plugin
has applied the patch, so the model runs the mutant too. Most patches wrap the product function (changing
one input or output) or its constructor (changing one attribute), so they follow the product code as it
evolves; where the fault sits inside a formula (`final_logits`, `apply_rope`) the patch is a copy of the
formula. The changed line carries `# MUTANT`.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

MP = pytest.MonkeyPatch


# ------------------------------------------------------------------------------------------------ prompt
def hand_rolled_prompt_in_generate(mp: MP) -> None:
    """`dsv4.generate.generate` builds its input with the legacy hand-rolled prompt
    `[BOS, <｜User｜>] + encode("\\n\\n" + text) + [<｜Assistant｜>]`; `prompt_ids` stays correct for every
    other caller (the template tests see nothing)."""
    from dsv4 import diagnose, encoding

    orig = encoding.prompt_ids

    def prompt_ids(tokenizer, messages, thinking=True, **kw):
        if sys._getframe(1).f_globals.get("__name__") == "dsv4.generate":
            return diagnose.hand_rolled_ids(tokenizer, messages[-1]["content"])
        return orig(tokenizer, messages, thinking=thinking, **kw)

    mp.setattr(encoding, "prompt_ids", prompt_ids)


# ------------------------------------------------------------------------------------------------ final path
def final_norm_removed(mp: MP) -> None:
    """logits = head(hc_head(H)): the final RMSNorm `norm` is skipped."""
    from dsv4.model import Transformer

    def final_logits(self, H):
        y = self.hc_head(H, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.backend)
        return self.head(y)  # MUTANT: no self.norm

    mp.setattr(Transformer, "final_logits", final_logits)


def final_norm_before_hc_head(mp: MP) -> None:
    """logits = head(hc_head(norm(H))): the final norm is applied to each stream before the collapse."""
    from dsv4.model import Transformer

    def final_logits(self, H):
        H = self.norm(H)  # MUTANT: norm before hc_head, none after
        return self.head(self.hc_head(H, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.backend))

    mp.setattr(Transformer, "final_logits", final_logits)


def final_norm_without_rms(mp: MP) -> None:
    """The final `norm` still runs between hc_head and the head but only multiplies by its weight (the rsqrt of
    the mean square is lost): the execution order is right, the magnitude is not normalised."""
    from dsv4.model import Transformer

    orig = Transformer.__init__

    def __init__(self, *a, **kw):
        orig(self, *a, **kw)
        norm = self.norm
        norm.forward = lambda x: (norm.weight.float() * x.float()).to(x.dtype)  # MUTANT: no rsqrt(mean(x^2))

    mp.setattr(Transformer, "__init__", __init__)


# ------------------------------------------------------------------------------------------------ mHC
def comb_untransposed(mp: MP) -> None:
    """hc_post mixes with comb itself: H_new[k] = post_k a + sum_j comb[k, j] H_j (should be comb[j, k])."""
    from kernels import mhc

    orig = mhc.hc_post_ref

    def hc_post_ref(a, H, post, comb):
        return orig(a, H, post, comb.transpose(1, 2).contiguous())  # MUTANT: orientation flipped

    mp.setattr(mhc, "hc_post_ref", hc_post_ref)


def sinkhorn_ends_on_row_step(mp: MP) -> None:
    """Sinkhorn ends on a row step: one extra row normalisation after the last column step (rows sum to 1,
    columns no longer do; visible until the iteration has converged past fp32 resolution)."""
    from kernels import mhc

    orig = mhc.sinkhorn_ref

    def sinkhorn_ref(logits, iters, eps):
        c = orig(logits, iters, eps)
        return c / (c.sum(-1, keepdim=True) + eps)  # MUTANT: final row step

    mp.setattr(mhc, "sinkhorn_ref", sinkhorn_ref)


# ------------------------------------------------------------------------------------------------ RoPE
def rope_split_halves(mp: MP) -> None:
    """RoPE rotates (i, i + rd/2) pairs (GPT-NeoX "rotate_half") instead of interleaved (2i, 2i+1) pairs. Patched
    where it is looked up: `dsv4.model` (the eager model) and `kernels.numerics`, its definition (the reference
    `kernels.rope.rope_tail_ref` of the graph step)."""
    from dsv4 import model
    from kernels import numerics

    def apply_rope(x, pos, inv_freq, inverse=False):
        ang = pos.to(torch.float64)[..., None] * inv_freq.to(pos.device)
        cos, sin = ang.cos().float(), ang.sin().float()
        if inverse:
            sin = -sin
        if x.dim() == 4:
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        x0, x1 = x.float().chunk(2, dim=-1)  # MUTANT: halves, not unflatten(-1, (-1, 2))
        return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).to(x.dtype)

    mp.setattr(model, "apply_rope", apply_rope)
    mp.setattr(numerics, "apply_rope", apply_rope)


def yarn_mscale_applied(mp: MP) -> None:
    """DeepSeek-V3's YaRN attention scaling carried over: softmax scale *= mscale^2 with
    mscale = 0.1 ln(rope_factor) + 1 on the YaRN (compressed) layers."""
    from dsv4.model import Attention

    orig = Attention.__init__

    def __init__(self, *a, **kw):
        orig(self, *a, **kw)
        if self.ratio:
            mscale = 0.1 * math.log(self.args.rope_factor) + 1.0
            self.scale = self.scale * mscale * mscale  # MUTANT

    mp.setattr(Attention, "__init__", __init__)


def rope_theta_per_layer_type_ignored(mp: MP) -> None:
    """Every layer uses rope_theta without YaRN; compressed layers should use compress_rope_theta + YaRN."""
    from dsv4 import model

    orig = model.rope_inv_freq
    mp.setattr(model, "rope_inv_freq", lambda args, ratio, dim=None: orig(args, 0, dim))  # MUTANT: ratio -> 0


def mtp_rope_compressed(mp: MP) -> None:
    """vllm#48304's class: the MTP block (layer_id n_layers, ratio 0: rope_theta, no YaRN) gets the compressed
    layers' frequencies (compress_rope_theta with the YaRN ramp) on its attention."""
    from dsv4 import model

    orig = model.MTPBlock.__init__

    def __init__(self, args, layer_id, sim, dtype):
        orig(self, args, layer_id, sim, dtype)
        f = self.attn.inv_freq
        f.copy_(model.rope_inv_freq(args, 4, f.numel() * 2).to(f.dtype))  # MUTANT: the compressed layers' RoPE

    mp.setattr(model.MTPBlock, "__init__", __init__)


# ------------------------------------------------------------------------------------------------ attention
def window_off_by_one(mp: MP) -> None:
    """Sliding window of window_size + 1 tokens (129 instead of 128; 9 instead of 8 in the tiny config)."""
    from dsv4.model import Attention

    orig = Attention.__init__

    def __init__(self, *a, **kw):
        orig(self, *a, **kw)
        self.window = self.args.window_size + 1  # MUTANT

    mp.setattr(Attention, "__init__", __init__)


def attention_sink_dropped(mp: MP) -> None:
    """Sparse attention without the per-head sink term in the softmax denominator (sink logit -> -1e30)."""
    from kernels import attention

    orig = attention.sparse_attn_ref

    def sparse_attn_ref(q, kv, attn_sink, idx, softmax_scale):
        return orig(q, kv, torch.full_like(attn_sink, -1e30), idx, softmax_scale)  # MUTANT

    mp.setattr(attention, "sparse_attn_ref", sparse_attn_ref)


# ------------------------------------------------------------------------------------------ compressor / indexer
def csa_overlap_state_lost(mp: MP) -> None:
    """After the prefill, the overlapping (CSA) compressor forgets the previous full window (slots 0..r-1),
    so the first entry completed by decode pools zeros / -inf instead of the prefill's last window."""
    from dsv4.model import Compressor

    orig = Compressor.extend

    def extend(self, x, p, st, out, *args, **kwargs):  # the rest as the method's (it gained `backend`)
        new = orig(self, x, p, st, out, *args, **kwargs)
        if self.overlap and p == 0:  # MUTANT: overlap half of the state reset at the prefill -> decode boundary
            st.kv[:, :self.ratio] = 0
            st.score[:, :self.ratio] = -math.inf
        return new

    mp.setattr(Compressor, "extend", extend)


def compressor_state_shared_across_requests(mp: MP) -> None:
    """The compressors' kv/score state lives on the module and is never reset between sequences (the official
    inference code's buffers, reference spec §6 / §12): a new request's first windows pool the previous
    request's leftovers."""
    from dsv4.model import Compressor

    orig = Compressor.new_state

    def new_state(self, b, device):
        cached = self.__dict__.get("_mutant_state")
        if cached is None or cached.kv.shape[0] != b:  # MUTANT: one state per module, handed to every sequence
            cached = self.__dict__["_mutant_state"] = orig(self, b, device)
        return cached

    mp.setattr(Compressor, "new_state", new_state)


def compressed_entry_one_token_early(mp: MP) -> None:
    """The indexer lets query t see entry w when w < (t + 2) // 4 instead of (t + 1) // 4: during prefill an
    entry becomes visible one token before its window is complete (a future token leaks in).

    Prefill positions are 0..s-1 (the model's contract), so the wrapper of the top-k can recompute the causal
    count; in decode the count is capped by the entries that exist, so the early bound changes nothing there
    (and the top-k width k = min(index_topk, count at the last query) is the same for both bounds)."""
    from dsv4 import model

    orig = model.indexer_topk_ref

    def indexer_topk_ref(scores, k, n_valid=None, *, check=True, ratio=0):
        b, s, n = scores.shape
        if s > 1 and n_valid is not None:  # prefill
            pos = torch.arange(s, device=scores.device)
            n_valid, ratio = ((pos + 2) // 4).clamp(max=n).expand(b, s), 0  # MUTANT: (pos + 1) // 4
        return orig(scores, k, n_valid, check=check, ratio=ratio)

    mp.setattr(model, "indexer_topk_ref", indexer_topk_ref)


def decode_ties_differ_from_prefill(mp: MP) -> None:
    """One-token (decode) calls break exact indexer-score ties toward the HIGHER entry index; prefill keeps
    the spec's lower-index rule."""
    from dsv4 import model

    orig = model.indexer_topk_ref

    def indexer_topk_ref(scores, k, n_valid=None, *, check=True, ratio=0):
        if ratio and n_valid is not None:  # positions (the model's call since issue 27) -> counts, as the reference
            n_valid = ((n_valid + 1) // ratio).clamp(max=scores.shape[2])
        if scores.shape[1] != 1 or n_valid is None:
            return orig(scores, k, n_valid, check=check)
        out = torch.full((*scores.shape[:2], k), -1, dtype=torch.int64, device=scores.device)
        for bi in range(scores.shape[0]):  # MUTANT: stable sort of the reversed eligible prefix
            nv = min(int(n_valid[bi, 0]), scores.shape[2])
            order = torch.sort(scores[bi, 0, :nv].flip(0), descending=True, stable=True).indices
            picks = nv - 1 - order[:k]
            out[bi, 0, :picks.numel()] = picks
        return out

    mp.setattr(model, "indexer_topk_ref", indexer_topk_ref)


# ------------------------------------------------------------------------------------------------ MoE
def hash_routing_ignored(mp: MP) -> None:
    """Hash layers route by top-k of the router scores (with a zero bias) instead of `tid2eid[token]`; the
    loaded `tid2eid` table is never read."""
    from dsv4.model import Gate

    orig = Gate.__init__

    def __init__(self, *a, **kw):
        orig(self, *a, **kw)
        if self.hash:  # MUTANT: route as a score layer; a non-persistent zero bias keeps the state dict intact
            self.hash = False
            self.register_buffer("bias", torch.zeros(self.weight.shape[0], device=self.weight.device),
                                 persistent=False)

    mp.setattr(Gate, "__init__", __init__)


def swiglu_clamp_missing(mp: MP) -> None:
    """SwiGLU without the swiglu_limit clamp (up in [-limit, limit], gate <= limit): every expert is built with
    limit 0, which the product code treats as "no clamp": the `Expert` modules (the shared expert, direct calls)
    and the limit each MoE hands its routed experts (`MoE.init_routed`, `kernels.moe.moe_routed_ref` /
    `moe_experts`)."""
    from dsv4.model import Expert, MoE

    orig = Expert.__init__

    def __init__(self, *a, **kw):
        orig(self, *a, **kw)
        self.limit = 0.0  # MUTANT

    orig_routed = MoE.init_routed

    def init_routed(self, *a, **kw):
        orig_routed(self, *a, **kw)
        self.limit = 0.0  # MUTANT

    mp.setattr(Expert, "__init__", __init__)
    mp.setattr(MoE, "init_routed", init_routed)


# ------------------------------------------------------------------------------------------------ formats
def ue8m0_read_as_byte(mp: MP) -> None:
    """ue8m0 scales decoded as the number of the raw byte (120 -> 120.0) instead of 2^(byte - 127). Patched in
    `kernels.numerics` (the definition, where the dequantizers look it up) and its re-export `dsv4.quant`."""
    from dsv4 import quant
    from kernels import numerics

    def e8m0_to_float(scale):
        return scale.view(torch.uint8).float()  # MUTANT

    mp.setattr(numerics, "e8m0_to_float", e8m0_to_float)
    mp.setattr(quant, "e8m0_to_float", e8m0_to_float)


def fp4_nibbles_swapped(mp: MP) -> None:
    """FP4 unpacking takes element 2k from the HIGH nibble and 2k+1 from the low one. Patched in `kernels.numerics`
    (the definition) and its re-export `dsv4.quant` (where the model looks it up)."""
    from dsv4 import quant
    from kernels import numerics

    orig = quant.fp4_dequant

    def fp4_dequant(weight, scale, out_dtype=torch.float32, block=quant.FP4_BLOCK):
        b = weight.view(torch.uint8)
        swapped = ((b & 0xF) << 4) | (b >> 4)  # MUTANT: swap the nibbles, then unpack as usual
        return orig(swapped.view(weight.dtype), scale, out_dtype, block)

    mp.setattr(numerics, "fp4_dequant", fp4_dequant)
    mp.setattr(quant, "fp4_dequant", fp4_dequant)


# ------------------------------------------------------------------------------- bf16 numerics (issue 17)
def act_quant_skipped(mp: MP) -> None:
    """bf16 mode feeds the FP8/FP4 linears their bf16 input: the FP8 activation quantization (e4m3, 128-channel
    ue8m0 blocks) before the GEMM is skipped."""
    from dsv4.model import _Sim

    mp.setattr(_Sim, "act_block_of", lambda self, n: 0)  # MUTANT: no act_quant (`_Sim.act`, every linear's and
    # the routed experts' act_block)


def kv_fp8_skipped(mp: MP) -> None:
    """bf16 mode skips the e4m3 rounding of the KV nope channels ([F0] behaviour instead of the current [F1]
    QAT simulation): window KV and compressed entries keep their bf16 values."""
    from dsv4.model import _Sim

    mp.setattr(_Sim, "kv_nope", lambda self, x, op=None: x)  # MUTANT: no FP8 rounding (any backend's op)


def indexer_fp4_block_16(mp: MP) -> None:
    """Indexer queries and keys are FP4-rounded in 16-channel blocks instead of 32."""
    from dsv4.model import _Sim

    def fp4(self, x, op=None):  # MUTANT: block 16 (the model's sim or the backend's op alike)
        return (op or self._quant.fp4_act_quant_sim)(x.contiguous(), 16) if self.enabled else x

    mp.setattr(_Sim, "fp4", fp4)


def indexer_weight_scale_after_scoring(mp: MP) -> None:
    """The indexer weight scale 128^-0.5 * 64^-0.5 is applied to the fp32 scores after the scoring instead of
    to weights_proj(x) before its bf16 rounding (top-k order unchanged up to rounding)."""
    from dsv4.model import Indexer

    orig_init, orig_reduce = Indexer.__init__, Indexer.reduce_scores

    def __init__(self, *a, **kw):
        orig_init(self, *a, **kw)
        self.true_scale, self.weight_scale = self.weight_scale, 1.0  # MUTANT: w unscaled ...

    def reduce_scores(self, scores):
        return orig_reduce(self, scores) * self.true_scale  # MUTANT: ... and the scores scaled instead

    mp.setattr(Indexer, "__init__", __init__)
    mp.setattr(Indexer, "reduce_scores", reduce_scores)


def router_logits_bf16(mp: MP) -> None:
    """Router logits computed in the activation dtype (HF's numerics: bf16 weight, bf16 product) instead of
    `x.float() @ W.float()^T`; the rest of `Gate.forward` unchanged (a copy of it)."""
    from dsv4.model import Gate

    def forward(self, x, input_ids):
        logits = (x @ self.weight.to(x.dtype).T).float()  # MUTANT: was x.float() @ self.weight.float().T
        if self.hash:
            return self.route(logits, None, self.tid2eid[input_ids], self.topk, self.score_func, self.route_scale)
        return self.route(logits, self.bias, None, self.topk, self.score_func, self.route_scale)

    mp.setattr(Gate, "forward", forward)


def fp32_linear_in_bf16(mp: MP) -> None:
    """The official fp32-compute linears (compressor wkv / wgate, head) compute in the activation dtype and
    only cast the result to fp32."""
    from dsv4.model import Linear

    orig = Linear.forward

    def forward(self, x):
        if self.fp32 and x.dtype != torch.float32:
            return (x @ self.dequantized_weight().to(x.dtype).T).float()  # MUTANT: bf16 matmul
        return orig(self, x)

    mp.setattr(Linear, "forward", forward)


def fp32_linear_kernel_x_bf16(mp: MP) -> None:
    """The Triton bf16-weight fp32 linear (`kernels.fp32_linear.fp32_linear`, head / router / compressor held bf16)
    rounds x to bf16 before its products, as a bf16 tensor-core dot would; the references are unchanged."""
    import kernels.fp32_linear as kf

    orig = kf.fp32_linear

    def fp32_linear(x, weight, **kw):
        if x.dim() == 2 and x.shape[0] <= kf.GEMV_MAX_M:
            x = x.to(torch.bfloat16)  # MUTANT: x rounded to bf16
        return orig(x, weight, **kw)

    mp.setattr(kf, "fp32_linear", fp32_linear)


# ------------------------------------------------------------------------------ template / sampler (issue 17)
def hf_tools_misplaced(mp: MP) -> None:
    """`apply_chat_template(messages, tools=T)` without a system message appends the new system message carrying
    T AFTER the conversation instead of putting it first (the template edited, the encoder untouched)."""
    from dsv4 import tokenizer

    orig = tokenizer.chat_template_text
    old = "{%- set msgs_raw = [{'role': 'system', 'content': '', 'tools': tools}] + messages -%}"
    new = "{%- set msgs_raw = messages + [{'role': 'system', 'content': '', 'tools': tools}] -%}"  # MUTANT

    def chat_template_text():
        text = orig()
        assert text.count(old) == 1, "hf_tools_misplaced: the template's tools= line changed; update the mutant"
        return text.replace(old, new)

    mp.setattr(tokenizer, "chat_template_text", chat_template_text)


def sampler_noise_multiplied(mp: MP) -> None:
    """The exponential race multiplies the probabilities by the Exp(1) noise instead of dividing:
    argmax(p * E) is not a draw from p."""
    from dsv4 import generate

    def sample(logits, temperature, generator=None):
        if not (temperature >= 0 and temperature != float("inf")):
            raise ValueError(f"temperature={temperature}: expected a finite number >= 0")
        if temperature == 0:
            return logits.argmax(-1)
        probs = (logits / max(temperature, 1e-5)).softmax(-1)
        noise = torch.empty_like(probs).exponential_(1, generator=generator)
        return (probs * noise).argmax(-1)  # MUTANT: was probs / noise

    mp.setattr(generate, "sample", sample)


# ------------------------------------------------------------------------------ kernel-only terms (issue 17)
def _jit_source_mutant(mp: MP, module, name: str, old: str, new: str) -> None:
    """Replace the `@triton.jit` function `module.name` by a copy of its source with `old` -> `new` (exactly one
    occurrence, else AssertionError: the kernel changed, update the mutant). The copy is written to a temporary
    file (Triton's interpreter re-reads kernel source) and defined against the module's live globals (as
    `_source_mutant`: a name it reads is the module's current one, a test's monkeypatch included); callers look the
    function up in the module at call time, so they run the mutant."""
    import inspect
    import tempfile
    import textwrap
    from pathlib import Path

    src = textwrap.dedent(inspect.getsource(getattr(module, name).fn))
    assert src.count(old) == 1, f"{module.__name__}.{name}: {old!r} occurs {src.count(old)} times; update the mutant"
    path = Path(tempfile.mkdtemp(prefix="dsv4_mutant_")) / f"{name}.py"
    path.write_text(src.replace(old, new), encoding="utf-8")
    local: dict = {}
    exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), vars(module), local)
    mp.setattr(module, name, local[name])


def hc_eps_dropped_in_kernel(mp: MP) -> None:
    """The Triton mHC finish step (shared by hc_pre and hc_head, both launch paths) computes the pre weights as
    sigmoid(...) without `+ hc_eps`; the torch reference keeps it (a ~1e-6 term random inputs never see)."""
    from kernels import mhc

    _jit_source_mutant(mp, mhc, "_finish_tokens", "+ tl.load(base_ptr + j)[None, :]) + hc_eps",
                       "+ tl.load(base_ptr + j)[None, :])  # MUTANT: no + hc_eps")


def mhc_lo_piece_dropped(mp: MP) -> None:
    """The Triton mHC projection for bf16 streams (`_dot_bf16x3`, both launch paths, GPU and interpreter
    branches) multiplies by fn's hi + mid bf16 pieces only: 16-bit weights, a ~2^-17 relative error per product
    that random inputs hide inside the fp32 tolerance (issue 14 item 2)."""
    from kernels import mhc

    _jit_source_mutant(mp, mhc, "_dot_bf16x3", "lo = (r - mid.to(tl.float32)).to(tl.bfloat16)",
                       "lo = (r - r).to(tl.bfloat16)  # MUTANT: lo piece dropped")


def sink_dropped_in_kernel(mp: MP) -> None:
    """The Triton sparse-attention kernel leaves the sink term e^(sink - m) out of the final softmax denominator
    (the one-program path; the running max still starts at the sink); the reference keeps it."""
    from kernels import attention

    _jit_source_mutant(mp, attention, "_sparse_attn_kernel", "o = acc / (l + tl.exp2(sink - m))[:, None]",
                       "o = acc / l[:, None]  # MUTANT: no sink term")


def sink_dropped_in_decode_kernel(mp: MP) -> None:
    """The all-heads decode kernel (`_sparse_decode_kernel`, issue 14 item 1) leaves e^(sink - m) out of the
    denominator, both in the one-program store and where the last split program merges the partials (the merge
    is `_merge_splits`, shared with the head-block kernel)."""
    from kernels import attention

    _jit_source_mutant(mp, attention, "_merge_splits", "o = acc / (ll + tl.exp2(sink - mm))[:, None]",
                       "o = acc / ll[:, None]  # MUTANT: no sink term (merge)")
    _jit_source_mutant(mp, attention, "_sparse_decode_kernel", "o = acc / (l + tl.exp2(sink - m))[:, None]",
                       "o = acc / l[:, None]  # MUTANT: no sink term (one program)")


# ------------------------------------------------------------------------ gaps found by mutation (issue 21)
def rmsnorm_eps_outside_root(mp: MP) -> None:
    """Every RMSNorm computes w·x / (sqrt(mean(x²)) + eps) instead of w·x·rsqrt(mean(x²) + eps): the eps
    outside the root (a 1e-6 relative change wherever mean(x²) ~ 1, i.e. on random weights at their usual scale)."""
    from dsv4.model import RMSNorm

    def forward(self, x):
        xf = x.float()
        return (self.weight.float() * xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)).to(x.dtype)  # MUTANT

    mp.setattr(RMSNorm, "forward", forward)


def routing_weight_after_w2(mp: MP) -> None:
    """Routed experts apply the routing weight g to w2's output (transformers' order) instead of to its input
    h = silu(u)·v before the bf16 rounding and act-quant: equal in exact arithmetic, so fp32 parity cannot see it.
    Patched in `Expert.forward` (an expert called with a weight) and in the routed reference loop
    (`kernels.moe.moe_routed_ref`, which the model's MoE runs: the experts as tensors)."""
    from dsv4.model import Expert
    from kernels import moe

    orig = Expert.forward

    def forward(self, x, weight=None):
        y = orig(self, x)
        return y if weight is None else (y.float() * weight).to(x.dtype)  # MUTANT: g after w2

    mp.setattr(Expert, "forward", forward)
    _source_mutant(mp, moe, "moe_routed_ref",
                   "h = swiglu(u, v, limit, weights[tok, slot, None])\n"
                   "        y.index_add_(0, tok, linear(h.to(x.dtype), ex.w2, ex.s2, down, False).float())",
                   "h = swiglu(u, v, limit)\n"
                   "        out = linear(h.to(x.dtype), ex.w2, ex.s2, down, False)\n"
                   "        y.index_add_(0, tok, (out.float() * weights[tok, slot, None]).to(x.dtype).float())"
                   "  # MUTANT: g after w2")


def compare_logits_rel_dropped(mp: MP) -> None:
    """The final-norm check's `compare_logits` no longer requires the relative L2 error within tolerance (argmax
    and KL only): a softmax-invariant logit shift, or a scale close to 1, passes."""
    from dsv4 import final_norm

    orig = final_norm.compare_logits

    def compare_logits(a, b, factor, rel_tol, kl_tol, tie_tol=0.0):
        return orig(a, b, factor, math.inf, kl_tol, tie_tol)  # MUTANT: rel L2 criterion can never fail

    mp.setattr(final_norm, "compare_logits", compare_logits)


def final_norm_power_check_dropped(mp: MP) -> None:
    """Test 2 judges every comparison decisive: no check that the tolerances would reject a model without a
    final norm (a huge eps, zero weights or constant logits then read as PASS)."""
    from dsv4 import final_norm

    orig = final_norm._judge

    def _judge(*args):
        c = orig(*args)
        c.decisive, c.power_reason = True, ""  # MUTANT: power never checked
        return c

    mp.setattr(final_norm, "_judge", _judge)


def final_norm_tie_unaware(mp: MP) -> None:
    """Test 2 fails any argmax flip between logits(X) and logits(X*c), even a bf16 near-tie (TIE_FACTOR 0)."""
    from dsv4 import final_norm

    mp.setattr(final_norm, "TIE_FACTOR", 0.0)  # MUTANT: no near-tie rule


def hc_head_rounded_per_stream(mp: MP) -> None:
    """The hc_head reference rounds each stream's term pre_j·H_j to the stream dtype before summing (an extra bf16
    rounding; fp32 streams and the bf16-tolerance kernel comparisons cannot see it)."""
    from kernels import mhc

    def hc_head_ref(H, fn, base, scale, *, hc_eps, norm_eps):
        pre = torch.sigmoid(mhc._mixes_ref(H, fn, norm_eps) * scale[0] + base) + hc_eps
        return (pre.unsqueeze(-1) * H.float()).to(H.dtype).sum(1)  # MUTANT: terms rounded, then summed

    mp.setattr(mhc, "hc_head_ref", hc_head_ref)


def generate_ignores_temperature(mp: MP) -> None:
    """`dsv4.generate.generate` samples every token at temperature 0 (greedy) whatever `temperature` it was given;
    `sample` stays right for every other caller (its chi-square test passes)."""
    from dsv4 import generate

    orig = generate.sample

    def sample(logits, temperature, generator=None):
        if sys._getframe(1).f_globals.get("__name__") == "dsv4.generate":
            temperature = 0.0  # MUTANT: the generation path drops the temperature
        return orig(logits, temperature, generator)

    mp.setattr(generate, "sample", sample)


def row_parallel_partial_rounded(mp: MP) -> None:
    """Tensor-parallel `wo_b` (`RowParallelLinear`) rounds each rank's partial product to the activation dtype
    before the all-reduce, instead of summing the fp32 partials and rounding once (bf16 only; fp32 unchanged)."""
    from dsv4.parallel import RowParallelLinear

    def forward(self, x):
        xq = self.sim.act(x)
        return self.comm.all_reduce((xq.float() @ self.dequantized_weight().float().T).to(x.dtype))  # MUTANT

    mp.setattr(RowParallelLinear, "forward", forward)


# ------------------------------------------------------- fast paths the CPU hard stops did not see (issue 22 item 4)
def _source_mutant(mp: MP, module, name: str, old: str, new: str) -> None:
    """`_jit_source_mutant` for a plain Python function or method (`module.name`, module a module or a class,
    replaced by a copy of its source with `old` -> `new`, exactly one occurrence). The copy is defined with the
    defining module's LIVE globals (its `__dict__`, not a snapshot): a name the mutated function looks up at call
    time - a kernel, a helper - is the module's current one, so a test that replaces it (e.g. a spy on a kernel
    launch: `monkeypatch.setattr(km, "_moe_up_gemv_kernel", ...)`) observes the mutant's calls as it observes the
    original's. With a snapshot the mutant called the unspied originals and a launch-choice test failed on ANY
    rewrite, even one that changed nothing (a vacuous kill; found in the sixth session of 2026-12-06,
    `test_source_mutants_see_live_module_globals`)."""
    import inspect
    import sys
    import textwrap

    src = textwrap.dedent(inspect.getsource(getattr(module, name)))
    assert src.count(old) == 1, f"{module.__name__}.{name}: {old!r} occurs {src.count(old)} times; update the mutant"
    live = vars(sys.modules[module.__module__] if inspect.isclass(module) else module)
    local: dict = {}
    exec(compile(src.replace(old, new), f"<mutant {module.__name__}.{name}>", "exec"), live, local)
    mp.setattr(module, name, local[name])


def fp8_gemv_k_block_scale_dropped(mp: MP) -> None:
    """The FP8 decode GEMV kernel (`_fp8_gemv_kernel`, every launch variant) multiplies the last K block by 1
    instead of its ue8m0 weight scale; the prefill paths and the reference keep it."""
    from kernels import gemm

    _jit_source_mutant(mp, gemm, "_fp8_gemv_kernel",
                       "sw = e8m0_to_f32(tl.load(ws_ptr + srow * KB + tl.minimum(kb + u, kb1 - 1)).to(tl.int32))",
                       "sw = e8m0_to_f32(tl.load(ws_ptr + srow * KB + tl.minimum(kb + u, kb1 - 1)).to(tl.int32))\n"
                       "            sw = tl.where(kb + u == KB - 1, 1.0, sw)  # MUTANT: last K block's scale dropped")


def wo_a_gemv_reads_group_0(mp: MP) -> None:
    """The grouped FP8 GEMV (decode `wo_a`) reads every group's input from group 0's columns of x (the group
    offset g*K dropped from the x column); fp8_linear (G = 1) is unchanged."""
    from kernels import gemm

    _jit_source_mutant(mp, gemm, "_fp8_gemv_kernel", "kb1, g * K + (kb + u) * 128, GK",
                       "kb1, (kb + u) * 128, GK")  # MUTANT: group offset dropped


def gemv_tuned_split_drops_k_blocks(mp: MP) -> None:
    """A launch that only the sm_90 table selects gives wrong results: with `unroll=2, num_warps=8` (GEMV_TUNED
    entries only; the default and the test variants use one of them at most) the split-K launch gets one split
    fewer than it needs, so the last K blocks are never summed."""
    from kernels import gemm

    orig = gemm._gemv_launch

    def _gemv_launch(x, weight, ws, out, M, N, K, G, mma, quant_x, cfg, bm=None, split=None):
        if isinstance(cfg, gemm.GemvConfig) and cfg.unroll == 2 and cfg.num_warps == 8 and split is None:
            sp, per = gemm.split_k(x.device, -(-N // cfg.bn) * G, K // 128, cfg.per_sm)
            split = (max(1, sp - 1), per)  # MUTANT
        return orig(x, weight, ws, out, M, N, K, G, mma, quant_x, cfg, bm, split)

    mp.setattr(gemm, "_gemv_launch", _gemv_launch)


def moe_tiles_nibbles_swapped(mp: MP) -> None:
    """The MoE tile kernels (`_fp4_tile_dot`, the prefill path) decode the high nibble as the even input and the
    low one as the odd input in their default decode (the packed one: the PTX on a GPU, MMA 2, and its interpreter
    twin, MMA 3); the gemv path and the references keep the on-disk order."""
    from kernels import moe

    _jit_source_mutant(mp, moe, "_fp4_tile_dot", "lo, hi = _e2m1_bf16x2(b8)",
                       "hi, lo = _e2m1_bf16x2(b8)  # MUTANT: nibbles swapped")
    _jit_source_mutant(mp, moe, "_fp4_tile_dot", "lo, hi = _e2m1_bf16x2_twin(b8)",
                       "hi, lo = _e2m1_bf16x2_twin(b8)  # MUTANT: nibbles swapped")


def graph_rope_stale_position(mp: MP) -> None:
    """The decode step (`Attention.step`, what the CUDA graph captures) de-rotates the attention output by the
    previous step's position (pos - 1, a stale device position); q, the keys and the prefill stay right."""
    from dsv4.model import Attention

    _source_mutant(mp, Attention, "step", "return self._out(self._attend(q, keys, idx, P, backend), P, backend, backend)",
                   "return self._out(self._attend(q, keys, idx, P - 1, backend), P, backend, backend)  # MUTANT: stale")


def rope_tail_token0_position(mp: MP) -> None:
    """The RoPE tail kernel rotates every token of a multi-token call by token 0's position."""
    from kernels import rope

    _jit_source_mutant(mp, rope, "_rope_tail_kernel", "tl.load(pos_ptr + t)", "tl.load(pos_ptr + 0)  # MUTANT")


def rope_tail_heads_as_tokens(mp: MP) -> None:
    """The RoPE tail kernel takes the token index from the row index without dividing out the heads
    (t = row % S instead of (row // H) % S): right for one token, and for any number of tokens without heads."""
    from kernels import rope

    _jit_source_mutant(mp, rope, "_rope_tail_kernel", "t = (row // H) % S", "t = row % S  # MUTANT")


def quant_sim_fp4_ties_away(mp: MP) -> None:
    """The e2m1 simulation kernel (`kernels.quant`, the graph step's indexer q / keys) rounds ties away from
    zero instead of to even; dsv4.quant keeps round-half-even."""
    from kernels import quant as kq

    _jit_source_mutant(mp, kq, "_round_half_even", "(d > 0.5) | ((d == 0.5) & odd)", "(d >= 0.5)")  # MUTANT


def rms_norm_kernel_eps_dropped(mp: MP) -> None:
    """The RMSNorm kernel computes rsqrt(mean(x^2)) without + eps; `rms_norm_ref` keeps it."""
    from kernels import norm

    _jit_source_mutant(mp, norm, "_rms_norm_kernel", "tl.math.rsqrt(ms + eps)", "tl.math.rsqrt(ms)  # MUTANT")


def route_kernel_ties_reversed(mp: MP) -> None:
    """The router kernel breaks exact ties of the biased score toward the HIGHER expert index; `route_ref` (and
    CUDA's torch.topk) take the lower one. Random fp32 logits never tie, so only tie rows see it."""
    from kernels import router

    _jit_source_mutant(mp, router, "_route_kernel", "idx = tl.min(tl.where(cand, offs, BE), 0)",
                       "idx = tl.max(tl.where(cand, offs, -1), 0)  # MUTANT: ties to the higher index")


def compress_pool_kernel_ape_next_slot(mp: MP) -> None:
    """The compressor pooling kernel (graph decode) adds the token's score the positional bias of the NEXT slot
    (ape[(p + 1) % r] instead of ape[p % r]); `compress_pool_ref` and `Compressor.prefill` keep it."""
    from kernels import compressor

    _jit_source_mutant(mp, compressor, "_compress_pool_kernel", "tl.load(ape_ptr + p * W + newcol",
                       "tl.load(ape_ptr + ((p + 1) % R) * W + newcol")


# ------------------------------------------------------------------------------------------------ append (issue 24)
def append_partial_window_dropped(mp: MP) -> None:
    """A call appended inside a compression window pools only its own tokens: the compressor drops the partial
    window an earlier call left in the state (the class of a multi-token verify step corrupting the CSA compressor
    state, vllm-ascend#9111); the prefill (p = 0) and the one-token decode step are unaffected."""
    from dsv4.model import Compressor

    _source_mutant(mp, Compressor, "extend", "w0, have = divmod(p, r)",
                   "w0, have = p // r, 0  # MUTANT: the state's partial window ignored")


def append_ring_slot_shifted(mp: MP) -> None:
    """A call appended after the prefill reads the window positions before it from the next ring slot
    ((u + 1) % W instead of u % W, in `kernels.attention.window_slots`, which `dsv4.model` re-exports): right for
    the prefill (nothing before it)."""
    from dsv4 import model
    from kernels import attention

    _source_mutant(mp, attention, "window_slots", "torch.where(u < p0, u % W, W + u - p0)",
                   "torch.where(u < p0, (u + 1) % W, W + u - p0)")  # MUTANT: shifted ring slot
    mp.setattr(model, "window_slots", attention.window_slots)


def step_index_kernel_ring_slot_shifted(mp: MP) -> None:
    """The decode step's index kernel (`_step_index_kernel`, issue 27) maps a window position to ring slot
    (u + 1) % W; `step_index_ref` keeps u % W."""
    from kernels import attention

    _jit_source_mutant(mp, attention, "_step_index_row", "tl.where(u < p0, u % W, W + u - p0)",
                       "tl.where(u < p0, (u + 1) % W, W + u - p0)")


def joint_weight_halves_swapped(mp: MP) -> None:
    """`dsv4.model.join_fp8` (issue 27: two FP8 projections of one input held as one weight) rebinds the first
    linear to the joint weight's second row range and the second to its first: a load fills them crosswise, so
    the shared expert computes [w3 x | w1 x] (and wq_a / wkv swap); the reference backend never joins."""
    from dsv4 import model

    _source_mutant(mp, model, "join_fp8",
                   """a._buffers["weight"], a._buffers["scale"] = joint.codes[:n], joint.scales[:nb]
    b._buffers["weight"], b._buffers["scale"] = joint.codes[n:], joint.scales[nb:]""",
                   """a._buffers["weight"], a._buffers["scale"] = joint.codes[-n:], joint.scales[-nb:]  # MUTANT
    b._buffers["weight"], b._buffers["scale"] = joint.codes[:-n], joint.scales[:-nb]""")


def kv_finish_window_not_floored(mp: MP) -> None:
    """The fused KV finish kernel (`_kv_finish_kernel`, issue 27) rotates a compressed entry at the decode token's
    position instead of its window's first position ((p // window) * window dropped); the attention's own kv
    (window 1) is unaffected, and so is the prefill's entry (its positions are first positions already)."""
    from kernels import rope

    _jit_source_mutant(mp, rope, "_kv_finish_row", "p = (p // window) * window", "p = p  # MUTANT")


def kv_finish_ring_slot_shifted(mp: MP) -> None:
    """The fused KV finish kernel writes the decode token's KV into ring slot (p + 1) % W instead of p % W
    (issue 27: the ring write inside `_kv_finish_kernel`); the returned row and the reference are right."""
    from kernels import rope

    _jit_source_mutant(mp, rope, "_kv_finish_row", "ring_row = ring_ptr + row * ring_sb + (p % W) * D",
                       "ring_row = ring_ptr + row * ring_sb + ((p + 1) % W) * D  # MUTANT")


def multi_turn_prefix_unchecked(mp: MP) -> None:
    """A new turn continues the previous turn's state whenever it belongs to the model, without checking that
    the new prompt's ids extend the state's ids (the format's rewrite of earlier turns, e.g. the reasoning dropped
    by drop_thinking, goes unseen: the new tokens are appended to a context the prompt no longer has)."""
    from dsv4 import generate

    _source_mutant(mp, generate, "reuse_plan", "    if common < len(old):", "    if False:  # MUTANT")


# ------------------------------------------------------------------------------------------- ragged batches (issue 24)
def ragged_row0_position(mp: MP) -> None:
    """The decode step of a ragged batch runs every row at row 0's position (one scalar position for the batch:
    the lockstep assumption); right whenever the rows agree, so every lockstep test passes."""
    from dsv4.state import DecodeState

    _source_mutant(mp, DecodeState, "load_positions", "if len(set(rows)) == 1:", "if True:  # MUTANT: row 0's")


def ragged_commit_row0_boundary(mp: MP) -> None:
    """The compressor's commit (reference decode step) decides from row 0's position whether a window completed,
    for every row: a row whose window ends at another step than row 0's skips its entry (and its reset)."""
    from kernels import compressor

    _source_mutant(mp, compressor, "compress_commit_ref", "done = ((p + 1) % r == 0).view(b, 1, 1)",
                   "done = ((p[:1] + 1) % r == 0).view(1, 1, 1).expand(b, 1, 1)  # MUTANT: row 0's boundary")


def ragged_commit_kernel_row0_boundary(mp: MP) -> None:
    """The compressor commit kernel (triton decode step) reads row 0's position in every program: a ragged row
    commits, shifts and resets its window at row 0's boundary instead of its own."""
    from kernels import compressor

    _jit_source_mutant(mp, compressor, "_compress_commit_kernel", "pos = tl.load(pos_ptr + b)",
                       "pos = tl.load(pos_ptr)  # MUTANT: row 0's position")


def verify_step_compressor_one_position(mp: MP) -> None:
    """The decode step with s tokens per row (a verify step) feeds the KV compressor every token at the call's
    first position (pos instead of pos + j): windows complete at the wrong token and ape is the first slot's; the
    one-token step (j = 0) is right."""
    from dsv4.model import Attention

    _source_mutant(mp, Attention, "step", "pj = pos if j == 0 else pos + j", "pj = pos  # MUTANT")


def verify_step_ring_written_first(mp: MP) -> None:
    """The decode step with s tokens per row writes the call's KV into the window ring BEFORE gathering the keys
    (as the one-token step may): the earlier queries of the call read ring slots the later tokens overwrote."""
    from dsv4.model import Attention

    _source_mutant(mp, Attention, "step", "keys = torch.cat((st.ring, kv)",  # dedented source: 8-space body
                   "st.ring.scatter_(1, (P[:, -min(s, W):] % W)[..., None].expand(b, min(s, W), "
                   "kv.shape[-1]), kv[:, -min(s, W):])  # MUTANT\n        keys = torch.cat((st.ring, kv)")


# ------------------------------------------------------------------------------- speculative decoding (issue 26)
def rollback_keeps_a_rejected_token_window(mp: MP) -> None:
    """The verify step's rollback restores the compressors' partial windows as they were after one token MORE than
    the accepted prefix: the first rejected draft stays in a compressor window (the class of vLLM's MTP accuracy
    drop from a compressor state that kept rejected tokens)."""
    from dsv4.model import Transformer

    _source_mutant(mp, Transformer, "rollback", "trail[k - 1]", "trail[k]")  # MUTANT


def draft_eos_accepted_unverified(mp: MP) -> None:
    """A drafted EOS is accepted without comparing it with the model's token (the class of a draft EOS ending an
    answer the model would have continued)."""
    from dsv4 import speculative

    _source_mutant(mp, speculative, "speculative_greedy_batch", "while a < k and drafts[a] == pred[a]:",
                   "while a < k and (drafts[a] == pred[a] or drafts[a] == eos_id):  # MUTANT")


def speculative_batch_reads_another_rows_logits(mp: MP) -> None:
    """The batch speculative loop accepts row i's drafts against row (i + 1) % b's verify logits (the class of a
    verify logits buffer laid out for (1 + k) x requests rows read across requests); batch 1 is unchanged."""
    from dsv4 import speculative

    _source_mutant(mp, speculative, "_speculate", "emitted[i] = choose(i, logits[i], drafts[i])",
                   "emitted[i] = choose(i, logits[(i + 1) % b], drafts[i])  # MUTANT")


def batch_chat_row_not_loaded(mp: MP) -> None:
    """A batch row continuing a previous turn takes the chat's position but not its buffers (window ring,
    compressor windows, entries): the new ids are appended to an empty context at the right positions."""
    from dsv4.state import DecodeState

    _source_mutant(mp, DecodeState, "load_row", "for dst, s in zip(self.layers, src.layers):",
                   "for dst, s in []:  # MUTANT: buffers not copied")


# ------------------------------------------------------------------------------- torch GEMM row buckets (issue 29)
def bucketed_gemm_rows_after_the_padding(mp: MP) -> None:
    """`kernels.launch.bucketed_gemm` copies the M input rows after the zero padding instead of before it, and
    still returns the first M result rows: above 64 rows every torch GEMM of the triton backend (FP8 prefill
    linear, bf16 mm, grouped bmm, fp32 mm) returns zero-padding rows for its first ones."""
    from kernels import fp32_linear, gemm, launch

    _source_mutant(mp, launch, "bucketed_gemm", "xp[:M] = x2", "xp[Mp - M:] = x2  # MUTANT: rows after the padding")
    for mod in (gemm, fp32_linear):
        mp.setattr(mod, "bucketed_gemm", launch.bucketed_gemm)


# ------------------------------------------------------------------------------- batch-invariant mode (issue 25)
def invariant_split_follows_m(mp: MP) -> None:
    """The batch-invariant fp32 GEMV (`kernels.fp32_linear.fp32_linear(invariant=True)`, BM = INVARIANT_BM) takes a
    split-K count that follows the row count (as a default heuristic sizing the grid by M would): 4x the output
    blocks counted above 8 rows, so batch 1 and batch 33 sum K in another order."""
    from kernels import fp32_linear as kf
    from kernels.launch import interpreting, split_k, workspace

    def _gemv(x, weight, out, M, N, K, dot, block, BM, acc2d, num_warps):
        BN, BK = block
        n_blocks = kf.triton.cdiv(N, BN)
        chunks = kf.triton.cdiv(M, BM)
        grid_blocks = n_blocks * (4 if BM == kf.INVARIANT_BM and M > 8 else 1)  # MUTANT
        split, per = split_k(x.device, grid_blocks, kf.triton.cdiv(K, BK))
        sem, part = workspace(x.device, n_blocks * chunks if split > 1 else 1, split * M * N if split > 1 else 1)
        kf._bf16w_gemv_kernel[(n_blocks * chunks, split)](x, weight, out, part, sem, M, N, K, per * BK, split, chunks,
                                                 BM=BM, BN=BN, BK=BK, DOT=dot, EVEN_K=K % BK == 0, ACC2D=acc2d,
                                                 MMA=0 if interpreting() else 1, num_warps=num_warps)

    mp.setattr(kf, "_gemv", _gemv)


def fp8_gemv_rows_act_scale_dropped(mp: MP) -> None:
    """The one-row FP8 GEMV (`_fp8_gemv_rows_kernel`, batch-1 decode) quantizes x per 128 block but never applies
    the block's act_quant scale 2^k (the e4m3 codes summed as if every scale were 1); the split-K kernel and the
    references keep it."""
    from kernels import gemm

    _jit_source_mutant(mp, gemm, "_fp8_gemv_rows_kernel", "sw = sw * sx",
                       "sw = sw * 1.0  # MUTANT: act scale dropped")


def moe_gemv_block_scale_misaligned(mp: MP) -> None:
    """The MoE decode kernels' code-value products (`_fp4_gemv_codes`) scale every 32-input group of a K chunk by
    the chunk's largest act_quant block scale instead of its own block's (the in-register act_quant's scales
    misaligned with the groups); the fp16 route, the tile path and the references are right."""
    from kernels import moe

    _jit_source_mutant(mp, moe, "_fp4_gemv_codes",
                       "sxg = tl.reshape(tl.broadcast_to(sx[:, None], (BKH // 64, 4)), (BKH // 16,))",
                       "sxg = tl.reshape(tl.broadcast_to(tl.max(sx, axis=0) + 0.0 * sx[:, None], (BKH // 64, 4)),"
                       " (BKH // 16,))  # MUTANT")


def hc_fused_norm_unweighted(mp: MP) -> None:
    """The one-launch mHC kernels' fused site RMSNorm (`_finish_tokens` NORM: hc_pre / hc_post_pre with
    `one_launch=True`, not the default since the fifth session of 2026-12-06) forgets the norm weight:
    x * rsqrt(mean(x^2) + eps) instead of weight * x * rsqrt(...) (the rms_norm kernel and the references are
    right)."""
    from kernels import mhc

    _jit_source_mutant(mp, mhc, "_finish_tokens", "cast_for_store((w[None, :] * xv) * rinv[:, None], x_ptr)",
                       "cast_for_store((xv + 0.0 * w[None, :]) * rinv[:, None], x_ptr)")


def swiglu_gemv_v_scale_row_of_u(mp: MP) -> None:
    """The shared expert's one-launch projection + SwiGLU (`_fp8_gemv_rows_kernel` SWIGLU) scales the v rows (w3)
    by the u rows' (w1) ue8m0 block row: the two halves of the joint weight share one scale row; the two-launch
    path and the references are right."""
    from kernels import gemm

    _jit_source_mutant(mp, gemm, "_fp8_gemv_rows_kernel", "srow2 = (N + pid * BN) // 128",
                       "srow2 = (g * N + pid * BN) // 128")


def moe_combine_shared_row0(mp: MP) -> None:
    """The MoE slot sum's shared-expert add (`_sum_slots_kernel` HAS_SHARED: `moe_combine` and the routed +
    shared one-launch path `moe_routed_combine`) reads token 0's shared row for every token; the references are
    right (a batch of one cannot see it)."""
    from kernels import moe

    _jit_source_mutant(mp, moe, "_sum_slots_kernel", "acc += tl.load(s_ptr + t * D + offs",
                       "acc += tl.load(s_ptr + 0 * t * D + offs")


def moe_tiles_odd_inputs_interleaved(mp: MP) -> None:
    """The MoE down tile kernel (prefill path) reads a chunk's odd inputs of h at the natural layout's place (the
    next element) instead of the halves layout's (I / 2 further, `kernels.quant.halves`); the up kernel, the gemv
    path and the references are right."""
    from kernels import moe

    _jit_source_mutant(mp, moe, "_moe_down_tile_kernel", "tl.load(hp), tl.load(hp + KH)",
                       "tl.load(hp), tl.load(hp + 1)")


def compress_pool_rows_at_width(mp: MP) -> None:
    """The compressor pooling kernel (graph decode) reads the token's wkv / wgate rows at the width W instead of
    their row stride: right for contiguous rows, another row's (or a half's) values for the halves of the joint
    wkv | wgate projection at batch > 1 (issue 27); the reference reads the views."""
    from kernels import compressor

    _jit_source_mutant(mp, compressor, "_compress_pool_kernel", "an = tl.load(a_ptr + b * SA + newcol",
                       "an = tl.load(a_ptr + b * W + newcol")


def qkv_finish_q_rope_dropped(mp: MP) -> None:
    """The one-launch q + KV finish (`kernels.rope._qkv_finish_kernel`) runs the q rows' head RMS without their
    RoPE (the row code's ROPE flag False); `head_rms_rope`, `kv_finish` and the references are right."""
    from kernels import rope

    _jit_source_mutant(mp, rope, "_qkv_finish_kernel", "QRD2, QBD, QBF16, True, QPER_ROW",
                       "QRD2, QBD, QBF16, False, QPER_ROW")


def attn_out_rope_forward(mp: MP) -> None:
    """The attention epilogue's de-rotation of the output's RoPE channels (`kernels.attention._rope_out`: the
    one-launch `sparse_attn_rope`) rotates by +pos instead of -pos; `rope_tail_(inverse=True)` and the
    references are right."""
    from kernels import attention

    _jit_source_mutant(mp, attention, "_rope_out", "sn = (tl.sin(ang).to(tl.float32) * -1.0)[None, :]",
                       "sn = (tl.sin(ang).to(tl.float32) * 1.0)[None, :]")


def indexer_q_rope_unpaired(mp: MP) -> None:
    """The indexer query's RoPE inside the rotation kernel (`_rotate_fp4_kernel` ROPE: the one-launch
    `rope_rotate_fp4`) rotates each element with itself instead of its pair partner (column c ^ 1); `rope_tail_`
    and the references are right."""
    from kernels import indexer

    _jit_source_mutant(mp, indexer, "_rotate_fp4_kernel", "(cols ^ 1)[None, :]", "cols[None, :]")


def indexer_scores_scale_unrounded(mp: MP) -> None:
    """The scoring kernel's head-weight scale (`_score_chunk` SCALED: the one-launch `indexer_scores_scaled`)
    keeps the fp32 product instead of rounding it to bf16 as the model's bf16 multiply does (spec §7.2); the
    two-step path and the references are right."""
    from kernels import indexer

    _jit_source_mutant(mp, indexer, "_score_chunk", "w = round_bf16(w * wscale)", "w = w * wscale")


def topk_key_slot_offset_dropped(mp: MP) -> None:
    """The top-k writing the CSA decode step's key slots (`_topk_row` with OFF: `indexer_topk(offset=)` into the
    attention's index tensor) writes the sorted picks' entry indices without the offset of the entry rows: the
    attention reads window rows for them; the references are right."""
    from kernels import indexer

    _jit_source_mutant(mp, indexer, "_topk_row", "tl.where(slot < kk, idx + OFF, -1)", "tl.where(slot < kk, idx, -1)")


def moe_packed_decode_sign_shift(mp: MP) -> None:
    """The FP4 tile path's packed PTX decode (`kernels.moe.E2M1_BF16X2_PTX`, `_e2m1_bf16x2`: the GPU default
    mma="bf16x2") shifts the low nibbles' sign of bytes 0 / 1 to bit 14 instead of 15 (the element-wise decode and
    the references are right). The interpreter runs no PTX: the CPU emulation of the PTX kills it."""
    from kernels import moe

    old = "shl.b32 s, t0, 12"
    assert moe.E2M1_BF16X2_PTX.count(old) == 1, "the PTX changed; update the mutant"
    mp.setattr(moe, "E2M1_BF16X2_PTX", moe.E2M1_BF16X2_PTX.replace(old, "shl.b32 s, t0, 11"))


def moe_packed_scale_factor_off(mp: MP) -> None:
    """The packed FP4 tile path (mma "bf16x2"; MMA 3 under the interpreter) builds its second scale factor
    2^(max(s, 128) - 128) one binade low, so every weight is halved (the element-wise decode and the references
    are right)."""
    from kernels import moe

    _jit_source_mutant(mp, moe, "_fp4_tile_dot", "(tl.maximum(sq, 128) - 1) << 7", "(tl.maximum(sq, 128) - 2) << 7")


def moe_gemv_codes_scales_reversed(mp: MP) -> None:
    """The MoE decode kernels, fed act_quant's codes and scales (QUANT 2: what `moe_experts` launches above
    GEMV_QUANT_MAX_T tokens), read the act_quant block scales of a K chunk in reverse order (`_gemv_chunk_input`:
    each 128-input block scaled by another block's 2^k); the in-kernel quantization, the fp16 route and the
    references are right."""
    from kernels import moe

    _jit_source_mutant(mp, moe, "_gemv_chunk_input",
                       "sx = tl.load(s_ptr + s_row + kh0 // 64 + tl.arange(0, BKH // 64))",
                       "sx = tl.load(s_ptr + s_row + kh0 // 64 + (BKH // 64 - 1 - tl.arange(0, BKH // 64)))  # MUTANT")


def moe_gemv_packed_nibbles_swapped(mp: MP) -> None:
    """The MoE decode kernels' code-value products (`_fp4_gemv_codes`) with the packed nibble decode (bf16 lanes:
    DEC 2 on a GPU, its twin DEC 3 under the interpreter; fp16 lanes: DEC 4, its stand-in DEC 5) take the high
    nibble as the even input; the element-wise decode (mma "bf16"), the tile path and the references keep the
    on-disk order."""
    from kernels import moe

    src = ("lo16, hi16 = _e2m1_bf16x2(b8)", "lo, hi = _e2m1_bf16x2_twin(b8)", "lo16, hi16 = _e2m1_f16x2(b8)",
           "hi = _e2m1(b5, True)", "lo = _e2m1(b5, False)")
    dst = ("hi16, lo16 = _e2m1_bf16x2(b8)", "hi, lo = _e2m1_bf16x2_twin(b8)", "hi16, lo16 = _e2m1_f16x2(b8)",
           "hi = _e2m1(b5, False)", "lo = _e2m1(b5, True)")
    for old, new in zip(src, dst):  # every packed flavour (bf16 / fp16 lanes: GEMV_PACKED_F16) and its stand-in
        _jit_source_mutant(mp, moe, "_fp4_gemv_codes", old, new + "  # MUTANT: nibbles swapped")


def moe_gemv_shapes_ignored(mp: MP) -> None:
    """`moe_experts`' gemv path launches both decode kernels with `moe_config`'s one shape, not the measured
    per-kernel shapes of `gemv_shapes` (a tuned launch choice silently not applied: the same values, slower)."""
    from kernels import moe

    _source_mutant(mp, moe, "moe_experts", "else gemv_shapes(T, D, I, mma)", "else (cfg, cfg)  # MUTANT")


def moe_gemv_stages_ignored(mp: MP) -> None:
    """The MoE up decode launcher drops its config's K-loop pipeline stages (`MoeConfig.num_stages`: 2 in the
    measured GEMV_SHAPES) and launches the loop unpipelined (a tuned launch choice silently not applied: the same
    values, slower)."""
    from kernels import moe

    _source_mutant(mp, moe, "moe_up_gemv", "STAGES=cfg.num_stages", "STAGES=1")


def sparse_decode_dv_warps_ignored(mp: MP) -> None:
    """The "heads" sparse decode launcher runs its column-split programs at 4 warps instead of DECODE_DV_WARPS
    (the measured choice silently not applied: the same values, slower)."""
    from kernels import attention

    _source_mutant(mp, attention, "sparse_attn", "num_warps or (DECODE_DV_WARPS if few else None)",
                   "num_warps or (4 if few else None)  # MUTANT")


def sparse_decode_min_split_ignored(mp: MP) -> None:
    """The "heads" sparse decode launcher's default split count ignores `decode_min_split_tiles` (the one-wave rule
    alone: splits whose partials outweigh their keys - the same values within the split-merge rounding, slower)."""
    from kernels import attention

    _source_mutant(mp, attention, "sparse_attn",
                   "n_tiles // decode_min_split_tiles(block_h, dv, hd, block_n, kv.element_size())",
                   "n_tiles // 1")  # MUTANT


def sparse_heads_queries_share_indices(mp: MP) -> None:
    """The all-heads sparse attention kernel (`_sparse_decode_kernel`, the default for >= 64 heads at every s)
    reads every query of a row through the first query's index row (the query offset dropped from the index base):
    invisible at s = 1 (decode), wrong for every later query of a prefill or append."""
    from kernels import attention

    _jit_source_mutant(mp, attention, "_sparse_decode_kernel", "ibase = IDX + b * sib + t * sis",
                       "ibase = IDX + b * sib  # MUTANT: t dropped")


def fp8_decode_tiles_ignored(mp: MP) -> None:
    """`fp8_linear`'s decode path never takes the 64-row tiles (DECODE_TILES_MIN_M silently not applied: the GEMV at
    every decode row count - the same values within the summation order, slower from batch 16 up)."""
    from kernels import gemm

    _source_mutant(mp, gemm, "fp8_linear", "gemv is None and M >= DECODE_TILES_MIN_M",
                   "gemv is None and M > GEMV_MAX_M")  # MUTANT
