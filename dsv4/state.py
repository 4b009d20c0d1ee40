"""Decode state of the reference model (spec §6): what a sequence carries between `Transformer.forward` calls.

Plain dataclasses (no model code), so that `dsv4.model` (which makes them) and `dsv4.graph` (whose
`GraphDecodeState` is a `DecodeState` held in static buffers) both import them; `dsv4.model` re-exports the names.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = ["CompressorState", "LayerState", "DecodeState", "ResidualObserver"]


@dataclass
class CompressorState:
    """Official compressor buffers (spec §6), fp32. kv/score `[b, c*r, c*d]`; for the overlapping CSA
    compressor slots 0..r-1 hold the previous full window, slots r..2r-1 the current partial window."""

    kv: torch.Tensor
    score: torch.Tensor


@dataclass
class LayerState:
    """Per-layer decode state. ring `[b, window, hd]` (slot p % window holds position p); entries
    `[b, n_entries, hd]` compressed KV; index_keys `[b, n_entries_csa, index_head_dim]`."""

    ring: torch.Tensor
    entries: torch.Tensor | None = None
    compressor: CompressorState | None = None
    index_keys: torch.Tensor | None = None
    index_compressor: CompressorState | None = None


@dataclass
class DecodeState:
    """Everything a sequence carries between calls: `pos` = tokens processed so far, one LayerState per layer.
    `checked_by`: id of the model that last validated this state (`Transformer._check_state`), so a decode step
    does not re-walk every layer's state. `owner`: a weak reference to the model instance the state belongs to
    (set by `new_state`, or by the first model that runs it): another instance, even of the same architecture,
    refuses it (its caches hold that model's keys and values)."""

    layers: list[LayerState]
    pos: int = 0
    checked_by: int | None = field(default=None, repr=False, compare=False)
    owner: weakref.ref | None = field(default=None, repr=False, compare=False)  # the model it belongs to


class ResidualObserver(Protocol):
    """Called by `Transformer.forward` after every block with the residual streams H `[b, s, hc, d]`."""

    def __call__(self, layer_id: int, H: torch.Tensor) -> None: ...
