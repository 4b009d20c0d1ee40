"""Model-level fast paths of the triton backend (issue 13): linears, the grouped wo_a, the routed experts, RMSNorm.

The reference entries beside their kernels (`kernels.gemm.linear_ref`, `kernels.gemm.grouped_linear_ref`,
`kernels.norm.rms_norm_ref`, `kernels.fp32_linear.fp32_linear_ref`; `dsv4.ops_ref.moe_routed_ref`) are the
executable spec; these compute the same maths with kernels, with the same signatures (functions of tensors and
plain numbers; `moe_routed` takes the MoE module, see `dsv4.ops_ref`). Which path runs is decided by the weight's
dtype (its resident format), the arguments and the activation dtype, never by a failure (nothing falls back
silently; every row below is deliberate):

| what | bf16 mode (official numerics) | fp32 mode (exact) |
|---|---|---|
| FP8 linear (weight float8_e4m3fn, act_block > 0, in % 128 == 0) | `kernels.gemm.fp8_linear` (W8A8, ue8m0 blocks) | reference maths (fp32 GEMM) |
| other bf16 linears (weights_proj, dequantized mode) | act quant (if act_block > 0) + bf16 cuBLAS GEMM, fp32 accumulation | reference maths |
| fp32 linears (head, compressor wkv/wgate via `linear(fp32=True)`; router gate via `fp32_linear`), weight held bf16 (weights="quantized"), M <= 64 rows | `kernels.fp32_linear.fp32_linear` (bf16 bytes read once, fp32 products and sum) | same |
| those, weight held bf16, M > 64 (prefill of router / compressor) | exact fp32 upcast of the weight + fp32 cuBLAS `torch.mm` (inside `kernels.fp32_linear.fp32_linear`) | same |
| those, weight held fp32 (weights="dequantized") | reference maths: fp32 in, fp32 GEMM, fp32 out (as officially) | reference maths |
| grouped wo_a, FP8, b*s <= 64 (decode) | `kernels.gemm.fp8_grouped_gemv` (FP8 codes read directly, one launch, no act quant) | reference maths |
| grouped wo_a otherwise | bf16 weight (`kernels.gemm.fp8_dequant`) + bf16 cuBLAS bmm, no act quant | reference maths |
| RMSNorm (every norm) | `kernels.norm.rms_norm` (one launch, same fp32 maths) | `kernels.norm.rms_norm` |
| routed experts (FP4, widths % 128 == 0, all experts on this rank) | `kernels.moe.moe_experts` (grouped, sync-free: CUDA-core GEMV path up to `GEMV_MAX_PAIRS` pairs, bf16 tensor-core tiles above) | reference loop |
| routed experts otherwise (bf16 / dequantized experts, tiny widths, expert parallel) | reference loop (host sync per expert) | reference loop |

Why the bf16 cuBLAS GEMM equals the reference: act-quantized activations (e4m3 code x power of two) and
dequantized FP8 / FP4 weights are exact in bf16, and cuBLAS multiplies bf16 with fp32 accumulation, so the
result equals the reference's fp32 product up to summation order (measured on an H200: 0.0% / 0.05% / 0.12%
of outputs differ by one bf16 rounding at M = 1 / 8 / 1024, K = 4096; benchmarks/RESULTS.md, issue 13).
Narrow widths (test-scale models, in % 128 != 0) quantize activations with `kernels.numerics.act_quant_sim` (as
`linear_ref` does) because the FP8 kernels need 128-channel blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsv4.ops_ref import moe_routed_ref
# the kernels, looked up in their modules at call time (tests spy on them, mutants replace them there)
from kernels import fp32_linear as kfp32
from kernels import gemm as kgemm
from kernels import moe as kmoe
from kernels import norm as knorm
from kernels import numerics
from kernels.fp32_linear import fp32_linear_ref
from kernels.gemm import dequantize_ref, grouped_linear_ref, linear_ref

if TYPE_CHECKING:  # annotations only (never executed): dsv4.model imports this module's table through dsv4.backend
    from dsv4.model import MoE

__all__ = ["linear", "grouped_linear", "moe_routed", "rms_norm", "fp32_linear", "prepare"]

_BLOCK = 128


def _bf16_weight(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """[out, in] bf16 weight: a bf16 weight as it is, FP8 codes dequantized by the Triton kernel (exact), other
    codes by `kernels.gemm.dequantize_ref` (exact)."""
    if weight.dtype == torch.float8_e4m3fn and weight.shape[1] % _BLOCK == 0:
        return kgemm.fp8_dequant(weight, scale)
    return dequantize_ref(weight, scale, torch.bfloat16)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, act_block: int = 0,
           fp32: bool = False) -> torch.Tensor:
    """Triton-backend `Linear.forward` (table in the module docstring), the signature and dtype contract of
    `kernels.gemm.linear_ref`: x [..., in], the weight as held (+ scale), act_block, fp32 -> [..., out] (fp32 for
    fp32 linears, x.dtype otherwise). Raises ValueError from the kernels' argument checks."""
    if fp32:
        return fp32_linear(x, weight)
    if x.dtype != torch.bfloat16:
        return linear_ref(x, weight, scale, act_block)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    k = shape[-1]
    if weight.dtype == torch.float8_e4m3fn and act_block and k % _BLOCK == 0:
        y = kgemm.fp8_linear(x2, weight, scale)
    else:
        if act_block:
            if k % _BLOCK == 0:
                x2 = kgemm.act_quant(x2, sim=True)[0]
            else:
                x2 = numerics.act_quant_sim(x2, act_block)
        y = x2 @ _bf16_weight(weight, scale).T
    return y.view(*shape[:-1], y.shape[-1])


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Triton-backend fp32-compute linear (`fp32_linear_ref` signature): x [..., in] any float dtype, weight
    [out, in] -> [..., out] fp32. A bf16 weight (held as on disk) goes to `kernels.fp32_linear.fp32_linear` (the
    GEMV kernel up to 64 rows, exact upcast + fp32 torch.mm above); an fp32 weight (the dequantized model) to the
    reference maths. x in fp32 / bf16 is read as it is (upcast exactly in the kernel), other dtypes upcast first."""
    if weight.dtype != torch.bfloat16:
        return fp32_linear_ref(x, weight)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.dtype not in (torch.float32, torch.bfloat16):
        x2 = x2.float()
    y = kfp32.fp32_linear(x2.contiguous(), weight)
    return y.view(*shape[:-1], y.shape[-1])


def grouped_linear(o: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton-backend grouped wo_a (`kernels.gemm.grouped_linear_ref` signature): o [b, s, G, i], wo_a as held
    [G*o, i] (+ scale) -> [b, s, G, o] in o.dtype (bf16 bmm, fp32 accumulation; fp32 mode: the reference)."""
    if o.dtype != torch.bfloat16:
        return grouped_linear_ref(o, weight, scale)
    b, s, G, i = o.shape
    n = weight.shape[0] // G
    if weight.dtype == torch.float8_e4m3fn and b * s <= kgemm.GEMV_MAX_M and i % _BLOCK == 0 and n % _BLOCK == 0:
        y = kgemm.fp8_grouped_gemv(o.reshape(b * s, G * i).contiguous(), weight, scale, G)
        return y.view(b, s, G, n)
    w = _bf16_weight(weight, scale).view(G, -1, i)                       # [G, o, i]
    z = torch.bmm(o.reshape(b * s, G, i).transpose(0, 1), w.transpose(1, 2))  # [G, b*s, o]
    return z.transpose(0, 1).reshape(b, s, G, -1)


def _stackable(moe: MoE) -> bool:
    """The grouped FP4 kernel applies: every expert on this rank, stored FP4, widths multiples of 128, bf16."""
    ex = list(moe.experts)
    if not ex or any(e is None for e in ex):
        return False
    e0 = ex[0]
    return (e0.w1.fmt == "fp4" and e0.w1.sim.enabled and e0.w1.codes.shape[1] * 2 % _BLOCK == 0
            and e0.w2.codes.shape[1] * 2 % _BLOCK == 0)


def prepare(moes) -> None:
    """The triton backend's `prepare` (`Transformer.__init__` passes the model's MoE modules): stack each
    MoE's FP4 routed experts once (`kernels.moe.stack_experts`, rebinding the experts' buffers to views, so memory
    is unchanged and `load_weights` writes through) where the grouped kernel applies."""
    for m in moes:
        if _stackable(m):
            m.stacked = kmoe.stack_experts(m.experts)


def moe_routed(moe: MoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Triton-backend routed experts: x [N, dim], weights / ids [N, k] -> [N, dim] fp32 (table above). The
    grouped path reads no value back to the host (CUDA-graph capturable)."""
    stacked = getattr(moe, "stacked", None)
    if stacked is None or x.dtype != torch.bfloat16:
        return moe_routed_ref(moe, x, weights, ids)
    return kmoe.moe_experts(x.contiguous(), weights.contiguous(), ids.contiguous(), stacked, moe.experts[0].limit)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton-backend `RMSNorm.forward` (`kernels.norm.rms_norm_ref` signature): `kernels.norm.rms_norm` (one
    launch) on x [..., dim] bf16 / fp32 in any layout (made contiguous), weight [dim] fp32, eps > 0; the same fp32
    maths as the reference up to the order of the sum of squares; x.dtype out. Raises ValueError as the kernel."""
    return knorm.rms_norm(x.contiguous(), weight, eps)
