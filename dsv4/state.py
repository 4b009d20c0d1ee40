"""Decode state of the reference model (spec §6): what a sequence carries between `Transformer.forward` calls.

Plain dataclasses (no model code): `dsv4.model` makes them, `dsv4.graph` captures the decode step on them;
`dsv4.model` re-exports the names. Every tensor is preallocated for `max_len` tokens (gpt-fast's `setup_caches`):
the decode step writes into fixed slots at a device position, so the same step runs eagerly and under CUDA-graph
capture. A growable state (`Transformer.new_state(b)` without max_len) is reallocated to a larger max_len
between calls (`Transformer._reserve`), never during a step.
"""

from __future__ import annotations

import math
import operator
import re
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["CompressorState", "LayerState", "DecodeState", "ResidualObserver", "check_device"]


def check_device(device, what: str = "device", *, allow_meta: bool = False) -> torch.device:
    """The torch device `device` (a str or `torch.device`) names, checked as the CLI's --device is: 'cpu', 'cuda'
    or 'cuda:N' ('meta' too with `allow_meta`: a model without storage, for sizes), and for CUDA a device that is
    visible here. Raises ValueError naming `what`, the value and what was expected (torch's own error for
    device="gpu" names neither the argument nor dsv4's devices)."""
    kinds = "'cpu', 'cuda', 'cuda:N' or 'meta'" if allow_meta else "'cpu', 'cuda' or 'cuda:N'"
    if isinstance(device, torch.device):
        ok = device.type in ("cpu", "cuda") or allow_meta and device.type == "meta"
        dev = device
    elif isinstance(device, str):
        ok = re.fullmatch(r"cpu|cuda(:(0|[1-9][0-9]*))?" + ("|meta" if allow_meta else ""), device) is not None
        dev = torch.device(device) if ok else None
    else:
        raise ValueError(f"{what}={device!r} ({type(device).__name__}): expected a torch device: {kinds}")
    if not ok:
        raise ValueError(f"{what}={device!r}: not a torch device dsv4 runs on (expected {kinds})")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{what}={device!r}: no CUDA device is visible on this machine (use 'cpu')")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"{what}={device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return dev


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
    trail: list | None = None  # during `Transformer.verify`: the windows after each token (`window_tensors`)

    def window_tensors(self) -> list[torch.Tensor]:
        """The compressors' partial windows (kv, score of the KV compressor, then of the indexer's)."""
        return [t for c in (self.compressor, self.index_compressor) if c is not None for t in (c.kv, c.score)]

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


class DecodeState:
    """Everything a batch of sequences carries between calls: one LayerState per layer, `max_len` = the tokens its
    buffers hold per row, `growable` = whether `Transformer.forward` may reallocate them to a larger max_len
    (False: a call past max_len raises ValueError).

    Positions (issue 24): `row_pos` [b] host ints = tokens each row has processed. Rows may sit at different
    positions (a ragged batch, continuous batching); `pos` is their common position and raises ValueError when
    they differ (assigning `pos` sets every row). `pos_buf` int64 [b] on the state's device: the decode step's
    positions as a device tensor (the step never reads a position from the host). `row(i)` is a view of row i
    (its buffers are slices of these: a prefill or an append into it writes this state's row i, nothing else);
    `reset_row(i)` empties row i for a new request.

    `checked_by`: id of the model that last validated this state (`Transformer._check_state`), so a decode step
    does not re-walk every layer's state. `owner`: a weak reference to the model instance the state belongs to
    (set by `new_state`, or by the first model that runs it): another instance, even of the same architecture,
    refuses it (its caches hold that model's keys and values)."""

    checks_ids_on_device = False  # class attribute: True for a CUDA-graph state (`dsv4.graph`)

    def __init__(self, layers: list[LayerState], pos: int = 0, max_len: int = 0, growable: bool = True,
                 checked_by: int | None = None, owner: weakref.ref | None = None):
        self.layers, self.max_len, self.growable = layers, max_len, growable
        self.checked_by, self.owner = checked_by, owner
        dev = self.layers[0].keys.device if self.layers else "cpu"
        b = self.layers[0].keys.shape[0] if self.layers else 1
        self._rows: list[int] = [pos] * b  # a row view shares its parent's list (`row`)
        self._calls = [0]  # calls that changed the state (shared with row views; `Transformer.rollback` checks it)
        self._slice = slice(None)
        self.pos_buf = torch.zeros(b, dtype=torch.int64, device=dev)  # not state bytes

    def __repr__(self) -> str:
        return f"{type(self).__name__}(batch={self.batch}, row_pos={self.row_pos}, max_len={self.max_len}, " \
               f"growable={self.growable}, layers={len(self.layers)})"

    @property
    def batch(self) -> int:
        return self.layers[0].keys.shape[0]

    @property
    def row_pos(self) -> list[int]:
        """Tokens processed by each row (a copy; assign a list of `batch` ints to change them)."""
        return self._rows[self._slice]

    @row_pos.setter
    def row_pos(self, value: list[int]) -> None:
        if not isinstance(value, (list, tuple)) or len(value) != self.batch or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
            raise ValueError(f"row_pos={value!r}: expected a list of {self.batch} ints >= 0")
        if self.max_len and not self.growable and max(value) > self.max_len:
            raise ValueError(f"row_pos={value!r}: beyond this fixed state's max_len={self.max_len}")
        self._rows[self._slice] = list(value)
        self._calls[0] += 1  # every change of positions (each call, a rollback, by hand): a verify record is
        # valid only until the next one (`Transformer.rollback`)

    @property
    def ragged(self) -> bool:
        """True when the rows sit at different positions."""
        return len(set(self.row_pos)) > 1

    @property
    def pos(self) -> int:
        """The position every row is at. Raises ValueError when the rows differ (read `row_pos` then)."""
        rows = self.row_pos
        if len(set(rows)) > 1:
            raise ValueError(f"the rows of this state sit at different positions {rows}: read state.row_pos")
        return rows[0]

    @pos.setter
    def pos(self, value: int) -> None:
        self.row_pos = [value] * self.batch

    def row(self, i: int) -> "DecodeState":
        """Row i as a state of batch 1 whose buffers are views of this state's row i (writes land here) and whose
        position is this state's row_pos[i]. Fixed size (growable False): a growable batch state grows when a
        call on the batch state itself needs room, and views taken before are then stale (refused). Raises
        TypeError for an index that is not an int (bool refused), IndexError for a row outside 0..batch-1."""
        i = _row_index(i, self.batch)
        sl = slice(i, i + 1)
        view = DecodeState([_row_layer(ls, sl) for ls in self.layers], max_len=self.max_len, growable=False,
                           owner=self.owner)
        view._rows, view._slice = self._rows, slice(self._start + i, self._start + i + 1)
        view._calls = self._calls
        view._parent, view._parent_layers = self, self.layers  # a reallocation of self makes the view stale
        return view

    @property
    def _start(self) -> int:
        return self._slice.start or 0

    def reset_row(self, i: int) -> None:
        """Empty row i for a new request (continuous batching): its keys, indexer keys and compressor windows as in
        a fresh state (zeros, scores -inf), its position 0. The other rows are untouched."""
        i = _row_index(i, self.batch)
        for ls in self.layers:
            ls.keys[i].zero_()
            if ls.index_keys is not None:
                ls.index_keys[i].zero_()
            for c in (ls.compressor, ls.index_compressor):
                if c is not None:
                    c.kv[i].zero_()
                    c.score[i].fill_(-math.inf)
        self._set_row(i, 0)

    def copy_row(self, i: int) -> "DecodeState":
        """Row i as a new, independent batch-1 state (its buffers copied; growable, the same max_len and owner):
        what a finished request of a batch keeps for its conversation's next turn."""
        i = _row_index(i, self.batch)
        layers = [_row_layer(ls, slice(i, i + 1), copy=True) for ls in self.layers]
        return DecodeState(layers, pos=self.row_pos[i], max_len=self.max_len, growable=True, owner=self.owner)

    def load_row(self, i: int, src: "DecodeState") -> None:
        """Row i <- the batch-1 state `src` (a previous turn's state): its window ring, compressor windows, entry
        and indexer-key slots (the first ones, as many as both hold) and its position. Raises ValueError when src
        is not batch 1, belongs to another model, or its position does not fit this state's max_len."""
        i = _row_index(i, self.batch)
        if src.batch != 1 or len(src.layers) != len(self.layers):
            raise ValueError(f"load_row: expected a batch-1 state of {len(self.layers)} layers, got batch "
                             f"{src.batch} with {len(src.layers)}")
        if src.owner is not None and self.owner is not None and src.owner() is not self.owner():
            raise ValueError("load_row: the state belongs to another model instance")
        p = src.pos
        if p > self.max_len:
            raise ValueError(f"load_row: the state is at position {p}, over this state's max_len={self.max_len}")
        for dst, s in zip(self.layers, src.layers):
            n = min(dst.keys.shape[1], s.keys.shape[1])
            dst.keys[i, :n] = s.keys[0, :n]
            if dst.index_keys is not None:
                m = min(dst.index_keys.shape[1], s.index_keys.shape[1])
                dst.index_keys[i, :m] = s.index_keys[0, :m]
            for cd, cs in ((dst.compressor, s.compressor), (dst.index_compressor, s.index_compressor)):
                if cd is not None:
                    cd.kv[i] = cs.kv[0]
                    cd.score[i] = cs.score[0]
        self._set_row(i, p)

    def _set_row(self, i: int, p: int) -> None:
        rows = self.row_pos
        rows[i] = p
        self.row_pos = rows

    def load_positions(self) -> torch.Tensor:
        """`pos_buf` [b] int64 <- row_pos without a host sync: one fill when the rows agree, else one
        host-to-device copy from pinned memory, asynchronous on CUDA (torch's pinned allocator keeps the source
        alive until the copy is done)."""
        rows = self.row_pos
        if len(set(rows)) == 1:
            self.pos_buf.fill_(rows[0])
        else:
            t = torch.tensor(rows, dtype=torch.int64)
            if self.pos_buf.is_cuda:
                self.pos_buf.copy_(t.pin_memory(), non_blocking=True)
            else:
                self.pos_buf.copy_(t)
        return self.pos_buf

    def decode_step(self, model, input_ids: torch.Tensor, observer=None) -> torch.Tensor:
        """The decode step, eagerly: input_ids [b, s] (s <= MAX_STEP_TOKENS, checked by `Transformer.forward`) at
        each row's position -> the last layer's streams [b, s, hc, dim]. `dsv4.graph.GraphDecodeState` replays a capture
        of the same step."""
        return model.decode_step(input_ids, self.load_positions(), self, observer)


def _row_index(i, batch: int) -> int:
    """A row index: an int (numpy / torch integer scalars through `operator.index`), never a bool."""
    if isinstance(i, bool):
        raise TypeError(f"row {i!r}: expected an int row index, not a bool")
    try:
        i = operator.index(i)
    except TypeError:
        raise TypeError(f"row {i!r}: expected an int row index, got {type(i).__name__}") from None
    if not 0 <= i < batch:
        raise IndexError(f"row {i}: this state has rows 0..{batch - 1}")
    return i


def _row_layer(ls: LayerState, sl: slice, copy: bool = False) -> LayerState:
    """The LayerState of rows `sl`: views of `ls`'s buffers, or copies of them (`copy`)."""
    def take(t):
        return None if t is None else (t[sl].clone() if copy else t[sl])

    def comp(c):
        return None if c is None else CompressorState(kv=take(c.kv), score=take(c.score))
    return LayerState(keys=take(ls.keys), window=ls.window, compressor=comp(ls.compressor),
                      index_keys=take(ls.index_keys), index_compressor=comp(ls.index_compressor))


class ResidualObserver(Protocol):
    """Called by `Transformer.forward` after every block with the residual streams H `[b, s, hc, d]`."""

    def __call__(self, layer_id: int, H: torch.Tensor) -> None: ...
