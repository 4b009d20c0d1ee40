"""Backends: which implementation of the hot paths the model runs (spec §4, §5, §7, §9).

`reference` = the plain-torch `*_ref` functions beside each kernel in `kernels/` (the executable spec).
`triton` = the Triton launchers of the same modules. The choice is explicit and checked: asking for the
triton backend where it cannot run (no CUDA device and no `TRITON_INTERPRET=1`, or triton not installed) is
an error, never a silent fallback to the reference.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch

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


def get_backend(name: str, device: torch.device) -> Backend:
    """Backend `name` for tensors on `device`.

    Raises:
        ValueError: unknown name, or "triton" on a non-CUDA device without TRITON_INTERPRET=1.
        ImportError: "triton" requested and the triton package is missing.
    """
    from kernels import attention, indexer, mhc

    if name == "reference":
        return Backend("reference", mhc.hc_pre_ref, mhc.hc_post_ref, mhc.hc_head_ref,
                       attention.sparse_attn_ref, indexer.indexer_scores_ref,
                       indexer_topk=None, hc_post_pre=mhc.hc_post_pre_ref)
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ImportError("backend 'triton' requested but the triton package is not installed "
                              "(pip install 'dsv4[triton]')")
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        if device.type != "cuda" and not interp:
            raise ValueError(f"backend 'triton' needs a CUDA device (got {device}); on CPU it runs only under "
                             "TRITON_INTERPRET=1. Use backend='reference' explicitly instead.")
        return Backend("triton", mhc.hc_pre, mhc.hc_post, mhc.hc_head, attention.sparse_attn,
                       indexer.indexer_scores, indexer_topk=indexer.indexer_topk, hc_post_pre=mhc.hc_post_pre)
    raise ValueError(f"backend={name!r}: expected one of {BACKENDS}")
