"""Sync-free, CUDA-graph-captured decode for the triton backend (issue 13).

`Transformer.use_decode_graphs(max_len)` makes `new_state(b)` return a `GraphDecodeState`. Its prefill is the
model's ordinary eager prefill. On the first decode call the state moves into static buffers sized for
`max_len` tokens (window ring and compressed entries in one `[b, window + max_len // r, hd]` tensor, so the
attention reads them without a concatenation; indexer keys `[b, max_len // 4, d_I]`; the compressor buffers as
they are), one decode step is captured in a CUDA graph (after an eager warm-up whose writes are undone), and
every decode call after that copies the token ids and the position into static inputs and replays the graph.

The captured step (`GraphDecodeState.step_eager`) is the reference decode maths of `Attention.forward` /
`Compressor.decode` / `Indexer.select` with the position as a device tensor instead of a Python int:
  * ring write, window mask, compressed-entry visibility and the indexer's causal count are computed from it;
  * a compressor computes its pooled entry at every step and stores it (and shifts / resets its window) only
    where `(pos + 1) % r == 0` (`torch.where`), instead of branching on the host;
  * the indexer ranks all `max_len // 4` key slots with `n_valid = (pos + 1) // 4` and keeps `index_topk`
    slots, -1 padded (the reference keeps `min(index_topk, n_valid)`: the extra slots are empty), with the
    backend's top-k (`kernels.indexer.indexer_topk` on triton: one launch, no sync; before, the graph ran
    the torch.topk reference here even on the triton backend);
  * the routed experts run `kernels.moe.moe_experts` (no host sync). Nothing in the step reads a value back to
    the host (the GPU test runs it under `torch.cuda.set_sync_debug_mode("error")`).
The final path (hc_head -> norm -> head) runs eagerly after the replay, through the modules, so forward hooks
(the final-norm check) observe it; an observer gets every layer's output streams from the graph's buffers.

Requirements (checked by `Transformer.use_decode_graphs`, ValueError otherwise): triton backend on CUDA, bf16
numerics, `weights="quantized"` with FP4 experts at widths that are multiples of 128 (the grouped kernel).
A graph belongs to one state (its buffers are the state's); decoding past `max_len` raises ValueError.
Token ids are checked on the device (`torch._assert_async`: an id outside the vocabulary is a device-side
assert, loud, never a silent wrong row).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dsv4.state import CompressorState, DecodeState, LayerState, ResidualObserver
from kernels.indexer import indexer_topk_ref

if TYPE_CHECKING:  # annotations only (never executed): dsv4.model imports this module
    from dsv4.model import Attention, Compressor, Indexer

__all__ = ["GraphDecodeState", "check_graph_model"]


def check_graph_model(model, max_len: int, capture: bool = True) -> None:
    """Raise ValueError unless `model` can decode through CUDA graphs (module docstring) up to `max_len`
    (`capture=False`: the static step run eagerly, any backend / device / dtype; only max_len is checked)."""
    if not capture:
        if not (isinstance(max_len, int) and max_len > 0):
            raise ValueError(f"static decode state: max_len={max_len!r} (needs a positive int)")
        return
    from dsv4.fast import _stackable  # triton is optional: dsv4.fast imports the Triton kernels
    problems = []
    if model.backend.name != "triton":
        problems.append(f"backend {model.backend.name!r} (needs 'triton')")
    if model.device.type != "cuda":
        problems.append(f"device {model.device} (needs CUDA)")
    if model.dtype != torch.bfloat16:
        problems.append(f"dtype {model.dtype} (needs torch.bfloat16)")
    if model.weights != "quantized":
        problems.append(f"weights={model.weights!r} (needs 'quantized')")
    elif not all(_stackable(layer.ffn) for layer in model.layers):
        problems.append("routed experts not all FP4 at widths that are multiples of 128 on this rank")
    if not (isinstance(max_len, int) and max_len > 0 and max_len % 128 == 0):
        problems.append(f"max_len={max_len!r} (needs a positive multiple of 128)")
    if problems:
        raise ValueError("CUDA-graph decode unavailable: " + "; ".join(problems))


class _Static:
    """Static decode buffers of one layer (see the module docstring)."""

    def __init__(self, attn: Attention, ls: LayerState, max_len: int):
        b, W, hd = ls.ring.shape
        n_e = max_len // attn.ratio if attn.ratio else 0
        self.keys = ls.ring.new_zeros(b, W + n_e, hd)
        self.keys[:, :W] = ls.ring
        self.ring, self.entries = self.keys[:, :W], self.keys[:, W:]
        self.comp, self.index_keys, self.index_comp = ls.compressor, None, ls.index_compressor
        if attn.compressor is not None:
            self.entries[:, :ls.entries.shape[1]] = ls.entries
        if attn.indexer is not None:
            self.index_keys = ls.index_keys.new_zeros(b, max_len // 4, ls.index_keys.shape[2])
            self.index_keys[:, :ls.index_keys.shape[1]] = ls.index_keys

    def tensors(self) -> list[torch.Tensor]:
        out = [self.keys]
        for c in (self.comp, self.index_comp):
            if c is not None:
                out += [c.kv, c.score]
        if self.index_keys is not None:
            out.append(self.index_keys)
        return out


def _compress_step(comp: Compressor, x: torch.Tensor, pos: torch.Tensor, st: CompressorState,
                   out: torch.Tensor, backend) -> None:
    """`Compressor.decode` at device position pos [1]: the entry completed at (pos+1) % r == 0 goes to
    out[:, pos // r] (out [b, n, d] static); branch-free (module docstring). The state update and pooling are
    the backend's `compress_pool` / `compress_commit` (`kernels.compressor`: one launch each on triton)."""
    r = comp.ratio
    a, z = comp.wkv(x)[:, 0], comp.wgate(x)[:, 0]
    pooled = backend.compress_pool(a.contiguous(), z.contiguous(), comp.ape, pos, st.kv, st.score, r, comp.overlap)
    new = _finish(comp, pooled, (pos // r) * r, x.dtype, backend)
    backend.compress_commit(new.contiguous(), pos, st.kv, st.score, out, r, comp.overlap)


def _kv_nope(sim, x: torch.Tensor, backend) -> torch.Tensor:
    """`_Sim.kv_nope` through the backend (e4m3 simulation of the KV nope channels, 64-channel blocks)."""
    return backend.act_quant_sim(x.contiguous(), sim._block(x, 64)) if sim.enabled else x


def _fp4(sim, x: torch.Tensor, backend) -> torch.Tensor:
    """`_Sim.fp4` through the backend (e2m1 simulation of indexer queries / keys, 32-channel blocks)."""
    return backend.fp4_act_quant_sim(x.contiguous(), sim._block(x, 32)) if sim.enabled else x


def _finish(comp: Compressor, pooled: torch.Tensor, first_pos: torch.Tensor, dtype: torch.dtype,
            backend) -> torch.Tensor:
    """`Compressor._finish` with the backend's RoPE (the same maths): pooled [b, 1, d] fp32 -> the stored entry
    [b, 1, d] in `dtype`: norm, RoPE of the tail at the window's first position, then the indexer's Hadamard +
    FP4 rounding or the FP8 rounding of the nope channels."""
    k = backend.rope_tail(comp.norm(pooled.to(dtype)), first_pos, comp.inv_freq, comp.rd)
    if comp.is_indexer:
        return _fp4(comp.sim, (k.float() @ comp.hadamard.T).to(dtype), backend)
    k[..., :-comp.rd] = _kv_nope(comp.sim, k[..., :-comp.rd], backend)
    return k


def _select(ix: Indexer, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor,
            backend) -> torch.Tensor:
    """`Indexer.select` at device position pos [1] over the static key slots: [b, 1, index_topk], -1 padded."""
    b = x.shape[0]
    q = backend.rope_tail(ix.wq_b(qr).unflatten(-1, (ix.n_heads, ix.head_dim)), pos, ix.inv_freq, ix.rd)
    q = _fp4(ix.sim, (q.float() @ ix.hadamard.T).to(q.dtype), backend)
    w = ix.weights_proj(x).float() * ix.weight_scale
    scores = ix.reduce_scores(backend.indexer_scores(q, w.to(q.dtype), keys))
    n_valid = ((pos + 1) // 4).clamp(max=keys.shape[1])
    topk = backend.indexer_topk or indexer_topk_ref  # the eager `Indexer.select` rule: same picks, bitwise
    return topk(scores, ix.topk, n_valid.view(1, 1).expand(b, 1), check=False)


def _attention_step(attn: Attention, x: torch.Tensor, pos: torch.Tensor, sl: _Static, backend) -> torch.Tensor:
    """`Attention.forward` for one decode token at device position pos [1]; x [b, 1, dim] -> [b, 1, dim]."""
    b = x.shape[0]
    rd, W = attn.rd, attn.window
    qr = attn.q_norm(attn.wq_a(x))
    q = attn.wq_b(qr).unflatten(-1, (attn.n_heads, attn.hd))
    q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + attn.args.norm_eps)
    q = backend.rope_tail(q, pos, attn.inv_freq, rd)
    kv = attn.kv_norm(attn.wkv(x))
    kv[..., :-rd] = _kv_nope(attn.sim, kv[..., :-rd], backend)
    kv = backend.rope_tail(kv, pos, attn.inv_freq, rd)
    sl.ring.index_copy_(1, pos % W, kv)
    slots = torch.arange(W, device=x.device)
    idx = torch.where(slots <= pos, slots, -1).view(1, 1, W).expand(b, 1, W)
    keys = sl.ring
    if attn.compressor is not None:
        _compress_step(attn.compressor, x, pos, sl.comp, sl.entries, backend)
        if attn.indexer is not None:
            _compress_step(attn.indexer.compressor, x, pos, sl.index_comp, sl.index_keys, backend)
            comp = _select(attn.indexer, x, qr, pos, sl.index_keys, backend)
        else:
            w = torch.arange(sl.entries.shape[1], device=x.device)
            comp = torch.where(w < (pos + 1) // attn.ratio, w, -1).view(1, 1, -1).expand(b, 1, -1)
        idx = torch.cat((idx, torch.where(comp >= 0, comp + W, -1)), -1)
        keys = sl.keys
    o = backend.sparse_attn(q, keys, attn.attn_sink, idx, attn.scale)
    o = backend.rope_tail(o, pos, attn.inv_freq, rd, inverse=True)
    o = o.flatten(2).unflatten(-1, (attn.groups, -1))
    return attn.wo_b(backend.grouped_linear(o, attn.wo_a).flatten(2))


class GraphDecodeState(DecodeState):
    """A `DecodeState` whose decode steps replay a CUDA graph (module docstring). Made by
    `Transformer.new_state` after `Transformer.use_decode_graphs(max_len)`; `capture=False` runs the same
    static step eagerly (the tests' comparison)."""

    def __init__(self, model, batch: int, max_len: int, capture: bool = True):
        check_graph_model(model, max_len, capture)
        layers = [layer.attn.new_state(batch, model.dtype, model.device) for layer in model.layers]
        super().__init__(layers=layers, pos=0)
        self.model, self.batch, self.max_len, self.capture = model, batch, max_len, capture
        self.static: list[_Static] | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.ids_buf = torch.zeros(batch, 1, dtype=torch.int64, device=model.device)
        self.pos_buf = torch.zeros(1, dtype=torch.int64, device=model.device)
        self.H_out: list[torch.Tensor] = []

    def step_eager(self, ids: torch.Tensor, pos: torch.Tensor) -> list[torch.Tensor]:
        """One decode step on the static buffers: ids [b, 1] int64, pos [1] int64 (device) -> every layer's
        output streams [b, 1, hc, dim]. What the graph captures."""
        m = self.model
        be = m.backend
        H = m.embed(ids).unsqueeze(2).repeat(1, 1, m.args.hc_mult, 1)
        outs = []
        for layer, sl in zip(m.layers, self.static):
            H = layer._site(H, "attn", lambda x: _attention_step(layer.attn, layer.attn_norm(x), pos, sl, be), be)
            H = layer._site(H, "ffn", lambda x: layer.ffn(layer.ffn_norm(x), ids), be)
            outs.append(H)
        return outs

    def _make_static(self) -> None:
        if self.pos > self.max_len:
            raise ValueError(f"prefill of {self.pos} tokens exceeds the graph state's max_len={self.max_len}")
        self.static = [_Static(layer.attn, ls, self.max_len) for layer, ls in zip(self.model.layers, self.layers)]
        for ls, sl in zip(self.layers, self.static):  # the state's tensors are the static buffers from now on
            ls.ring, ls.entries, ls.index_keys = sl.ring, (sl.entries if ls.entries is not None else None), \
                sl.index_keys

    def _capture(self) -> None:
        """Warm up (compiles, workspaces, constant tables) on a side stream, undo its writes, capture."""
        saved = [t.clone() for sl in self.static for t in sl.tensors()]
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.step_eager(self.ids_buf, self.pos_buf)
        torch.cuda.current_stream().wait_stream(stream)
        for t, s in zip((t for sl in self.static for t in sl.tensors()), saved):
            t.copy_(s)
        del saved
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            self.H_out = self.step_eager(self.ids_buf, self.pos_buf)
        self.graph = g

    def decode(self, input_ids: torch.Tensor, observer: ResidualObserver | None = None) -> torch.Tensor:
        """One decode token per sequence: input_ids [b, 1] -> logits [b, V] fp32 (advances pos). No host sync
        in the step. Raises ValueError past max_len or for a wrong shape."""
        if tuple(input_ids.shape) != (self.batch, 1):
            raise ValueError(f"graph decode: input_ids shape {tuple(input_ids.shape)}, expected ({self.batch}, 1)")
        if self.pos >= self.max_len:
            raise ValueError(f"graph decode: position {self.pos} reaches the state's max_len={self.max_len} "
                             "(make the state with a larger use_decode_graphs(max_len))")
        V = self.model.args.vocab_size
        torch._assert_async(((input_ids >= 0) & (input_ids < V)).all(), f"token id outside [0, {V})")
        if self.static is None:
            self._make_static()
        self.ids_buf.copy_(input_ids)
        self.pos_buf.fill_(self.pos)
        if not self.capture:
            self.H_out = self.step_eager(self.ids_buf, self.pos_buf)
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
        self.pos += 1
        if observer is not None:
            for layer, H in zip(self.model.layers, self.H_out):
                observer(layer.layer_id, H)
        return self.model.final_logits(self.H_out[-1])[:, -1]
