"""Decode state of the reference model (spec §6): what a sequence carries between `Transformer.forward` calls.

Plain dataclasses (no model code): `dsv4.model` makes them, `dsv4.graph` captures the decode step on them;
`dsv4.model` re-exports the names. Every tensor is preallocated for `max_len` tokens (gpt-fast's `setup_caches`):
the decode step writes into fixed slots at a device position, so the same step runs eagerly and under CUDA-graph
capture. A growable state (`Transformer.new_state(b)` without max_len) is reallocated to a larger max_len
between calls (`Transformer._reserve`), never during a step.
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
    """Per-layer decode state for `max_len` tokens.

    keys `[b, window + n_e, hd]` in the model dtype: the window ring (`ring`, first `window` slots; slot p % window
    holds position p) then the compressed entries (`entries`, n_e = max_len // r slots; entry w pools positions
    w*r .. w*r + r - 1 and exists once position w*r + r - 1 is processed), one tensor so that the attention reads
    both without a concatenation. index_keys `[b, max_len // 4, index_head_dim]` (CSA layers); compressor /
    index_compressor: the partial windows (`CompressorState`). Slots beyond the sequence hold zeros and are never
    read (the attention and the indexer mask them by position)."""

    keys: torch.Tensor
    window: int
    compressor: CompressorState | None = None
    index_keys: torch.Tensor | None = None
    index_compressor: CompressorState | None = None

    @property
    def ring(self) -> torch.Tensor:
        """The window ring `[b, window, hd]` (a view of `keys`)."""
        return self.keys[:, :self.window]

    @property
    def entries(self) -> torch.Tensor | None:
        """The compressed-entry slots `[b, n_e, hd]` (a view of `keys`); None in a sliding-window-only layer."""
        return self.keys[:, self.window:] if self.compressor is not None else None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a decode step writes (CUDA-graph warm-up saves and restores them)."""
        out = [self.keys]
        for c in (self.compressor, self.index_compressor):
            if c is not None:
                out += [c.kv, c.score]
        if self.index_keys is not None:
            out.append(self.index_keys)
        return out


@dataclass
class DecodeState:
    """Everything a sequence carries between calls: `pos` = tokens processed so far, one LayerState per layer,
    `max_len` = the tokens its buffers hold, `growable` = whether `Transformer.forward` may reallocate them to a
    larger max_len (False: a call past max_len raises ValueError). `pos_buf` int64 [1] on the state's device: the
    decode step's position as a device tensor (the step never reads a position from the host).
    `checked_by`: id of the model that last validated this state (`Transformer._check_state`), so a decode step
    does not re-walk every layer's state. `owner`: a weak reference to the model instance the state belongs to
    (set by `new_state`, or by the first model that runs it): another instance, even of the same architecture,
    refuses it (its caches hold that model's keys and values)."""

    layers: list[LayerState]
    pos: int = 0
    max_len: int = 0
    growable: bool = True
    checked_by: int | None = field(default=None, repr=False, compare=False)
    owner: weakref.ref | None = field(default=None, repr=False, compare=False)  # the model it belongs to

    checks_ids_on_device = False  # class attribute: True for a CUDA-graph state (`dsv4.graph`)

    def __post_init__(self) -> None:
        dev = self.layers[0].keys.device if self.layers else "cpu"
        self.pos_buf = torch.zeros(1, dtype=torch.int64, device=dev)  # not a field: not state bytes, not compared

    @property
    def batch(self) -> int:
        return self.layers[0].keys.shape[0]

    def decode_step(self, model, input_ids: torch.Tensor, observer=None) -> torch.Tensor:
        """One decode token per row, eagerly: input_ids [b, 1] (checked by `Transformer.forward`) -> the last
        layer's streams [b, 1, hc, dim]. `dsv4.graph.GraphDecodeState` replays a capture of the same step."""
        self.pos_buf.fill_(self.pos)
        return model.decode_step(input_ids, self.pos_buf, self, observer)


class ResidualObserver(Protocol):
    """Called by `Transformer.forward` after every block with the residual streams H `[b, s, hc, d]`."""

    def __call__(self, layer_id: int, H: torch.Tensor) -> None: ...
