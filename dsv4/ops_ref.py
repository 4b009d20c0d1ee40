"""The reference backend's model-level entries (issue 13; `dsv4.backend`): the maths every `Linear`, `RMSNorm`, router
`Gate` and routed-expert `MoE` of `dsv4.model` computes with the reference backend. They read the module they are
given (its weight in the compute dtype, its quantization simulation) and nothing else, so this module imports no
model class: `dsv4.backend` (the reference table) and `dsv4.fast` (the triton backend's fall-backs) import it, and
`dsv4.model` re-exports the names. Signatures (spec sections in each docstring):

    linear_ref(lin, x) -> y                      every `Linear.forward`
    grouped_linear_ref(o, lin) -> z              the grouped `wo_a`
    moe_routed_ref(moe, x, weights, ids) -> y    routed experts, fp32 sum
    rms_norm_ref(norm, x) -> y                   every `RMSNorm.forward`
    fp32_linear_ref(x, weight) -> y fp32         `kernels.fp32_linear.fp32_linear_ref` (router, head, compressor)
"""

from __future__ import annotations

import torch

from kernels.fp32_linear import fp32_linear_ref

__all__ = ["linear_ref", "grouped_linear_ref", "moe_routed_ref", "rms_norm_ref", "fp32_linear_ref"]


def rms_norm_ref(norm, x: torch.Tensor) -> torch.Tensor:
    """The reference RMSNorm maths (the `rms_norm` entry of the reference backend; spec §2): x [..., dim] ->
    weight * x * rsqrt(mean(x^2) + eps) in fp32, returned in x.dtype."""
    xf = x.float()
    return (norm.weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)


def linear_ref(lin, x: torch.Tensor) -> torch.Tensor:
    """The reference `Linear` maths (the `linear` entry of the reference backend): x [..., in] -> [..., out].
    fp32 linears: fp32 in, fp32 out. Otherwise FP8 activation quantization first when `lin.quantized` (bf16
    mode), fp32 GEMM on the dequantized weight, output in x.dtype (spec §2)."""
    if lin.fp32:
        return fp32_linear_ref(x, lin.dequantized_weight())
    w = lin.dequantized_weight()
    if lin.quantized:
        x = lin.sim.act(x)
    return (x.float() @ w.float().T).to(x.dtype)


def grouped_linear_ref(o: torch.Tensor, lin) -> torch.Tensor:
    """Grouped `wo_a` (spec §5; the `grouped_linear` entry of the reference backend): o [b, s, G, i] in the
    activation dtype, lin.weight [G*o, i] -> [b, s, G, o] in o.dtype; fp32 products, no activation
    quantization (wo_a is used dequantized in bf16 as officially, pitfall 17)."""
    wa = lin.dequantized_weight().view(o.shape[2], -1, o.shape[-1])
    return torch.einsum("bsgi,goi->bsgo", o.float(), wa.float()).to(o.dtype)


def moe_routed_ref(moe, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Routed experts (spec §8.5-6; the `moe_routed` entry of the reference backend): x [N, dim], weights / ids
    [N, k] from the gate -> y [N, dim] fp32 = sum over slots of g * expert(x). Loops over the experts present
    (one host sync per expert: readable, not fast); experts held by another rank (None) are skipped."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        if moe.experts[e] is None:  # held by another rank (dsv4.parallel)
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        y.index_add_(0, tok, moe.experts[e](x[tok], weights[tok, slot, None]).float())
    return y
