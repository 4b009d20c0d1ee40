"""The DeepSeek-V4 reference model: plain PyTorch, official tensor names, explicit decode state.

Reads side by side with the official `inference/model.py` (reference spec §3-§9). Module and parameter
names are the official ones, so `Transformer.load_state_dict(load_checkpoint(...)[1])` loads an official
checkpoint without a rename map. Dimension legend: `dsv4/config.py`.

Numerics (`dtype` argument of `Transformer`):
  * ``torch.float32`` - every op in fp32 and no quantization simulation: the mode tests compare against
    transformers' DeepseekV4 and against itself (prefill == decode).
  * ``torch.bfloat16`` - the official numerics where the spec describes them (§2): residual streams and
    activations in bf16, RMSNorm / mHC / router / compressor / head in fp32, FP8 activation quantization
    (128-channel ue8m0 blocks) before every FP8/FP4 linear, FP8 rounding of the KV nope channels,
    Hadamard + FP4 rounding of indexer queries and keys.

The hot paths (mHC pre/post/head, sparse attention, indexer scoring) go through a `Backend`
(`dsv4/backend.py`): the reference backend is the `*_ref` maths in `kernels/`, the triton backend their
kernels. Top-k selection follows one rule in prefill and decode (`kernels.indexer.indexer_topk_ref`; the
triton backend's `indexer_topk` returns the same picks bitwise, tested). A backend whose `hc_post_pre_max_t` is set
defers, at decode sizes, each hc_post into the next site's hc_pre (`Block.forward_deferred`: one launch per layer
boundary when its `hc_post_pre` runs the fused kernel); neither backend sets it by default (0: the separate
launches were measured faster, `kernels.mhc`).

Decode state (`DecodeState`, made by `Transformer.new_state(batch, max_len)`, `dsv4/state.py`) holds, per layer,
preallocated for max_len tokens: the window ring and the compressed-entry slots (one tensor), the compressor
buffers (with the CSA overlap window) and the indexer keys. A new state is made for every sequence; the official
code does not reset its buffers (spec §6), we never reuse them. Calls: any number of tokens appended at the
state's position (`Attention.extend`: the prefill, a chunk of a long prompt, a chat's next turn, a verify step; the
official code takes one prefill, then one token per call), and one token per row through THE decode step
(`Transformer.decode_step` -> `Attention.step`, a device position, fixed slots, branch-free), which every backend
runs eagerly and `dsv4/graph.py` captures in a CUDA graph for the triton backend. Any split of a sequence into
calls gives the same logits to fp32 rounding (tests/unit/test_append.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import weakref
from typing import Callable

import torch
from torch import nn

from dsv4 import quant
from dsv4.backend import Backend, get_backend
from dsv4.config import LimitError, ModelArgs, check_has_mtp
from dsv4.formats import check_bf16_exact, check_dequantized_range, check_loaded_values  # the load-time value checks
from dsv4.graph import GraphDecodeState, check_graph_model
# the decode state (`dsv4.state`)
from dsv4.resident import check_weights_mode, hold_on_disk
from dsv4.state import CompressorState, DecodeState, LayerState, ResidualObserver, check_device
from kernels.fp32_linear import fp32_linear_ref  # the router's default (`Gate`), re-exported
from kernels.attention import step_index_offset, window_slots  # the key slots (spec §5.5), re-exported
from kernels.indexer import indexer_topk_ref
# the routed experts' tensor form and the SwiGLU (`kernels.moe`: the reference `moe_routed_ref` beside its kernels)
from kernels.moe import ExpertWeights, StackedExperts, stackable, swiglu
from kernels.numerics import apply_rope  # the RoPE reference (spec §5), beside the number formats
from kernels.router import route_ref  # the router after its logits (spec §8.2-4; `Gate`'s default `route`)

# The reference op table: the prefill's RoPE and quantization roundings run it on every backend (the decode step
# runs the model's backend; both are the same maths, `kernels.rope` / `kernels.quant` are tested against these).
REFERENCE = get_backend("reference", torch.device("cpu"))
STATE_GRAIN = 128  # decode-state max_len granularity: a multiple of every compress ratio (4, 128)
MAX_STEP_TOKENS = 8  # tokens per row one decode step takes (1, or a verify step of up to 8; graph-captured per s)

__all__ = ["STATE_GRAIN", "LOADABLE_DTYPES", "MAX_STEP_TOKENS", "window_slots", "VerifyRecord", "MTPBlock", "Transformer", "check_batch_invariant", "DecodeState", "LayerState", "ResidualObserver", "rope_inv_freq", "apply_rope",
           "check_loaded_values", "check_dequantized_range", "check_bf16_exact", "held_bf16_names",
           "fp32_linear_ref", "hadamard_matrix"]


# ----------------------------------------------------------------------------------------------- numerics
class _Sim:
    """Quantization simulations of the official bf16 path (spec §2); identity in fp32 mode.

    The official kernels need widths that are multiples of the block (128 / 64 / 32); real DeepSeek-V4 widths
    are. A test-scale width smaller than the block is quantized as one group spanning the row; any other
    width raises ValueError (`_block`).

    Also the construction context every module of a `Transformer` is built with: `ops` is the model's backend
    table (`dsv4.backend.Backend`, frozen; `REFERENCE` when not given), from which each module takes its entries
    at construction (`Linear.kernel`, `RMSNorm.kernel`, `Gate.kernel`, `MoE.routed`): nothing rebinds them later.
    """

    def __init__(self, enabled: bool, ops: Backend | None = None):
        self.enabled = enabled
        self.ops = REFERENCE if ops is None else ops
        if enabled:
            self._quant = quant

    @staticmethod
    def _block(x: torch.Tensor, block: int) -> int:
        return _Sim._width_block(x.shape[-1], block)

    @staticmethod
    def _width_block(n: int, block: int) -> int:
        if n % block == 0:
            return block
        if n < block:
            return n
        raise ValueError(f"quantization simulation: width {n} is neither a multiple of nor smaller than "
                         f"the block {block}")

    def act_block(self, x: torch.Tensor) -> int:
        """The block of the FP8 activation quantization before an FP8/FP4 GEMM of x [..., n]: `act_block_of(n)`;
        the `act_block` argument of the backend's `linear`."""
        return self.act_block_of(x.shape[-1])

    def act_block_of(self, n: int) -> int:
        """The FP8 activation-quantization block of an FP8/FP4 GEMM input n wide: 128 (n < 128: n; `_block`),
        0 (none) in fp32 mode. Raises ValueError for a width neither a multiple of nor smaller than 128."""
        return self._width_block(n, 128) if self.enabled else 0

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """FP8 activation quantization (128-channel blocks, ue8m0 scales) before an FP8/FP4 GEMM."""
        block = self.act_block(x)
        return self._quant.act_quant_sim(x, block) if block else x

    def kv_nope_block(self, n: int) -> int:
        """The e4m3 block of the KV nope channels n wide ([F1] QAT): 64 (n < 64: n; `_width_block`), 0 (none) in
        fp32 mode; the `nope_block` of the backend's `kv_finish`."""
        return self._width_block(n, 64) if self.enabled else 0

    def kv_nope(self, x: torch.Tensor, op: Callable | None = None) -> torch.Tensor:
        """[F1] QAT: e4m3 rounding of KV nope channels in 64-channel blocks (`op`: a backend's `act_quant_sim`,
        same maths; default `dsv4.quant.act_quant_sim`)."""
        if not self.enabled:
            return x
        return (op or self._quant.act_quant_sim)(x.contiguous(), self._block(x, 64))

    def fp4(self, x: torch.Tensor, op: Callable | None = None) -> torch.Tensor:
        """FP4 (e2m1) rounding in 32-channel blocks of indexer queries / keys (`op`: a backend's
        `fp4_act_quant_sim`, same maths; default `dsv4.quant.fp4_act_quant_sim`)."""
        if not self.enabled:
            return x
        return (op or self._quant.fp4_act_quant_sim)(x.contiguous(), self._block(x, 32))


class RMSNorm(nn.Module):
    """Weighted RMSNorm: `y = cast_in(w * x_f32 * rsqrt(mean(x_f32^2) + eps))` (spec §2). weight [d] fp32."""

    def __init__(self, dim: int, eps: float, sim: _Sim | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        ops = sim.ops if sim else REFERENCE  # the construction context's backend (`REFERENCE` without one)
        self.kernel: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = ops.rms_norm  # `rms_norm`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] any float dtype -> weight * x * rsqrt(mean(x^2) + eps), computed in fp32, returned in
        x.dtype (spec §2), through the backend's `rms_norm` (reference: `kernels.norm.rms_norm_ref`)."""
        return self.kernel(x, self.weight, self.eps)


class Linear(nn.Module):
    """`y = x @ W^T` with fp32 accumulation, output in x.dtype. weight [out, in].

    `quantized=True` marks a linear stored FP8/FP4 on disk: in bf16 mode its input is FP8-quantized first
    (official act_quant + FP8 GEMM, spec §2). `fp32=True` marks official fp32-compute linears (compressor
    wkv / wgate, head; the router is `Gate`): input and weight in fp32 (a bf16-held weight upcast exactly), output
    fp32.

    Resident format `fmt` (spec §2; set by `hold`, which `Transformer(weights="quantized")` calls):
        None    parameter `weight` [out, in] in `dtype` (fp32 with `fp32=True`): the dequantized model.
        "fp8"   buffers `weight` float8_e4m3fn [out, in] + `scale` float8_e8m0fnu [ceil(out/128), ceil(in/128)]
        "fp4"   buffers `weight` int8 [out, in/2] (two e2m1 codes, low nibble first) + `scale` float8_e8m0fnu
                [out, in/32]
        "bf16"  (`fp32=True` linears only: head, compressor wkv / wgate, BF16 on disk) buffer `weight` bfloat16
                [out, in], computed in fp32 as officially: `dequantized_weight()` is its exact fp32 upcast (a
                temporary), the triton backend reads the bf16 bytes directly (`kernels.fp32_linear`).
    The buffers carry the official names, so the raw checkpoint tensors load without a rename. Whoever needs
    the [out, in] weight in the compute dtype (`forward`, the grouped `wo_a` einsum) calls
    `dequantized_weight()`, which dequantizes the codes per use with `dsv4.quant` (a temporary), so every
    format computes exactly what the dequantized model computes. The stored tensor is `linear.codes`.

    When `sim.resident == "quantized"` (set by `Transformer`) the parameter is created on the meta device, so
    no full-precision copy is ever allocated; `hold` then gives the linear its storage.
    """

    def __init__(self, in_features: int, out_features: int, sim: _Sim, *, quantized: bool, fp32: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.sim, self.quantized, self.fp32 = sim, quantized, fp32
        self.fmt: str | None = None
        self.compute_dtype = torch.float32 if fp32 else dtype
        deferred = getattr(sim, "resident", "dequantized") == "quantized"
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=self.compute_dtype,
                                               device="meta" if deferred else None))
        self.kernel: Callable[..., torch.Tensor] = sim.ops.linear  # the backend's `linear` (`forward`)

    def hold(self, fmt: str | None, device: str | torch.device) -> None:
        """Give a deferred (meta) linear its storage on `device`: `fmt` None -> parameter [out, in] in the
        compute dtype; "fp8" / "fp4" / "bf16" -> the on-disk buffers listed in the class docstring (uninitialised
        until loaded). Raises ValueError for an unknown fmt, an FP4 width not divisible by 32, "bf16" for a linear
        that is not `fp32=True`, or a linear that already holds storage."""
        w = self._parameters.get("weight")
        if self.fmt is not None or w is None or not w.is_meta:
            raise ValueError("Linear.hold: the linear already holds its weight (only a deferred one can be held)")
        out, inp = w.shape
        if fmt is None:
            del self.weight
            self.weight = nn.Parameter(torch.empty(out, inp, dtype=self.compute_dtype, device=device))
            return
        if fmt == "fp8":
            b = quant.FP8_BLOCK
            codes = torch.empty(out, inp, dtype=torch.float8_e4m3fn, device=device)
            scale = torch.empty(-(-out // b), -(-inp // b), dtype=torch.float8_e8m0fnu, device=device)
        elif fmt == "bf16":
            if not self.fp32:
                raise ValueError("Linear.hold('bf16'): only an fp32-compute linear (fp32=True) is held bf16 and "
                                 "computed in fp32; a bf16-compute linear holds its weight with fmt=None")
            del self.weight
            self.register_buffer("weight", torch.empty(out, inp, dtype=torch.bfloat16, device=device))
            self.fmt = fmt
            return
        elif fmt == "fp4":
            if inp % quant.FP4_BLOCK:
                raise ValueError(f"Linear.hold('fp4'): in_features={inp} is not divisible by {quant.FP4_BLOCK}")
            codes = torch.empty(out, inp // 2, dtype=torch.int8, device=device)
            scale = torch.empty(out, inp // quant.FP4_BLOCK, dtype=torch.float8_e8m0fnu, device=device)
        else:
            raise ValueError(f"Linear.hold: fmt={fmt!r}, expected None, 'fp8', 'fp4' or 'bf16'")
        del self.weight
        self.register_buffer("weight", codes)
        self.register_buffer("scale", scale)
        self.fmt = fmt

    @property
    def codes(self) -> torch.Tensor:
        """The stored weight tensor: the on-disk codes in "fp8" / "fp4", the bf16 weight in "bf16", the parameter
        otherwise."""
        return self._buffers["weight"] if self.fmt is not None else self._parameters["weight"]

    @property
    def scales(self) -> torch.Tensor | None:
        """The ue8m0 block scales of the codes (buffer `scale`, float8_e8m0fnu) in "fp8" / "fp4", else None."""
        return self._buffers.get("scale")

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] weight in the compute dtype: the parameter itself, or the codes dequantized now (fp8:
        `quant.fp8_block_dequant`, fp4: `quant.fp4_dequant`; exact in fp32 and bf16; "bf16": the fp32 upcast,
        exact)."""
        if self.fmt is None:
            return self._parameters["weight"]
        if self.fmt == "bf16":
            return self._buffers["weight"].float()
        deq = quant.fp8_block_dequant if self.fmt == "fp8" else quant.fp4_dequant
        return deq(self._buffers["weight"], self._buffers["scale"], out_dtype=self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] (fp32 for `fp32=True`, else x.dtype) through the backend's `linear` (reference:
        `kernels.gemm.linear_ref`) on the weight as held (`codes`, `scales`), FP8 activation quantization first
        when `quantized` in bf16 mode (`_Sim.act_block`)."""
        act_block = self.sim.act_block(x) if self.quantized else 0
        return self.kernel(x, self.codes, self.scales, act_block, self.fp32)


def join_fp8(a: Linear, b: Linear) -> Linear:
    """Hold two FP8 linears that read the same input as ONE weight [a.out + b.out, in] with its ue8m0 scales, and
    rebind a's and b's buffers to its two row ranges (views: no second copy; `Transformer.load_weights` writes
    through them; the state dict keeps the official names). The joint `Linear` computes [a x | b x] in one
    GEMM / GEMV launch (issue 27: "projections that read the same input in one launch"); row n of its output is
    row n of a x (n < a.out) or of b x, the same values. Called once at construction (`Expert.join_w13`,
    `Attention.join_wq_a_wkv`), where the backend holds such pairs joined (`Backend.join_linears`).
    Raises ValueError unless both are held FP8 with equal in_features and a.out % 128 == 0 (no scale block
    straddles the join)."""
    if (a.fmt != "fp8" or b.fmt != "fp8" or a.codes.shape[1] != b.codes.shape[1]
            or a.codes.shape[0] % quant.FP8_BLOCK or a.codes.device != b.codes.device):
        raise ValueError(f"join_fp8: needs two linears held FP8 with equal in_features and the first's out % "
                         f"{quant.FP8_BLOCK} == 0, on one device (got fmt {a.fmt} / {b.fmt}, shapes "
                         f"{tuple(a.codes.shape)} / {tuple(b.codes.shape)})")
    n, d = a.codes.shape
    joint = Linear(d, n + b.codes.shape[0], a.sim, quantized=True, dtype=a.compute_dtype)
    joint.hold("fp8", a.codes.device)
    nb = n // quant.FP8_BLOCK
    joint.codes.copy_(torch.cat((a.codes, b.codes)))
    joint.scales.copy_(torch.cat((a.scales, b.scales)))
    a._buffers["weight"], a._buffers["scale"] = joint.codes[:n], joint.scales[:nb]
    b._buffers["weight"], b._buffers["scale"] = joint.codes[n:], joint.scales[nb:]
    return joint


def join_bf16(a: Linear, b: Linear) -> Linear:
    """`join_fp8` for two fp32-compute linears held bf16 (fmt "bf16": the compressor's wkv and wgate, which read the
    same input): ONE weight [a.out + b.out, in] bf16, a's and b's buffers rebound to its two row ranges (views; the
    state dict keeps the official names). The joint linear computes [a x | b x] in one fp32 GEMV / GEMM launch
    (issue 27); each output row is the same dot product as a's or b's (`kernels.fp32_linear`: the fp32 sum's
    order may follow the output width, within the fp32 bound of its tests). Raises ValueError unless both are held
    "bf16" with equal in_features on one device, neither already a view of a joint weight."""
    if not isinstance(a, Linear) or not isinstance(b, Linear):
        raise ValueError(f"join_bf16: needs two Linear modules, got {type(a).__name__} / {type(b).__name__}")
    if a.fmt != "bf16" or b.fmt != "bf16" or a.codes.shape[1] != b.codes.shape[1] or a.codes.device != b.codes.device:
        raise ValueError(f"join_bf16: needs two fp32-compute linears held bf16 with equal in_features on one device "
                         f"(got fmt {a.fmt} / {b.fmt}, shapes {tuple(a.codes.shape)} / {tuple(b.codes.shape)}, "
                         f"devices {a.codes.device} / {b.codes.device})")
    if a.codes._base is not None or b.codes._base is not None:
        raise ValueError("join_bf16: a weight is already a view (of a joint weight): joined once only")
    n, d = a.codes.shape
    joint = Linear(d, n + b.codes.shape[0], a.sim, quantized=False, fp32=True)
    joint.hold("bf16", a.codes.device)
    joint.codes.copy_(torch.cat((a.codes, b.codes)))
    a._buffers["weight"], b._buffers["weight"] = joint.codes[:n], joint.codes[n:]
    return joint


def check_batch_invariant(args: ModelArgs, dtype: torch.dtype, weights: str) -> None:
    """What `Transformer(batch_invariant=True)` needs, from the config alone (`load_model` checks it before any
    weight is read): bf16 with weights="quantized" (the fp32 / dequantized linears are cuBLAS GEMMs) and routed
    experts the grouped FP4 kernel takes (expert_dtype "fp4", dim and moe_inter_dim multiples of 128; the
    per-expert loop is not batch invariant). Raises ValueError naming the values (kernels.invariant)."""
    if dtype != torch.bfloat16 or weights != "quantized":
        raise ValueError(f"batch_invariant=True needs dtype=torch.bfloat16 and weights='quantized' (got {dtype}, "
                         f"{weights!r}): the fp32 / dequantized linears are cuBLAS GEMMs (kernels.invariant)")
    if args.expert_dtype != "fp4" or args.dim % 128 or args.moe_inter_dim % 128:
        raise ValueError(f"batch_invariant=True: the routed experts cannot take the grouped FP4 kernel, which "
                         f"needs expert_dtype 'fp4' and dim / moe_inter_dim multiples of 128; this config has "
                         f"expert_dtype {args.expert_dtype!r}, dim {args.dim}, moe_inter_dim {args.moe_inter_dim} "
                         "(kernels.invariant)")


# ----------------------------------------------------------------------------------------------- RoPE
def rope_inv_freq(args: ModelArgs, ratio: int, dim: int | None = None) -> torch.Tensor:
    """Inverse frequencies `f_i`, i < rd/2, fp64 `[rd/2]` for a layer of compress `ratio` (spec §5).

    ratio 0: theta = rope_theta, no YaRN. ratio > 0: theta = compress_rope_theta with the YaRN ramp between
    the correction dims of beta_fast / beta_slow (applied at all positions, never an mscale).
    """
    rd = dim or args.rope_head_dim
    i = torch.arange(0, rd, 2, dtype=torch.float64)
    theta = args.rope_theta if ratio == 0 else args.compress_rope_theta
    freqs = 1.0 / theta ** (i / rd)
    if ratio == 0:
        return freqs

    def corr_dim(rot: float) -> float:
        return rd * math.log(args.original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr_dim(args.beta_fast)), 0)
    high = min(math.ceil(corr_dim(args.beta_slow)), rd - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rd // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return freqs * (1 - ramp) + freqs / args.rope_factor * ramp


def hadamard_matrix(n: int, device=None) -> torch.Tensor:
    """Normalized Sylvester Walsh-Hadamard matrix `H_ij = (-1)^popcount(i&j) / sqrt(n)`, fp32 `[n, n]` (spec §7)."""
    if n & (n - 1):
        raise ValueError(f"Hadamard size {n}: expected a power of two")
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / math.sqrt(n)).to(device)


# ----------------------------------------------------------------------------------------------- state
# ----------------------------------------------------------------------------------------------- attention
class Compressor(nn.Module):
    """KV compressor (spec §6): r = 4 overlapping two-series windows (CSA) or r = 128 (HCA), output width d.

    wkv, wgate `[c*d, dim]` (fp32 compute), ape `[r, c*d]` fp32, norm `[d]`; c = 2 iff r == 4.
    """

    def __init__(self, args: ModelArgs, ratio: int, d: int, sim: _Sim, inv_freq: torch.Tensor, indexer: bool):
        super().__init__()
        self.ratio, self.d, self.overlap, self.sim, self.is_indexer = ratio, d, ratio == 4, sim, indexer
        c = 2 if self.overlap else 1
        self.rd = args.rope_head_dim
        self.wkv = Linear(args.dim, c * d, sim, quantized=False, fp32=True)
        self.wgate = Linear(args.dim, c * d, sim, quantized=False, fp32=True)
        self.ape = nn.Parameter(torch.zeros(ratio, c * d, dtype=torch.float32))
        # wkv and wgate held as one weight (`join_wkv_wgate`): a plain attribute, not a submodule (the state dict
        # keeps the official names)
        self.__dict__["wkvgate"] = None
        self.norm = RMSNorm(d, args.norm_eps, sim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        if indexer:
            self.register_buffer("hadamard", hadamard_matrix(d), persistent=False)

    def join_wkv_wgate(self) -> None:
        """wkv and wgate (both read the block's normed x) as one bf16 weight [2 c d, dim] (`join_bf16`), so the
        decode `step` runs the two projections as one launch and reads the halves in place (issue 27). Called once
        by `Transformer.__init__` where the backend joins (`Backend.join_linears`) and both are held bf16.
        Raises ValueError as `join_bf16`, or when already joined."""
        if self.wkvgate is not None:
            raise ValueError("Compressor.join_wkv_wgate: already joined")
        self.__dict__["wkvgate"] = join_bf16(self.wkv, self.wgate)

    def new_state(self, b: int, device) -> CompressorState:
        """Empty buffers for b sequences: kv zeros and score -inf, fp32 `[b, c*r, c*d]` (`CompressorState`)."""
        c = 2 if self.overlap else 1
        n = c * self.ratio
        return CompressorState(kv=torch.zeros(b, n, c * self.d, device=device),
                               score=torch.full((b, n, c * self.d), -math.inf, device=device))

    def _finish(self, pooled: torch.Tensor, first_pos: torch.Tensor, dtype: torch.dtype, ops: Backend,
                window: int = 1) -> torch.Tensor:
        """pooled [b, n, d] fp32 -> stored entries [b, n, d] in `dtype`: norm, RoPE of the tail at each window's
        first position (first_pos [n] int64, w*r; in the decode step each row's token position [b, 1] with
        window = r: floored to its window's first position), then the indexer's Hadamard + FP4 rounding or the
        FP8 rounding of the nope channels (spec §6.3); norm, RoPE and the roundings through `ops` (the model's
        backend: `kv_finish`, `rotate_fp4`)."""
        if ops.kv_finish is not None:  # cast, norm, RoPE and the nope rounding in one launch (triton)
            nope_block = 0 if self.is_indexer else self.sim.kv_nope_block(self.d - self.rd)
            k = ops.kv_finish(pooled, self.norm.weight, self.norm.eps, first_pos, self.inv_freq, self.rd,
                              nope_block, window, dtype)
            return _rotate_fp4(k, self.hadamard, self.sim, ops) if self.is_indexer else k
        if window > 1:
            first_pos = (first_pos // window) * window
        k = ops.rope_tail(self.norm(pooled.to(dtype)), first_pos, self.inv_freq, self.rd)
        if self.is_indexer:
            return _rotate_fp4(k, self.hadamard, self.sim, ops)
        k[..., :-self.rd] = self.sim.kv_nope(k[..., :-self.rd], ops.act_quant_sim)
        return k

    def extend(self, x: torch.Tensor, p: int, st: CompressorState, out: torch.Tensor, backend: Backend) -> torch.Tensor:
        """Tokens x [b, s, dim] at positions p..p+s-1 (spec §6.1-6.3; the prefill is p = 0): every window completed
        by them is pooled and stored in out[:, w] (out [b, n_e, d], the state's entry slots; w = its index), the
        partial window (and, for CSA, the last full one) stays in `st`. Returns the new entries [b, n, d].

        The window's tokens before p come from `st` (their wkv rows and wgate + ape scores), so any split of a
        sequence into calls pools the same values as one call: entry w pools positions w*r .. w*r + r - 1 (CSA:
        the [d:] halves of window w and the [:d] halves of window w - 1, none for w = 0: the fresh state's zero
        rows with score -inf, weight 0). The entries' RoPE and roundings through `backend` (`_finish`)."""
        b, s, _ = x.shape
        r, d, off = self.ratio, self.d, (self.ratio if self.overlap else 0)
        a, z = self.wkv(x), self.wgate(x)  # fp32 [b, s, c*d]
        z = z + self.ape[torch.arange(p, p + s, device=x.device) % r]
        w0, have = divmod(p, r)  # the current window, and its tokens already in the state
        if have:
            a = torch.cat((st.kv[:, off:off + have], a), 1)
            z = torch.cat((st.score[:, off:off + have], z), 1)
        n = (have + s) // r
        A, Z = a[:, :n * r].unflatten(1, (n, r)), z[:, :n * r].unflatten(1, (n, r))  # [b, n, r, c*d]
        if self.overlap:
            # entry w pools the [:d] halves of window w-1 (the state's previous full window for the first one)
            prevA = torch.cat((st.kv[:, None, :r, :d], A[:, :-1, :, :d]), 1)[:, :n]
            prevZ = torch.cat((st.score[:, None, :r, :d], Z[:, :-1, :, :d]), 1)[:, :n]
            A = torch.cat((prevA, A[..., d:]), 2)
            Z = torch.cat((prevZ, Z[..., d:]), 2)
        if backend.pool_windows is not None:  # the batch-invariant mode's fixed order (kernels.invariant)
            pooled = backend.pool_windows(Z, A)
        else:
            pooled = (Z.softmax(2) * A).sum(2)  # [b, n, d]
        if n >= 1:
            if self.overlap:
                st.kv[:, :r], st.score[:, :r] = a[:, (n - 1) * r:n * r], z[:, (n - 1) * r:n * r]
            st.score[:, off:] = -math.inf  # the current window starts afresh (its kv rows get weight 0)
        rem = have + s - n * r
        if rem:
            st.kv[:, off:off + rem], st.score[:, off:off + rem] = a[:, n * r:], z[:, n * r:]
        new = self._finish(pooled, (w0 + torch.arange(n, device=x.device)) * r, x.dtype, backend)
        out[:, w0:w0 + n] = new
        return new

    def step(self, x: torch.Tensor, pos: torch.Tensor, st: CompressorState, out: torch.Tensor,
             backend: Backend) -> None:
        """One decode token per row x [b, 1, dim] at device positions pos [b] int64 (each row its own; spec §6.2,
        one window at a time): writes the token's (wkv, wgate + ape[pos % r]) row into `st`; in each row where
        (pos + 1) % r == 0 the completed window's entry goes to out[row, pos // r] (out [b, n_e, d], the state's
        entry slots) and that row's window shifts (CSA) / resets. Branch-free: the entry is pooled at every step and committed under a device condition
        (`backend.compress_pool` / `compress_commit`, `kernels.compressor`), so the triton backend reads nothing
        back to the host and the step can be captured in a CUDA graph (the reference backend's
        `compress_commit_ref` reads the positions back once per call to check them: it is never captured). Same maths as `extend` for the same tokens (tested:
        prefill == decode)."""
        r = self.ratio
        if self.wkvgate is not None:  # [wkv x | wgate x] as one linear (`join_wkv_wgate`); halves read in place
            az = self.wkvgate(x)[:, 0]
            a, z = az[:, :az.shape[1] // 2], az[:, az.shape[1] // 2:]
        else:
            a, z = self.wkv(x)[:, 0].contiguous(), self.wgate(x)[:, 0].contiguous()
        pooled = backend.compress_pool(a, z, self.ape, pos, st.kv, st.score, r, self.overlap)
        new = self._finish(pooled, pos.view(-1, 1), x.dtype, backend, window=r)
        backend.compress_commit(new.contiguous(), pos, st.kv, st.score, out, r, self.overlap)


class Indexer(nn.Module):
    """Lightning indexer of CSA layers (spec §7): scores compressed entries, keeps the top-k per query.

    wq_b `[H_I*d_I, q_lora]` (FP8 on disk), weights_proj `[H_I, dim]`, compressor (r = 4, d = d_I).
    """

    def __init__(self, args: ModelArgs, sim: _Sim, inv_freq: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.head_dim, self.topk, self.rd, self.sim = (args.index_n_heads, args.index_head_dim,
                                                                   args.index_topk, args.rope_head_dim, sim)
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, sim, quantized=True, dtype=dtype)
        self.weights_proj = Linear(args.dim, self.n_heads, sim, quantized=False, dtype=dtype)
        self.compressor = Compressor(args, 4, self.head_dim, sim, inv_freq, indexer=True)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("hadamard", hadamard_matrix(self.head_dim), persistent=False)
        self.weight_scale = self.head_dim ** -0.5 * self.n_heads ** -0.5  # spec §7.2

    def reduce_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Identity at world size 1; `dsv4.parallel` sums the head-partial scores over ranks (spec §7.5)."""
        return scores

    def select(self, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor,
               backend: Backend, ops: Backend, k: int, out: torch.Tensor | None = None,
               offset: int = 0) -> torch.Tensor:
        """Top-k entry indices `[b, s, k]` int64 (-1 = empty) of the queries at positions pos int64 (spec §7):
        [s] (every row at the same positions) or [b, s] (each row its own: the decode step).

        x [b, s, dim], qr [b, s, q_lora]; keys [b, n, d_I]: slot w holds entry w where it exists; query t sees
        the (t + 1) // 4 entries completed so far (spec §7.4), slots beyond are never picked. k slots per query,
        -1 where fewer entries exist: `extend` passes min(index_topk, entries visible to its last query), known on
        the host from its positions; the decode step index_topk. No host read (no device sync). Scores and top-k
        through `backend`, the query's RoPE and FP4 rounding through `ops` (the model's backend). out / offset
        (the decode step, a backend with a top-k kernel): the picks are written into out (the entry columns of the
        attention's index tensor) as entry + offset, the key slot the attention reads (`indexer_topk(offset=)`)."""
        b, s, _ = x.shape
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        if self.sim.enabled and ops.rope_rotate_fp4 is not None:  # the two steps below in one launch (triton)
            q = ops.rope_rotate_fp4(q, pos, self.inv_freq, self.rd)
        else:
            q = _rotate_fp4(ops.rope_tail(q, pos, self.inv_freq, self.rd), self.hadamard, self.sim, ops)
        # spec §7.2: times the scale in the activation dtype (one op: fp32 maths, one rounding - the same value as
        # an fp32 product rounded after); inside the scoring launch where the backend has `indexer_scores_scaled`
        w = self.weights_proj(x)
        if backend.indexer_scores_scaled is not None and w.dtype == torch.bfloat16:
            scores = self.reduce_scores(backend.indexer_scores_scaled(q, w, keys, self.weight_scale))
        else:
            scores = self.reduce_scores(backend.indexer_scores(q, w * self.weight_scale, keys))  # [b, s, n] fp32
        # causal entries per query, min((p + 1) // 4, n) (spec §7.4): the top-k counts them from the positions
        topk = backend.indexer_topk or indexer_topk_ref  # one rule everywhere (kernels.indexer; looked up here)
        if out is not None:  # straight into the attention's key slots (the triton top-k kernel)
            return backend.indexer_topk(scores, k, pos.expand(b, s), check=False, ratio=4, out=out, offset=offset)
        return topk(scores, k, pos.expand(b, s), check=False, ratio=4)  # counts in [0, n]: no checking sync


def _rotate_fp4(x: torch.Tensor, h: torch.Tensor, sim: _Sim, ops: Backend) -> torch.Tensor:
    """The indexer's rotation of q / its keys (spec §7.1-7.3): x [..., n] -> FP4-rounded `x @ h.T` in x.dtype:
    `ops.rotate_fp4` (the triton backend's one launch, `kernels.indexer.rotate_fp4`) where the FP4 simulation runs
    (bf16 mode) and the backend has one, else the chain fp32 rotation (`_hadamard`) -> x.dtype -> FP4 rounding."""
    if sim.enabled and ops.rotate_fp4 is not None:
        return ops.rotate_fp4(x)
    return sim.fp4(_hadamard(x.float(), h, ops).to(x.dtype), ops.fp4_act_quant_sim)


def _hadamard(x: torch.Tensor, h: torch.Tensor, ops: Backend) -> torch.Tensor:
    """x [..., n] fp32 times the Hadamard matrix h [n, n] (`hadamard_matrix`): `x @ h.T`, or the backend's
    `hadamard` entry where it has one (the batch-invariant mode's per-row kernel: the same value, an fp32 order that
    does not follow the row count)."""
    if ops.hadamard is not None:
        return ops.hadamard(x)
    return x @ h.T


class Attention(nn.Module):
    """DeepSeek-V4 attention (spec §5): low-rank q, shared K=V head, partial interleaved RoPE, per-head sink,
    sliding window + compressed entries (all for HCA, indexer top-k for CSA), grouped wo_a / wo_b."""

    def __init__(self, args: ModelArgs, layer_id: int, sim: _Sim, dtype: torch.dtype):
        super().__init__()
        self.args, self.sim = args, sim
        self.ratio = args.ratio(layer_id)
        self.n_heads, self.hd, self.rd = args.n_heads, args.head_dim, args.rope_head_dim
        self.window, self.groups = args.window_size, args.o_groups
        self.scale = self.hd ** -0.5
        self.wq_a = Linear(args.dim, args.q_lora_rank, sim, quantized=True, dtype=dtype)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps, sim)
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.hd, sim, quantized=True, dtype=dtype)
        self.wkv = Linear(args.dim, self.hd, sim, quantized=True, dtype=dtype)
        self.kv_norm = RMSNorm(self.hd, args.norm_eps, sim)
        # wo_a is FP8 on disk but used dequantized in bf16 with no activation quantization (spec §5, pitfall 17)
        self.wo_a = Linear(self.n_heads * self.hd // self.groups, self.groups * args.o_lora_rank, sim,
                           quantized=False, dtype=dtype)
        self.wo_b = Linear(self.groups * args.o_lora_rank, args.dim, sim, quantized=True, dtype=dtype)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        inv_freq = rope_inv_freq(args, self.ratio)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.compressor = Compressor(args, self.ratio, self.hd, sim, inv_freq, indexer=False) if self.ratio else None
        self.indexer = Indexer(args, sim, inv_freq, dtype) if self.ratio == 4 else None
        # wq_a and wkv held as one weight (`join_wq_a_wkv`): a plain attribute, not a submodule (the state dict
        # keeps the official names)
        self.__dict__["wqkv_a"] = None

    def join_wq_a_wkv(self) -> None:
        """wq_a and wkv (both read the attn_norm output) as one FP8 weight [q_lora + head_dim, dim] (`join_fp8`:
        they become views of `self.wqkv_a`), so `_qkv` runs them as one launch (issue 27). Called once by
        `Transformer.__init__` where the backend joins (`Backend.join_linears`). Raises ValueError as `join_fp8`,
        or when already joined."""
        if self.wqkv_a is not None:
            raise ValueError("Attention.join_wq_a_wkv: already joined")
        self.__dict__["wqkv_a"] = join_fp8(self.wq_a, self.wkv)

    def new_state(self, b: int, max_len: int, dtype: torch.dtype, device) -> LayerState:
        """Empty decode state of this layer for b sequences of up to max_len tokens (`LayerState`): keys
        `[b, window + max_len // r, head_dim]` zeros in dtype (ring | entry slots), indexer keys
        `[b, max_len // 4, index_head_dim]`, fresh compressor buffers."""
        n_e = max_len // self.ratio if self.ratio else 0
        st = LayerState(keys=torch.zeros(b, self.window + n_e, self.hd, dtype=dtype, device=device),
                        window=self.window)
        if self.compressor is not None:
            st.compressor = self.compressor.new_state(b, device)
        if self.indexer is not None:
            st.index_keys = torch.zeros(b, max_len // 4, self.indexer.head_dim, dtype=dtype, device=device)
            st.index_compressor = self.indexer.compressor.new_state(b, device)
        return st

    def _qkv(self, x: torch.Tensor, pos: torch.Tensor, ops: Backend, ring: torch.Tensor | None = None,
             index: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, ...]:
        """x [b, s, dim] at positions pos [s] -> (qr [b, s, q_lora], q [b, s, h, hd], kv [b, s, hd]): low-rank q
        with the per-head unweighted RMS norm (in the activation dtype as officially: bf16 in bf16 mode; spec
        §5.3), the shared K=V head with the FP8 rounding of its nope channels, both RoPE'd on the last rd
        channels (spec §5.2) through `ops`. ring (the decode step of one token per row): the state's window ring,
        which gets each row's KV at slot pos % W. index = (W, ratio, n_entries) (the decode step of a window-only
        or HCA layer): the backend's `qkv_finish` also returns the step's key slots (`step_index(pos, ...)`) from
        the same launch, as a fourth value (None otherwise: the caller runs `step_index`)."""
        if self.wqkv_a is not None:  # [wq_a x | wkv x] as one linear (`join_wq_a_wkv`); the halves are row-strided
            y = self.wqkv_a(x)
            qa, kva = y[..., :self.q_norm.weight.shape[0]], y[..., self.q_norm.weight.shape[0]:]
        else:
            qa, kva = self.wq_a(x), self.wkv(x)
        qr = self.q_norm(qa)
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.hd))
        if ops.qkv_finish is not None:  # q_finish and kv_finish below in one launch (triton: `kernels.rope.qkv_finish`)
            return qr, *ops.qkv_finish(q, self.args.norm_eps, pos, self.inv_freq, self.rd, kva, self.kv_norm.weight,
                                       self.kv_norm.eps, self.sim.kv_nope_block(self.hd - self.rd), ring=ring,
                                       index=index)
        if ops.q_finish is not None:  # the two steps below in one launch (triton: `kernels.norm.head_rms_rope`)
            q = ops.q_finish(q, self.args.norm_eps, pos, self.inv_freq, self.rd)
        else:
            q = ops.head_rms(q, self.args.norm_eps)  # reference: `kernels.norm.head_rms_ref`, the official chain
            q = ops.rope_tail(q, pos, self.inv_freq, self.rd)
        if ops.kv_finish is not None:  # the three steps below in one launch (triton: `kernels.rope.kv_finish`)
            kv = ops.kv_finish(kva, self.kv_norm.weight, self.kv_norm.eps, pos, self.inv_freq, self.rd,
                               self.sim.kv_nope_block(self.hd - self.rd), ring=ring)
            return qr, q, kv, None
        kv = self.kv_norm(kva)
        kv[..., :-self.rd] = self.sim.kv_nope(kv[..., :-self.rd], ops.act_quant_sim)
        kv = ops.rope_tail(kv, pos, self.inv_freq, self.rd)
        if ring is not None:
            b, W = ring.shape[:2]
            ring.scatter_(1, (pos % W).view(b, 1, 1).expand(b, 1, kv.shape[-1]), kv)
        return qr, q, kv, None

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, pos: torch.Tensor,
                backend: Backend) -> torch.Tensor:
        """The sparse attention over the key slots idx and the de-rotation of its output's RoPE channels (spec
        §5.4), o [b, s, h, hd]: the backend's `sparse_attn` then `rope_tail(inverse=True)`, or both in its one
        `sparse_attn_rope` call (triton: one launch)."""
        if backend.sparse_attn_rope is not None:
            return backend.sparse_attn_rope(q, keys, self.attn_sink, idx, self.scale, pos, self.inv_freq, self.rd)
        o = backend.sparse_attn(q, keys, self.attn_sink, idx, self.scale)  # [b, s, h, hd]
        return backend.rope_tail(o, pos, self.inv_freq, self.rd, inverse=True)

    def _out(self, o: torch.Tensor, pos: torch.Tensor, ops: Backend, backend: Backend) -> torch.Tensor:
        """Attention output o [b, s, h, hd] (RoPE channels de-rotated: `_attend`) -> [b, s, dim]: grouped wo_a
        (the backend's `grouped_linear`; reference `kernels.gemm.grouped_linear_ref`) and wo_b."""
        o = o.flatten(2).unflatten(-1, (self.groups, -1))  # [b, s, G, h/G*hd]
        return self.wo_b(backend.grouped_linear(o, self.wo_a.codes, self.wo_a.scales).flatten(2))

    def extend(self, x: torch.Tensor, p: int, st: LayerState, backend: Backend) -> torch.Tensor:
        """x [b, s, dim] (attn_norm output) at positions p..p+s-1 -> [b, s, dim]: the prefill (p = 0) and any
        later call of s tokens (chunked prefill, a chat's next turn, a verify step). Query t sees positions
        t-W+1..t (those before p from the window ring, the others from this call's KV) and the entries
        w < (t+1) // r (HCA: all of them; CSA: the indexer's top-k of them), including the ones this call
        completes. Writes the ring, the new entries and the compressors' partial windows into `st` (room checked
        by the caller). RoPE, the roundings of q / KV / entries, the q norm and the Hadamard run through
        `backend`, as in the decode step (`step`): the triton backend's one-launch kernels, the same maths as the
        reference's torch ops (kernels.rope, kernels.quant; the launch count per prefill layer, issue 27)."""
        b, s, _ = x.shape
        dev, W = x.device, self.window
        pos = torch.arange(p, p + s, device=dev)
        qr, q, kv, _ = self._qkv(x, pos, backend)
        # keys = [ring (positions p-W..p-1 at slot u % W) | this call's KV | entries]
        idx = window_slots(pos, p, W)[None].expand(b, s, W)
        keys = [st.ring, kv]
        if self.compressor is not None:
            self.compressor.extend(x, p, st.compressor, st.entries, backend)
            n_e = (p + s) // self.ratio  # the entries that exist after this call
            if self.indexer is not None:
                n_i = (p + s) // 4
                self.indexer.compressor.extend(x, p, st.index_compressor, st.index_keys, backend)
                comp = self.indexer.select(x, qr, pos, st.index_keys[:, :n_i], backend, backend,
                                           k=min(self.indexer.topk, n_i))  # the last query sees n_i entries
            else:  # HCA: every completed entry visible to the query, w < (t+1) // r
                w = torch.arange(n_e, device=dev)
                comp = torch.where(w[None, :] < ((pos[:, None] + 1) // self.ratio), w[None, :], -1)
                comp = comp[None].expand(b, s, -1)
            idx = torch.cat((idx, torch.where(comp >= 0, comp + W + s, -1)), -1)
            keys.append(st.entries[:, :n_e])
        keys = torch.cat(keys, 1)
        keep = min(s, W)
        st.ring[:, pos[-keep:] % W] = kv[:, -keep:]  # after the keys are gathered: the ring's old slots are read
        return self._out(self._attend(q, keys, idx, pos, backend), pos, backend, backend)

    def step(self, x: torch.Tensor, pos: torch.Tensor, st: LayerState, backend: Backend) -> torch.Tensor:
        """The decode step: s new tokens per row x [b, s, dim] (attn_norm output; s = 1 for one decode token,
        s <= `MAX_STEP_TOKENS` for a verify step), row i's at positions pos[i] .. pos[i] + s - 1 (pos [b] int64 on
        the device; rows of a ragged batch sit anywhere) -> [b, s, dim], on the state's preallocated slots,
        branch-free and without a host read (so the same step runs eagerly and under CUDA-graph capture,
        `dsv4/graph.py`). Query t sees positions t-W+1..t and the row's entries completed up to t (HCA: all
        w < (t+1) // r; CSA: the indexer's index_topk picks, -1 padded). Same maths as `extend` (tested).

        s = 1: the token's KV goes to ring slot pos % W first, and the attention reads `st.keys` = [ring | entry
        slots] in place (ring slots holding positions <= pos). s > 1: the attention reads [ring before the call |
        the call's KV | entry slots] (the call's tokens would overwrite ring slots its earlier queries still see),
        then the last min(s, W) tokens' KV go to the ring. The compressors take the tokens one at a time
        (`Compressor.step`), so every window boundary inside the call is committed before the attention."""
        b, s = x.shape[:2]
        dev, W = x.device, self.window
        P = pos.view(b, 1) if s == 1 else pos.view(b, 1) + torch.arange(s, device=dev)  # [b, s]: each token's position
        hca = self.compressor is not None and self.indexer is None
        # window-only / HCA: the key slots need no indexer, so the q / KV finish launch computes them too; CSA with
        # a top-k kernel: that launch writes the window slots and the top-k its picks' slots into the same tensor
        into_idx = self.indexer is not None and backend.indexer_topk is not None and backend.qkv_finish is not None
        if self.indexer is None:
            index = (W, self.ratio if hca else 0, st.entries.shape[1] if hca else 0)
        else:
            index = (W, 0, 0, self.indexer.topk) if into_idx else None
        qr, q, kv, idx = self._qkv(x, P, backend, ring=st.ring if s == 1 else None,  # s = 1: KV to ring slot pos % W
                                   index=index)
        comp = None  # the indexer's picks (CSA)
        if self.compressor is not None:
            for j in range(s):  # one token at a time: each window boundary in the call committed in order
                pj = pos if j == 0 else pos + j
                self.compressor.step(x[:, j:j + 1], pj, st.compressor, st.entries, backend)
                if self.indexer is not None:
                    self.indexer.compressor.step(x[:, j:j + 1], pj, st.index_compressor, st.index_keys, backend)
                if st.trail is not None:  # a verify step: the windows after each token, for a rollback
                    st.trail.append([t.clone() for t in st.window_tensors()])
            if self.indexer is not None and into_idx:  # the picks' key slots straight into idx's entry columns
                self.indexer.select(x, qr, P, st.index_keys, backend, backend, k=self.indexer.topk,
                                    out=idx[..., W:], offset=step_index_offset(W, s))
            elif self.indexer is not None:
                comp = self.indexer.select(x, qr, P, st.index_keys, backend, backend, k=self.indexer.topk)
        # the window in position order, then the entries (HCA: all completed ones; CSA: the picks), as key slots
        if idx is None:
            idx = backend.step_index(P, W, comp, self.ratio if hca else 0, st.entries.shape[1] if hca else 0)
        if s == 1:
            keys = st.keys
        else:
            keys = torch.cat((st.ring, kv) + ((st.entries,) if self.compressor is not None else ()), 1)
            keep = min(s, W)  # after the keys are gathered: the ring's old slots are read above
            tail = P[:, -keep:] % W
            st.ring.scatter_(1, tail[..., None].expand(b, keep, kv.shape[-1]), kv[:, -keep:])
        return self._out(self._attend(q, keys, idx, P, backend), P, backend, backend)

    def forward(self, x: torch.Tensor, pos: int | torch.Tensor, st: LayerState, backend: Backend) -> torch.Tensor:
        """x [b, s, dim] (attn_norm output) -> [b, s, dim]: `extend` (pos an int: the first position of the s
        tokens; the prefill is 0) or the decode `step` (pos [b] int64 on x's device, each row's first position;
        s <= MAX_STEP_TOKENS). Updates `st`."""
        return self.extend(x, pos, st, backend) if isinstance(pos, int) else self.step(x, pos, st, backend)


# ----------------------------------------------------------------------------------------------- MoE
class Expert(nn.Module):
    """SwiGLU expert (spec §8.5): w1 gate, w3 up `[inter, dim]`, w2 down `[dim, inter]`; clamps up to
    [-limit, limit] and gate to <= limit when limit > 0; routed weight applied before w2."""

    def __init__(self, dim: int, inter: int, limit: float, sim: _Sim, dtype: torch.dtype):
        super().__init__()
        self.limit = limit
        self.w1 = Linear(dim, inter, sim, quantized=True, dtype=dtype)
        self.w2 = Linear(inter, dim, sim, quantized=True, dtype=dtype)
        self.w3 = Linear(dim, inter, sim, quantized=True, dtype=dtype)
        # w1 and w3 held as one weight (`join_w13`): a plain attribute, not a submodule, so the state dict keeps
        # the official names w1 / w3 (whose buffers become views of it)
        self.__dict__["w13"] = None
        self.swiglu_joint: Callable = sim.ops.swiglu_joint  # the backend's (reference: `swiglu_joint_ref`)
        self.linear_swiglu: Callable | None = sim.ops.linear_swiglu  # both in one (triton), or None

    def join_w13(self) -> None:
        """w1 and w3 as one FP8 weight [2*inter, dim] (`join_fp8`: w1 / w3 become views of `self.w13`), so
        `forward` runs the two projections of x as one launch and the SwiGLU as one more (issue 27). Called once
        by `Transformer.__init__` where the backend joins (`Backend.join_linears`), before loading.
        Raises ValueError as `join_fp8`, or when already joined."""
        if self.w13 is not None:
            raise ValueError("Expert.join_w13: already joined")
        self.__dict__["w13"] = join_fp8(self.w1, self.w3)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """SwiGLU (spec §8.5): x [N, dim] -> w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit) * weight)
        [N, dim] in x.dtype; the clamps only when swiglu_limit > 0; weight [N, 1] fp32 routing weights or None.
        Joined (`join_w13`, no weight): [w1 x | w3 x] as one linear, then the backend's `swiglu_joint` - or both
        as the backend's `linear_swiglu` where it has one (triton: one launch at a decode row)."""
        if self.w13 is not None and weight is None:
            if self.linear_swiglu is not None:
                w13 = self.w13
                act_block = w13.sim.act_block(x) if w13.quantized else 0
                return self.w2(self.linear_swiglu(x, w13.codes, w13.scales, act_block, self.limit))
            return self.w2(self.swiglu_joint(self.w13(x), self.limit))
        h = swiglu(self.w1(x).float(), self.w3(x).float(), self.limit, weight)  # `kernels.moe.swiglu`
        return self.w2(h.to(x.dtype))


class Gate(nn.Module):
    """Router (spec §8.1-4): fp32 logits, sqrtsoftplus scores, top-k of (score + bias) or `tid2eid[token]` on
    hash layers; weights = unbiased scores of the picks, normalised, times route_scale.

    `weight` [E, dim] (BF16 on disk) is held in `held`: torch.float32 (the dequantized model, as officially) or
    torch.bfloat16 (`weights="quantized"`: as on disk); either way the logits are the fp32 product of its exact
    fp32 value (`fp32_linear_ref`; the triton backend's `fp32_linear` reads the bf16 bytes directly). Everything
    after the logits is the backend's `route` (`kernels.router.route_ref`: its rules, the tie rule and the fp64
    scores; the triton backend's `kernels.router.route` is one launch)."""

    def __init__(self, args: ModelArgs, layer_id: int, held: torch.dtype = torch.float32,
                 kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = fp32_linear_ref,
                 route: Callable[..., tuple[torch.Tensor, torch.Tensor]] = route_ref):
        super().__init__()
        if held not in (torch.float32, torch.bfloat16):
            raise ValueError(f"Gate: held={held}, expected torch.float32 or torch.bfloat16")
        self.topk, self.score_func, self.route_scale = args.n_activated_experts, args.score_func, args.route_scale
        # main layers below n_hash_layers; never the MTP block (layer_id = n_layers, spec §10), also when TEST_LAYERS
        # keeps fewer main layers than n_hash_layers
        self.hash = layer_id < min(args.n_hash_layers, args.n_layers)
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim, dtype=held))
        self.kernel = kernel  # the backend's `fp32_linear` (`MoE` passes `sim.ops.fp32_linear`)
        self.route = route  # the backend's `route` (`MoE` passes `sim.ops.route`)
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(args.vocab_size, self.topk, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.zeros(args.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, dim], input_ids [N] -> (weights [N, k] fp32, expert ids [N, k] int64)."""
        logits = self.kernel(x, self.weight)  # fp32 [N, E]
        if self.hash:
            return self.route(logits, None, self.tid2eid[input_ids], self.topk, self.score_func, self.route_scale)
        return self.route(logits, self.bias, None, self.topk, self.score_func, self.route_scale)


def gate_held(sim: _Sim) -> torch.dtype:
    """The router weight's resident dtype: bf16 as on disk under `weights="quantized"`, else fp32 (`Gate`)."""
    return torch.bfloat16 if getattr(sim, "resident", "dequantized") == "quantized" else torch.float32


class MoE(nn.Module):
    """Routed experts + shared expert (spec §8): y = sum_e g_e * expert_e(x) + shared(x), fp32 accumulation.

    The routed experts run through the backend's `moe_routed` (reference: `kernels.moe.moe_routed_ref`), a
    function of tensors: this module hands it the experts' weights as held (`expert_weights`, or the stack
    `stacked` the backend made once, `Transformer.__init__`), the SwiGLU limit and the activation blocks of the
    two GEMM inputs (`_Sim.act_block_of`: 128 / the width below 128 in bf16 mode, 0 in fp32 mode)."""

    def __init__(self, args: ModelArgs, layer_id: int, sim: _Sim, dtype: torch.dtype):
        super().__init__()
        self.gate = Gate(args, layer_id, gate_held(sim), sim.ops.fp32_linear, sim.ops.route)
        self.experts = nn.ModuleList(Expert(args.dim, args.moe_inter_dim, args.swiglu_limit, sim, dtype)
                                     for _ in range(args.n_routed_experts))
        self.shared_experts = Expert(args.dim, args.n_shared_experts * args.moe_inter_dim, args.swiglu_limit,
                                     sim, dtype)
        self.routed: Callable = sim.ops.moe_routed  # the backend's `moe_routed` (reference: `moe_routed_ref`)
        self.init_routed(args, sim)

    def init_routed(self, args: ModelArgs, sim: _Sim) -> None:
        """The plain numbers of the routed call: SwiGLU limit, inter width, the numerics (`_Sim`), the backend's
        `moe_combine`; no stack yet."""
        self.sim, self.limit, self.inter_dim = sim, args.swiglu_limit, args.moe_inter_dim
        self.combine: Callable = sim.ops.moe_combine  # the backend's `moe_combine` (reference: `moe_combine_ref`)
        # both in one call where the backend has it (triton: the slot sum adds the shared output, one launch fewer)
        self.routed_combine: Callable | None = sim.ops.moe_routed_combine
        self.stacked: StackedExperts | None = None  # set once by `Transformer.__init__` where `stackable`

    def expert_weights(self) -> list[ExpertWeights | None]:
        """The routed experts' weights as held (`kernels.moe.ExpertWeights` of each expert's `Linear.codes` /
        `scales`; None for an expert another rank holds)."""
        return [None if e is None else ExpertWeights(e.w1.codes, e.w1.scales, e.w3.codes, e.w3.scales,
                                                     e.w2.codes, e.w2.scales) for e in self.experts]

    def stackable(self) -> bool:
        """The grouped FP4 kernel applies (`kernels.moe.stackable` on the weights: every expert on this rank, held
        FP4, widths multiples of 128) and the activations are bf16 (its only input dtype)."""
        return self.sim.enabled and stackable(self.expert_weights())

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [b, s, dim], input_ids [b, s] (hash routing) -> routed + shared experts [b, s, dim] in x.dtype."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.gate(x, input_ids.reshape(-1))
        experts = self.stacked if self.stacked is not None else self.expert_weights()
        act_blocks = (self.sim.act_block_of(shape[-1]), self.sim.act_block_of(self.inter_dim))
        if self.routed_combine is not None and type(self).reduce_routed is MoE.reduce_routed:
            # the routed sum is final here (no sum over ranks): routed + shared in the backend's one call
            # (`kernels.moe.moe_routed_combine_ref`: moe_combine_ref(moe_routed_ref(...), shared), the same values)
            shared = self.shared_experts(x)
            return self.routed_combine(x, weights, ids, experts, self.limit, act_blocks, shared).view(shape)
        y = self.routed(x, weights, ids, experts, self.limit, act_blocks)  # the backend's `moe_routed`
        # routed + shared in fp32, rounded to x.dtype (the backend's `moe_combine`; reference `moe_combine_ref`)
        return self.combine(self.reduce_routed(y), self.shared_experts(x)).view(shape)

    def reduce_routed(self, y: torch.Tensor) -> torch.Tensor:
        """Identity at world size 1; `dsv4.parallel` sums the expert-parallel partial outputs over ranks."""
        return y


# ----------------------------------------------------------------------------------------------- blocks
class Block(nn.Module):
    """One DeepSeek-V4 block (spec §4): mHC pre -> attn_norm -> attention -> mHC post, then the same for the
    FFN site. hc_{attn,ffn}_fn `[(2+hc)*hc, hc*dim]`, _base `[(2+hc)*hc]`, _scale `[3]`, all fp32."""

    def __init__(self, args: ModelArgs, layer_id: int, sim: _Sim, dtype: torch.dtype):
        super().__init__()
        self.args, self.layer_id = args, layer_id
        self.attn_norm = RMSNorm(args.dim, args.norm_eps, sim)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, sim)
        self.attn = Attention(args, layer_id, sim, dtype)
        self.ffn = MoE(args, layer_id, sim, dtype)
        n, hcd = (2 + args.hc_mult) * args.hc_mult, args.hc_mult * args.dim
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(n, hcd, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(n, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.zeros(3, dtype=torch.float32)))

    def _site(self, H: torch.Tensor, site: str, fn: Callable[[torch.Tensor], torch.Tensor],
              backend: Backend) -> torch.Tensor:
        b, s, hc, d = H.shape
        Hf = H.reshape(b * s, hc, d)
        a = self.args
        x, post, comb = backend.hc_pre(Hf, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                                       getattr(self, f"hc_{site}_scale"), sinkhorn_iters=a.hc_sinkhorn_iters,
                                       hc_eps=a.hc_eps, norm_eps=a.norm_eps, norm=getattr(self, f"{site}_norm"))
        out = fn(x.view(b, s, d)).reshape(b * s, d)
        return backend.hc_post(out, Hf, post, comb).view(b, s, hc, d)

    def forward(self, H: torch.Tensor, pos: int | torch.Tensor, input_ids: torch.Tensor, st: LayerState,
                backend: Backend) -> torch.Tensor:
        """H [b, s, hc, dim] residual streams -> new streams, same shape and dtype. pos: the first position of the call (an int,
        `Attention.extend`) or the
        decode step's device position [1] (`Attention.forward`). Each site: hc_pre with the site's norm module
        (x = attn_norm / ffn_norm of the mHC collapse: `kernels.mhc.hc_pre_ref` calls it; the triton backend runs it as
        one more launch after mix + finish by default, fused only on the mHC one-launch path), the sub-block,
        hc_post."""
        H = self._site(H, "attn", lambda x: self.attn(x, pos, st, backend), backend)
        return self._site(H, "ffn", lambda x: self.ffn(x, input_ids), backend)

    def forward_deferred(self, H: torch.Tensor, pending: tuple | None, pos: int | torch.Tensor, input_ids: torch.Tensor,
                         st: LayerState, backend: Backend) -> tuple[torch.Tensor, tuple]:
        """`forward` with each site's hc_post deferred into the next site's hc_pre (`backend.hc_post_pre`:
        one launch per layer boundary at decode; issue 14). Same maths as `forward`.

        H [b, s, hc, dim] streams still missing the hc_post of `pending` = (a [b*s, dim], post, comb) of the
        previous site (None before the first layer). Returns (H, pending) in the same convention; the caller
        applies the last pending hc_post (`Transformer._layers_deferred`).
        """
        b, s, hc, d = H.shape
        Hf, a = H.reshape(b * s, hc, d), self.args
        kw = dict(sinkhorn_iters=a.hc_sinkhorn_iters, hc_eps=a.hc_eps, norm_eps=a.norm_eps)
        for site, body in (("attn", lambda x: self.attn(x, pos, st, backend)),
                           ("ffn", lambda x: self.ffn(x, input_ids))):
            params = [getattr(self, f"hc_{site}_{p}") for p in ("fn", "base", "scale")]
            if pending is None:
                x, post, comb = backend.hc_pre(Hf, *params, norm=getattr(self, f"{site}_norm"), **kw)
            else:
                Hf, x, post, comb = backend.hc_post_pre(pending[0], Hf, pending[1], pending[2], *params,
                                                        norm=getattr(self, f"{site}_norm"), **kw)
            pending = (body(x.view(b, s, d)).reshape(b * s, d), post, comb)
        return Hf.view(b, s, hc, d), pending


class MTPBlock(Block):
    """The multi-token-prediction block `mtp.K` (spec §10; official `MTPBlock`): a Block at layer_id = n_layers + K
    (its own compress ratio `compress_ratios[layer_id]`, 0 for the released models: sliding window only; a
    non-hash router with bias) plus e_proj, h_proj `[dim, dim]` (FP8 on disk), enorm, hnorm, norm `[dim]` and its
    own hc_head_fn / base / scale. It shares `embed` and `head` with the main model.

    forward: the main model's last streams H [b, s, hc, dim] at positions t (before `hc_head`) and the embedding
    rows e [b, s, dim] of the tokens at t + 1 -> (logits [b, s, V] fp32 for the tokens at t + 2, the block's
    streams [b, s, hc, dim], which feed the next chained draft as its H):
    x = e_proj(enorm(e)) broadcast over the hc streams + h_proj(hnorm(H)); x = Block(x); logits =
    head(norm(hc_head(x))). Its decode state is one LayerState at the main model's positions."""

    def __init__(self, args: ModelArgs, layer_id: int, sim: _Sim, dtype: torch.dtype):
        super().__init__(args, layer_id, sim, dtype)
        self.e_proj = Linear(args.dim, args.dim, sim, quantized=True, dtype=dtype)
        self.h_proj = Linear(args.dim, args.dim, sim, quantized=True, dtype=dtype)
        self.enorm = RMSNorm(args.dim, args.norm_eps, sim)
        self.hnorm = RMSNorm(args.dim, args.norm_eps, sim)
        self.norm = RMSNorm(args.dim, args.norm_eps, sim)
        hc = args.hc_mult
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * args.dim, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32))
        self.hc_head = HcHead(args)

    def predict(self, H: torch.Tensor, e: torch.Tensor, pos: int | torch.Tensor, ids: torch.Tensor, st: LayerState,
                backend: Backend, head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [b, s, V] fp32, streams [b, s, hc, dim]); pos as `Block.forward` (an int: `extend`; a device
        tensor [b]: the decode step), ids [b, s] the tokens at t + 1 (routing input; the router is not hashed)."""
        x = self.e_proj(self.enorm(e)).unsqueeze(2) + self.h_proj(self.hnorm(H))
        x = super().forward(x, pos, ids, st, backend)
        y = self.hc_head(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, backend)
        return head(self.norm(y)), x


class HcHead(nn.Module):
    """Collapse of the hc streams before the final norm (spec §9). Parameterless module (the parameters are
    the official top-level `hc_head_fn/base/scale`) so that hooks can observe its execution."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hc_eps, self.norm_eps = args.hc_eps, args.norm_eps

    def forward(self, H: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                backend: Backend) -> torch.Tensor:
        """H [b, s, hc, dim] -> y [b, s, dim] in H.dtype."""
        b, s, hc, d = H.shape
        y = backend.hc_head(H.reshape(b * s, hc, d), fn, base, scale, hc_eps=self.hc_eps, norm_eps=self.norm_eps)
        return y.view(b, s, d)


def held_bf16_names(model: nn.Module) -> set[str]:
    """State-dict names of the fp32-compute weights held bf16 as on disk (`weights="quantized"`): every `Linear`
    with fmt "bf16" (head, compressor wkv / wgate) and every bf16 `Gate.weight` (the router)."""
    return {f"{n}.weight" for n, m in model.named_modules()
            if (isinstance(m, Linear) and m.fmt == "bf16")
            or (isinstance(m, Gate) and m.weight.dtype == torch.bfloat16)}


# The dtypes `Transformer.load_weights` accepts for a parameter / buffer of a given dtype, apart from on-disk codes
# (float8 / int8 buffers take exactly their own dtype): the dtypes the checkpoint readers return for it
# (`dsv4.checkpoint.load_checkpoint`: F32 / BF16 tensors, FP8 / FP4 weights dequantized to float32 or bfloat16, I64
# tid2eid). Anything else (an int32 norm weight, a float16 or float64 tensor) is refused by name, never cast.
LOADABLE_DTYPES: dict[torch.dtype, tuple[torch.dtype, ...]] = {
    torch.float32: (torch.float32, torch.bfloat16),
    torch.bfloat16: (torch.bfloat16, torch.float32),
    torch.int64: (torch.int64,),
}
_LOADABLE_WHY = {
    torch.float32: "F32 / BF16, or an FP8 / FP4 weight dequantized to float32 or bfloat16",
    torch.bfloat16: "BF16 / F32, or an FP8 / FP4 weight dequantized to bfloat16 or float32",
    torch.int64: "I64 expert ids (tid2eid)",
}


class Transformer(nn.Module):
    """DeepSeek-V4 (spec §3): embed -> hc expansion -> blocks -> hc_head -> final RMSNorm `norm` -> `head`.

    Args:
        args: architecture (`ModelArgs`); `args.n_layers` blocks are built (use `args.with_layers(n)`).
        dtype: torch.float32 (exact mode) or torch.bfloat16 (official numerics); see the module docstring.
        device: where parameters and state live.
        backend: "reference" or "triton" (`dsv4.backend.get_backend`; triton needs CUDA or TRITON_INTERPRET=1).
        mtp: build the MTP blocks `mtp.K` (`MTPBlock`; their tensors are then part of the state dict, loaded
            with `load_checkpoint(..., include_mtp=True)`), the drafter of `dsv4.speculative.MTPDrafter`.
        weights: "dequantized" (every weight a parameter in `dtype`) or "quantized" (every linear that is FP8 /
            FP4 on disk, `wo_a` included, holds its on-disk codes + ue8m0 scales under the official names and
            is dequantized to `dtype` per use; the BF16 fp32-compute weights - head, router, compressor wkv /
            wgate - stay bf16 and are upcast exactly; see `Linear`, `Gate`). Both compute the same logits bit
            for bit with the reference backend.
        batch_invariant: the batch-invariant mode (issue 25; `kernels.invariant`: the guarantee and its limits): a
            row's decode logits bitwise independent of its batch, its neighbours and a verify step's length.
            Needs backend="triton", dtype=torch.bfloat16, weights="quantized" and FP4 experts the grouped
            kernel takes.
    Raises:
        ValueError: unsupported dtype, device (not cpu / cuda / cuda:N / meta, or a CUDA device not visible:
            `dsv4.state.check_device`), backend or weights mode; weights="quantized" for args whose checkpoint
            holds no FP8/FP4 weight (a bf16 checkpoint); batch_invariant=True outside what it covers; mtp=True for
            args without an MTP block (`dsv4.config.NoMTPBlockError`: num_nextn_predict_layers 0).
    """

    def __init__(self, args: ModelArgs, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 backend: str = "reference", weights: str = "dequantized", mtp: bool = False,
                 batch_invariant: bool = False):
        super().__init__()
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype={dtype}: expected torch.float32 or torch.bfloat16")
        check_device(device, allow_meta=True)
        check_weights_mode(weights, args)
        if batch_invariant is True:
            check_batch_invariant(args, dtype, weights)
        self.args, self.dtype, self.weights = args, dtype, weights
        self.backend = get_backend(backend, torch.device(device), batch_invariant=batch_invariant)
        sim = _Sim(dtype == torch.bfloat16, self.backend)  # every module takes its backend entries from it
        sim.resident = weights  # "quantized": linears start on meta, `hold_on_disk` gives them their storage
        with torch.device(device):
            self.embed = self._make_embed(args, dtype)
            self.layers = nn.ModuleList(self._make_block(args, i, sim, dtype) for i in range(args.n_layers))
            self.norm = RMSNorm(args.dim, args.norm_eps, sim)
            self.head = self._make_head(args, sim)
            hc = args.hc_mult
            self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * args.dim, dtype=torch.float32))
            self.hc_head_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
            self.hc_head_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32))
            self.hc_head = HcHead(args)
            # the MTP blocks (spec §10), built only when asked (`mtp.*` is loaded then; plain decoding skips it)
            if mtp:
                check_has_mtp(args, "Transformer(mtp=True): the ModelArgs")
            self.mtp = nn.ModuleList(MTPBlock(args, args.n_layers + k, sim, dtype)
                                     for k in range(args.n_mtp_layers)) if mtp else None
        if weights == "quantized":
            hold_on_disk(self, args, device)
        # once, at construction: a backend with a grouped routed-experts kernel (triton) stacks each layer's FP4
        # experts for it (`kernels.moe.stack_experts`, rebinding the experts' buffers to views of the stack, so
        # memory is unchanged and `load_weights` writes through; after `hold_on_disk`, which gives the experts
        # their storage)
        # projections that read the same input held as one weight where the backend joins them (triton; FP8
        # held, the first's width a multiple of 128): the shared experts' w1 / w3 (`Expert.join_w13`) and the
        # attention's wq_a / wkv (`Attention.join_wq_a_wkv`); bf16 held: the compressors' wkv / wgate
        # (`Compressor.join_wkv_wgate`); one launch each pair (issue 27)
        if self.backend.join_linears:
            def joinable(a: Linear, b: Linear) -> bool:
                return a.fmt == b.fmt == "fp8" and a.codes.shape[0] % quant.FP8_BLOCK == 0

            for m in self.modules():
                if isinstance(m, MoE) and joinable(m.shared_experts.w1, m.shared_experts.w3):
                    m.shared_experts.join_w13()
                elif isinstance(m, Attention) and joinable(m.wq_a, m.wkv):
                    m.join_wq_a_wkv()
                elif isinstance(m, Compressor) and m.wkv.fmt == m.wgate.fmt == "bf16":
                    m.join_wkv_wgate()
        if self.backend.stack_experts is not None:
            for m in self.modules():
                if isinstance(m, MoE) and m.stackable():
                    m.stacked = self.backend.stack_experts(m.experts)
                elif isinstance(m, MoE) and self.backend.batch_invariant:  # its loop is not batch invariant
                    raise ValueError("batch_invariant=True: a MoE's routed experts cannot take the grouped FP4 "
                                     "kernel (needs FP4 experts, widths multiples of 128, every expert on this "
                                     "rank; kernels.invariant)")
        self.decode_graph_max_len: int | None = None  # see `use_decode_graphs`

    # Module factories: `dsv4.parallel.ParallelTransformer` overrides them with the rank's sharded modules.
    def _make_embed(self, args: ModelArgs, dtype: torch.dtype) -> nn.Module:
        return nn.Embedding(args.vocab_size, args.dim, dtype=dtype)

    def _make_block(self, args: ModelArgs, layer_id: int, sim: _Sim, dtype: torch.dtype) -> nn.Module:
        return Block(args, layer_id, sim, dtype)

    def _make_head(self, args: ModelArgs, sim: _Sim) -> nn.Module:
        return Linear(args.dim, args.vocab_size, sim, quantized=False, fp32=True)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load an official-name state dict (from `dsv4.checkpoint.load_checkpoint`; with weights="quantized"
        from `load_checkpoint(..., dequantize=False)`, which adds the `.scale` tensors), casting each
        float32 / bfloat16 tensor to the dtype of its parameter (`LOADABLE_DTYPES`: the dtypes the checkpoint
        readers return; any other dtype, e.g. an int32 or float16 tensor for a norm weight, or an int32 tid2eid,
        is refused, never cast). On-disk codes are never cast: a float8 / int8 tensor
        must meet a buffer of exactly its dtype, and a quantized buffer accepts nothing else; a weight held bf16
        as on disk (head, router, compressor wkv / wgate with weights="quantized") accepts only values exact in
        bf16 (`check_bf16_exact`).
        Raises RuntimeError listing missing / unexpected keys, a shape mismatch, such a dtype mismatch (naming
        the tensor, the dtype given and the dtypes expected), a
        floating / bool / complex tensor for an integer buffer (`tid2eid`: never truncated) or a value
        not exact in bf16 (strict); TypeError naming the key of a value that is not a tensor; ValueError naming the tensor, the
        first bad index and the count when a tensor holds a value
        that is NaN / inf as loaded (NaN or inf given, a finite value that overflows the parameter's dtype in
        the cast, an e4m3 NaN code, a ue8m0 scale byte 0xFF) or a `tid2eid` expert id outside
        0..n_routed_experts-1, or resident codes that dequantize to inf (`check_dequantized_range`): nothing
        non-finite is loaded quietly (`check_loaded_values`; checked once, here, with one or two reductions per
        tensor, never on the forward path). The checkpoint readers check the bytes (naming file and offset);
        this checks the values as loaded, after dequantization and the cast, where valid bytes can still
        overflow."""
        own = self.state_dict()
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise RuntimeError(f"state dict does not match the model (weights={self.weights!r}): missing="
                               f"{missing[:10]}{'...' if len(missing) > 10 else ''} unexpected={unexpected[:10]}"
                               f"{'...' if len(unexpected) > 10 else ''}")
        codes = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8)
        held_bf16 = held_bf16_names(self)
        for k, v in state_dict.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"load_weights: state_dict[{k!r}] is a {type(v).__name__}, expected a torch.Tensor "
                                f"of shape {list(own[k].shape)}")
            if tuple(v.shape) != tuple(own[k].shape):
                raise RuntimeError(f"{k}: shape {tuple(v.shape)} != model {tuple(own[k].shape)}")
            if (v.dtype in codes or own[k].dtype in codes) and v.dtype != own[k].dtype:
                raise RuntimeError(f"{k}: dtype {v.dtype} cannot load into the model's {own[k].dtype} "
                                   f"(weights={self.weights!r}; on-disk codes are never cast)")
            if not own[k].dtype.is_floating_point and (v.dtype.is_floating_point or v.dtype.is_complex
                                                       or v.dtype == torch.bool):
                raise RuntimeError(f"{k}: dtype {v.dtype} cannot load into the model's integer {own[k].dtype} "
                                   "(a cast would truncate a non-integer value, e.g. 1.7 -> 1; give integer ids)")
            want = (own[k].dtype,) if own[k].dtype in codes else LOADABLE_DTYPES.get(own[k].dtype, (own[k].dtype,))
            if v.dtype not in want:  # never cast quietly: an int tensor for a norm weight is a caller's mistake
                raise RuntimeError(f"{k}: dtype {v.dtype} cannot load into the model's {own[k].dtype} (expected "
                                   f"{' or '.join(map(str, want))}: what the checkpoint holds for it, "
                                   f"{_LOADABLE_WHY.get(own[k].dtype, 'as stored')}; another dtype is never cast "
                                   "silently)")
            if k in held_bf16:
                check_bf16_exact(k, v)
        cast = {k: v.to(own[k].dtype) for k, v in state_dict.items()}
        for k, v in cast.items():
            check_loaded_values(k, v, state_dict[k], self.args.n_routed_experts)
            if v.dtype == torch.float8_e8m0fnu and k.endswith(".scale"):  # a resident quantized weight's scale
                w = k[:-len("scale")] + "weight"
                check_dequantized_range(w, cast[w], v)
        self.load_state_dict(cast, strict=True)

    def layer_states(self, batch: int, max_len: int) -> list[LayerState]:
        """Zeroed `LayerState`s of every layer for `batch` sequences of up to `max_len` tokens."""
        return [layer.attn.new_state(batch, max_len, self.dtype, self.device) for layer in self.layers]

    def new_state(self, batch: int = 1, max_len: int | None = None) -> DecodeState:
        """A fresh decode state for `batch` sequences (never reused across sequences), its buffers preallocated
        for `max_len` tokens (a positive multiple of `STATE_GRAIN` = 128); None: growable, reallocated to the
        next multiple of 128 at least twice its size when a call needs more (`_reserve`). After
        `use_decode_graphs(max_len)`: a `dsv4.graph.GraphDecodeState` of that max_len (decode steps replay a
        CUDA graph; max_len here must be None or equal). Raises ValueError for a bad batch / max_len (also, for an
        eager state, one over the model's context rounded up to 128: memory no token could use; the graphs'
        max_len is `use_decode_graphs`' choice)."""
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"batch={batch!r}: expected an int >= 1")
        if max_len is not None and not (isinstance(max_len, int) and not isinstance(max_len, bool) and max_len > 0
                                        and max_len % STATE_GRAIN == 0):
            raise ValueError(f"max_len={max_len!r}: expected None or a positive multiple of {STATE_GRAIN}")
        if self.decode_graph_max_len is not None:
            if max_len not in (None, self.decode_graph_max_len):
                raise ValueError(f"max_len={max_len}: this model decodes through CUDA graphs of max_len="
                                 f"{self.decode_graph_max_len} (use_decode_graphs)")
            return GraphDecodeState(self, batch, self.decode_graph_max_len)
        ctx = -(-self.args.max_context // STATE_GRAIN) * STATE_GRAIN  # the context, rounded up to the grain
        if max_len is not None and max_len > ctx:  # buffers no position could ever reach (`_reserve` refuses them)
            raise ValueError(f"max_len={max_len}: over the model's context of {self.args.max_context} tokens per "
                             f"row; expected at most {ctx}")
        n = max_len or 0
        return DecodeState(self.layer_states(batch, n), max_len=n, growable=max_len is None, owner=weakref.ref(self))

    def _reserve(self, state: DecodeState, n: int) -> None:
        """Make room for n more tokens in every row: a growable state whose furthest row p lacks room for p + n
        is reallocated (contents copied) to max(p + n, 2 * max_len) rounded up to `STATE_GRAIN`; a fixed one
        (a row view of a batch state included) raises ValueError. Raises `LimitError` when p + n exceeds the model's
        context (original_seq_len x rope_factor), whatever the state holds. Row views taken before a reallocation are
        stale (refused by `_check_state`)."""
        p = max(state.row_pos)
        need = p + n
        ctx = self.args.max_context
        if need > ctx:  # past the positions YaRN covers (spec §5.2); the official caches hold max_seq_len
            raise LimitError(f"position {p} + {n} new token(s) needs {need} positions, over the model's context of "
                             f"{ctx} tokens per row (original_seq_len {self.args.original_seq_len} x rope_factor "
                             f"{self.args.rope_factor}); start a new sequence or shorten this one")
        if need <= state.max_len:
            return
        if not state.growable:
            fix = ("a row view cannot grow: grow its batch state (a call on a growable batch state reallocates) and "
                   "take state.row(i) again" if getattr(state, "_parent", None) is not None
                   else "make it with a larger new_state(batch, max_len)")
            raise ValueError(f"decode state holds max_len={state.max_len} tokens; position {p} + {n} "
                             f"new token(s) needs {need} ({fix})")
        new_len = -(-max(need, min(2 * state.max_len, ctx)) // STATE_GRAIN) * STATE_GRAIN  # never far past the context
        grown = self.layer_states(state.batch, new_len)
        for old, new in zip(state.layers, grown):
            if p:  # at position 0 the old buffers hold nothing yet (the fresh zeros of the new ones)
                new.keys[:, :old.keys.shape[1]] = old.keys
                if old.index_keys is not None:
                    new.index_keys[:, :old.index_keys.shape[1]] = old.index_keys
            new.compressor, new.index_compressor = old.compressor, old.index_compressor
        state.layers, state.max_len = grown, new_len

    def _check_state(self, state: DecodeState) -> None:
        """The state has one LayerState per layer of this model, of that layer's kind (compressed / indexed or
        not), window, head dim, dtype and device. ValueError naming the first mismatch. Checked once per
        (state, model) pair: the layer states keep their shapes, dtype and device for the whole sequence."""
        parent = getattr(state, "_parent", None)
        if parent is not None and parent.layers is not state._parent_layers:
            raise ValueError("a stale row view: its batch state was reallocated (grown) after state.row(i) was "
                             "taken; take state.row(i) again")
        if state.checked_by == id(self) and state.owner is not None and state.owner() is self:
            return
        if len(state.layers) != len(self.layers):
            raise ValueError(f"state has {len(state.layers)} layer states, this model has {len(self.layers)} layers "
                             "(a state from another model; make it with this model's new_state())")
        for layer, st in zip(self.layers, state.layers):
            attn, ring = layer.attn, st.ring
            want = (attn.window, attn.hd)
            slots = attn.window + (state.max_len // attn.ratio if attn.ratio else 0)
            if (tuple(ring.shape[1:]) != want or ring.dtype != self.dtype or ring.device != self.device
                    or st.keys.shape[1] != slots
                    or (st.index_keys is not None and st.index_keys.shape[1] != state.max_len // 4)
                    or (st.compressor is None) != (attn.compressor is None)
                    or (st.index_compressor is None) != (attn.indexer is None)):
                raise ValueError(
                    f"state.layers[{layer.layer_id}] does not belong to this model: ring {tuple(ring.shape)} "
                    f"{ring.dtype} on {ring.device}, compressor {st.compressor is not None}, indexer "
                    f"{st.index_compressor is not None}; expected ring [b, {want[0]}, {want[1]}] {self.dtype} on "
                    f"{self.device}, compressor {attn.compressor is not None}, indexer {attn.indexer is not None} "
                    "(make the state with this model's new_state())")
        if state.owner is None:  # a state built by hand: claimed by the first model that runs it
            state.owner = weakref.ref(self)
        elif state.owner() is not self:
            raise ValueError("this DecodeState belongs to another model instance (its window, compressor and indexer "
                             "caches hold that model's keys and values, even where the architecture is the same); "
                             "make the state with this model's new_state()")
        state.checked_by = id(self)

    def use_decode_graphs(self, max_len: int | None) -> None:
        """Decode through CUDA graphs (triton backend, bf16, weights="quantized"; `dsv4/graph.py`): states made
        from now on hold static buffers for `max_len` tokens (a multiple of 128) and replay one captured decode
        step per call. None switches back to eager states. Raises ValueError naming what the model lacks."""
        if max_len is not None:
            check_graph_model(self, max_len)
        self.decode_graph_max_len = max_len

    def final_logits(self, H: torch.Tensor) -> torch.Tensor:
        """Last residual streams H [b, s, hc, dim] -> logits [b, s, V] fp32: head(norm(hc_head(H))) (spec §9).
        The single final path: `forward` calls it, the final-norm check calls it."""
        y = self.hc_head(H, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.backend)
        return self.head(self.norm(y))

    def _defer_hc_post(self, H: torch.Tensor, observer) -> bool:
        """Deferred layer boundaries: T = b*s <= the backend's `hc_post_pre_max_t` (triton:
        `kernels.mhc.POST_PRE_ONE_LAUNCH_MAX_T`, 0 since the separate launches were measured faster; the reference
        0: neither defers by default) and no residual observer (it needs each layer's finished H)."""
        return observer is None and H.shape[0] * H.shape[1] <= self.backend.hc_post_pre_max_t

    def _layers(self, H: torch.Tensor, pos: int | torch.Tensor, input_ids: torch.Tensor, state: DecodeState,
                observer: ResidualObserver | None) -> torch.Tensor:
        """The layer loop (s tokens appended at position pos, an int; decode step: pos [1] on the device): H [b, s, hc, dim] -> the last
        block's streams. Calls of at most `hc_post_pre_max_t` tokens (none by default) without an observer defer each
        hc_post into the next hc_pre (`Block.forward_deferred`, `_defer_hc_post`; the same maths, fp32 sums in another
        order), the others run
        `Block.forward` and report each block's streams to the observer."""
        if not self._defer_hc_post(H, observer):
            for layer, st in zip(self.layers, state.layers):
                H = layer(H, pos, input_ids, st, self.backend)
                if observer is not None:
                    observer(layer.layer_id, H)
            return H
        pending = None
        for layer, st in zip(self.layers, state.layers):
            H, pending = layer.forward_deferred(H, pending, pos, input_ids, st, self.backend)
        b, s, hc, d = H.shape
        a, post, comb = pending
        return self.backend.hc_post(a, H.reshape(b * s, hc, d), post, comb).view(b, s, hc, d)

    def _streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [b, s] -> the hc residual streams [b, s, hc, dim]: embed, copied to every stream (spec §3)."""
        return self.embed(input_ids).unsqueeze(2).repeat(1, 1, self.args.hc_mult, 1)

    def decode_step(self, input_ids: torch.Tensor, pos: torch.Tensor, state: DecodeState,
                    observer: ResidualObserver | None = None) -> torch.Tensor:
        """THE decode step of every backend, eager and CUDA-graph captured alike (`dsv4/graph.py` captures this
        call): input_ids [b, s] int64 (s = 1, or a verify step of s <= MAX_STEP_TOKENS), pos [b] int64 on the
        model's device (each row's position of its first token; rows of a ragged batch differ) -> the last
        block's streams [b, s, hc, dim]. Writes the tokens into `state`'s preallocated slots (room checked by
        the caller, `_reserve`); reads nothing back to the host on the triton backend."""
        return self._layers(self._streams(input_ids), pos, input_ids, state, observer)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, state: DecodeState, *, all_logits: bool = False,
                observer: ResidualObserver | None = None, streams: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids [b, s] int64, row i at positions state.row_pos[i].. -> logits fp32 [b, V] of the last position
        ([b, s, V] with all_logits); with streams=True (logits, H): H the last block's residual streams before
        `hc_head` at every one of the s positions [b, s, hc, dim] (what the MTP block reads, spec §10). Any s >= 1 at any position: the first call of a state is the prefill, a later
        call appends s tokens (`Attention.extend`; s == 1 runs the decode step, `decode_step`). Rows may sit at
        different positions (a ragged batch, issue 24): up to MAX_STEP_TOKENS tokens per row run the one decode
        step with each row's position (a CUDA-graph state replays a capture per s for these s, also when its rows
        agree); more tokens per row, or a row not yet prefilled, run each row's `extend` on its row view
        (`DecodeState.row`).
        Advances every row by s; a growable state is reallocated first if a row lacks room (`_reserve`), a fixed
        one raises ValueError; a call past the model's context (original_seq_len x rope_factor) raises LimitError.

        Raises ValueError for an empty input, a call past a fixed state's max_len, ids outside the vocab (the first
        bad id and its [row, position] named), or a
        state this model did not make (another layer count, layer kind, dtype or device: `zip` over the layers
        would otherwise silently run only the common prefix of them); TypeError for a non-tensor input or a
        non-DecodeState state.
        """
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids: expected a torch.Tensor [b, s] of token ids, got {type(input_ids).__name__}")
        if not isinstance(state, DecodeState):
            raise TypeError(f"state: expected a DecodeState from this model's new_state(), got {type(state).__name__}")
        self._check_state(state)
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids shape {tuple(input_ids.shape)}: expected [b, s] with s >= 1")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids dtype {input_ids.dtype}: expected torch.int64 (or int32) token ids")
        if input_ids.shape[0] != state.layers[0].ring.shape[0]:
            raise ValueError(f"input_ids batch {input_ids.shape[0]} != the state's batch "
                             f"{state.layers[0].ring.shape[0]} (make it with new_state({input_ids.shape[0]}))")
        self._reserve(state, input_ids.shape[1])
        if not (max(state.row_pos) > 0 and state.checks_ids_on_device):  # a graph replay checks them without a sync
            lo, hi = torch.stack(torch.aminmax(input_ids)).tolist()  # one device sync
            if lo < 0 or hi >= self.args.vocab_size:  # the error path: name the first bad id and its place
                bad = (input_ids < 0) | (input_ids >= self.args.vocab_size)
                r, c = bad.nonzero()[0].tolist()
                raise ValueError(f"input_ids outside [0, {self.args.vocab_size}): input_ids[{r}, {c}]="
                                 f"{int(input_ids[r, c])} is the first of {int(bad.sum())} (min {lo}, max {hi})")
        rows, s = state.row_pos, input_ids.shape[1]
        stepped = (s == 1 and max(rows) > 0) or (1 < s <= MAX_STEP_TOKENS and min(rows) > 0 and (
            len(set(rows)) > 1 or state.checks_ids_on_device or state.layers[0].trail is not None))
        if stepped:  # the decode step, each row at its position (a GraphDecodeState replays its capture for s)
            H = state.decode_step(self, input_ids, observer)
        elif len(set(rows)) == 1:  # the prefill, or s tokens appended at the rows' common position (`extend`)
            H = self._layers(self._streams(input_ids), rows[0], input_ids, state, observer)
        else:  # several tokens into rows at different positions: each row's own append, on its row view
            outs = [self(input_ids[i:i + 1], state.row(i), all_logits=all_logits, observer=observer,
                         streams=True) for i in range(state.batch)]
            logits, H = torch.cat([o[0] for o in outs], 0), torch.cat([o[1] for o in outs], 0)
            return (logits, H) if streams else logits
        state.row_pos = [p + s for p in rows]
        logits = self.final_logits(H if all_logits else H[:, -1:].contiguous())
        logits = logits if all_logits else logits[:, -1]
        return (logits, H.clone()) if streams else logits  # a copy: a graph replay reuses its output buffer

    @torch.no_grad()
    def verify(self, input_ids: torch.Tensor, state: DecodeState) -> tuple[torch.Tensor, "VerifyRecord"]:
        """A speculative verify step: input_ids [b, s] (each row's last token then its s - 1 drafts, 2 <= s <=
        MAX_STEP_TOKENS; every row prefilled) through the one decode step (eager, or a graph replay) -> (logits
        [b, s, V] fp32 at every position, the record `rollback` needs). The record holds each layer's window ring
        before the call and its compressors' partial windows after each of the s tokens (fp32 [b, c*r, c*d], a
        few KB a layer per row), so a rollback restores the state of any accepted prefix without recomputing it.
        Raises ValueError as `forward` does, and for s outside 2..MAX_STEP_TOKENS or a row not prefilled. On a
        CUDA-graph state (`dsv4.graph.GraphDecodeState`) the step replays a capture that records the same windows
        into its static outputs (the record refers to them: valid for the one rollback right after this call,
        which the record's staleness check enforces); the rings are cloned on the device before the replay, no
        host sync."""
        if not isinstance(state, DecodeState) or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("verify: expected input_ids [b, s] and a DecodeState")
        s = input_ids.shape[1]
        if not 2 <= s <= MAX_STEP_TOKENS:
            raise ValueError(f"verify: {s} tokens per row; expected 2..{MAX_STEP_TOKENS} (the last token + drafts)")
        if min(state.row_pos) < 1:
            raise ValueError(f"verify: rows at {state.row_pos}; every row must be prefilled first")
        if s > self.args.window_size:
            raise ValueError(f"verify: {s} tokens per row > window_size {self.args.window_size}: the call would "
                             "overwrite ring slots of its own kept tokens, which a rollback cannot restore")
        self._check_state(state)
        self._reserve(state, s)  # a reallocation first: the record holds this state's layers
        rings = [ls.ring.clone() for ls in state.layers]
        pos0 = state.row_pos
        for ls in state.layers:  # recording (a list per layer): `forward` runs the decode step, which fills them
            ls.trail = []
        try:
            logits, H = self(input_ids, state, all_logits=True, streams=True)
            trails = [ls.trail for ls in state.layers]
        finally:
            for ls in state.layers:
                ls.trail = None
        return logits, VerifyRecord(pos0, s, rings, trails, H, state._calls, state._calls[0])

    @torch.no_grad()
    def rollback(self, state: DecodeState, record: "VerifyRecord", keep: list[int]) -> None:
        """Row i of `state` keeps the first keep[i] tokens (1..s) of the verify call `record` describes, as if
        only those had been fed: the ring slots of the rejected positions get back what they held, the
        compressors' partial windows are those after keep[i] tokens, row_pos[i] = pos0[i] + keep[i]. Entries and
        indexer keys that rejected tokens completed stay in their slots, invisible (a query at t sees the entries
        completed by t) and overwritten when their window completes again. Raises ValueError for a keep outside
        1..s or a state that moved since the record."""
        s = record.s
        if not isinstance(keep, (list, tuple)) or len(keep) != state.batch or any(
                isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= s for k in keep):
            raise ValueError(f"rollback: keep={keep!r}; expected a list of {state.batch} ints in 1..{s}")
        if record.calls_of is not state._calls:
            raise ValueError("rollback: the record is another state's (verify and rollback take the same state)")
        if state._calls[0] != record.calls or state.row_pos != [p + s for p in record.pos0]:
            raise ValueError(f"rollback: the state moved since the verify call (now at {state.row_pos}, "
                             f"{state._calls[0] - record.calls} call(s) later); a record is used once, right after "
                             "its verify call")
        W = self.args.window_size
        for i, k in enumerate(keep):
            if k == s:
                continue
            rej = torch.tensor([(record.pos0[i] + j) % W for j in range(k, s)], device=state.pos_buf.device)
            for ls, ring, trail in zip(state.layers, record.rings, record.trails):
                ls.ring[i, rej] = ring[i, rej]  # the ring slots of the rejected positions, as before the call
                for t, saved in zip(ls.window_tensors(), trail[k - 1] if trail else ()):
                    t[i].copy_(saved[i])
        state.row_pos = [p + k for p, k in zip(record.pos0, keep)]


@dataclass
class VerifyRecord:
    """What `Transformer.rollback` needs from a `Transformer.verify` call: each row's position before it (pos0),
    the tokens per row (s), each layer's ring before the call, and per layer the compressors' partial windows
    after each token (`LayerState.window_tensors` clones; empty for a sliding-window-only layer)."""

    pos0: list[int]
    s: int
    rings: list[torch.Tensor]
    trails: list[list[list[torch.Tensor]]]
    streams: torch.Tensor | None = None  # the last block's streams at the s positions [b, s, hc, dim] (MTP input)
    calls_of: list | None = None  # the state's call counter (`DecodeState._calls`, shared with its row views)
    calls: int = 0  # its value right after the verify call

