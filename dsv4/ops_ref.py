"""The reference backend's routed-experts entry (issue 13; `dsv4.backend`): `moe_routed_ref`, the one model-level
reference that still takes a module. Every other reference is a function of tensors beside its kernel in
`kernels/` (`kernels.gemm.linear_ref` / `grouped_linear_ref`, `kernels.norm.rms_norm_ref`,
`kernels.fp32_linear.fp32_linear_ref`; issue 23).

Why the routed experts keep the module (issue 23 item 1a, left open): the reference is the loop over the layer's
`Expert` modules, each running its three `Linear`s through the model backend's `linear` entry, in whatever
resident format each holds (FP4 codes, FP8 codes, a bf16 / fp32 parameter), with the experts another rank holds
(`dsv4.parallel`) as None. A tensor signature would take three per-expert lists of (weight, scale) plus the
SwiGLU limit and the activation blocks, would no longer run the backend's `linear` inside (so the triton backend's
fall-back loop would change maths), and would split the expert's SwiGLU from `Expert.forward` (which the shared
expert keeps, and which two catalogue mutants patch). This module imports no model class: `dsv4.backend` (the
reference table) and `dsv4.fast` (the triton backend's fall-back) import it, and `dsv4.model` re-exports the name.

    moe_routed_ref(moe, x, weights, ids) -> y    routed experts, fp32 sum
"""

from __future__ import annotations

import torch

__all__ = ["moe_routed_ref"]


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
