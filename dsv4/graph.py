"""CUDA-graph capture and replay of the model's decode step (`Transformer.decode_step`, issue 13 / 23).

`Transformer.use_decode_graphs(max_len)` makes `new_state(b)` return a `GraphDecodeState`: a `DecodeState` of fixed
`max_len` whose prefill is the ordinary prefill and whose decode calls replay one captured `decode_step` (the same
step the eager decode runs; nothing of the block maths is here). On the first decode call the step is run once on a
side stream (compiles, workspaces, constant tables; its writes to the state are undone), then captured with the
token ids and each row's position in static device buffers; every later call copies them in and replays. A call
of s <= `MAX_STEP_TOKENS` tokens per row after the prefill (a speculative verify step) replays its own capture
of the same step for that s; longer calls run eagerly on the state's buffers. `Transformer.verify` on a graph
state replays a capture of its own (the same step, recording the compressors' partial windows after each token
into the graph's static outputs, `LayerState.trail`): the record refers to those outputs, valid until the next
replay of that capture, i.e. for the one rollback right after the verify call (the record's staleness check
refuses any later use); the rings before the call are cloned eagerly, on the stream, before the replay. A residual
observer gets its own capture (the plain layer loop, recording each block's streams); without one the capture runs
the backend's layer loop (boundaries deferred only where its `hc_post_pre_max_t` asks: not by default). The final
path (hc_head -> norm -> head) runs eagerly after the replay, through the
modules, so forward hooks (the final-norm check) observe it.

Requirements (`check_graph_model`, ValueError otherwise): triton backend on CUDA, bf16 numerics,
`weights="quantized"` with FP4 experts at widths that are multiples of 128 (the grouped kernel: no host sync), and
max_len a multiple of 128. A graph belongs to one state (it holds the state's buffers); decoding past max_len raises
ValueError; token ids are checked on the device (`torch._assert_async`: loud, never a silent wrong row).
"""

from __future__ import annotations

import torch

from dsv4.state import DecodeState

__all__ = ["GraphDecodeState", "check_graph_model"]


def check_graph_model(model, max_len: int) -> None:
    """Raise ValueError naming every reason `model` cannot decode through CUDA graphs up to `max_len`."""
    problems = []
    if model.backend.name != "triton":
        problems.append(f"backend {model.backend.name!r} (needs 'triton')")
    if model.device.type != "cuda":
        problems.append(f"device {model.device} (needs CUDA)")
    if model.dtype != torch.bfloat16:
        problems.append(f"dtype {model.dtype} (needs torch.bfloat16)")
    if model.weights != "quantized":
        problems.append(f"weights={model.weights!r} (needs 'quantized')")
    elif any(layer.ffn.stacked is None for layer in model.layers):  # stacked at construction where `MoE.stackable`
        # (reading the flag, not re-checking the 256 experts: this runs at every new_state, a prefill's first step)
        problems.append("routed experts not all FP4 at widths that are multiples of 128 on this rank")
    if not (isinstance(max_len, int) and max_len > 0 and max_len % 128 == 0):
        problems.append(f"max_len={max_len!r} (needs a positive multiple of 128)")
    if problems:
        raise ValueError("CUDA-graph decode unavailable: " + "; ".join(problems))


class GraphDecodeState(DecodeState):
    """A fixed-`max_len` `DecodeState` whose decode steps replay a CUDA graph of `Transformer.decode_step` (module
    docstring). Made by `Transformer.new_state` after `Transformer.use_decode_graphs(max_len)`."""

    checks_ids_on_device = True

    def __init__(self, model, batch: int, max_len: int):
        check_graph_model(model, max_len)
        super().__init__(layers=model.layer_states(batch, max_len), max_len=max_len, growable=False)
        self.model = model
        self.ids_bufs: dict[int, torch.Tensor] = {}  # s -> static token ids [batch, s]
        # (observer use, s, recording a verify trail) -> (graph, last streams, each block's streams, trails)
        self.graphs: dict[tuple[bool, int, bool], tuple] = {}

    def _capture(self, observe: bool, s: int, recording: bool) -> tuple:
        """Warm up on a side stream, undo its writes, capture: (graph, last streams, each block's streams, the
        verify trail per layer: `LayerState.trail`'s clones, static outputs of the graph, or None)."""
        m, outs = self.model, []
        ids = self.ids_bufs[s]
        record = (lambda layer_id, H: outs.append(H)) if observe else None
        state = [t for ls in self.layers for t in ls.tensors()]
        saved = [t.clone() for t in state]
        stream = torch.cuda.Stream(m.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            m.decode_step(ids, self.pos_buf, self, record)
        torch.cuda.current_stream().wait_stream(stream)
        for t, s in zip(state, saved):
            t.copy_(s)
        del saved
        outs.clear()
        for ls in self.layers:  # the warm-up's trail entries are not the capture's
            ls.trail = [] if recording else None
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            H = m.decode_step(ids, self.pos_buf, self, record)
        trails = [ls.trail for ls in self.layers] if recording else None
        return g, H, outs, trails

    def decode_step(self, model, input_ids: torch.Tensor, observer=None) -> torch.Tensor:
        """`DecodeState.decode_step` by graph replay: input_ids [b, s] (s <= MAX_STEP_TOKENS: one capture per s
        and observer use) -> the last block's streams [b, s, hc, dim] (the graph's output buffer, valid until the
        next replay). No host sync."""
        if model is not self.model:
            raise ValueError("a GraphDecodeState replays the graph of the model that made it")
        V = model.args.vocab_size
        torch._assert_async(((input_ids >= 0) & (input_ids < V)).all(), f"token id outside [0, {V})")
        s = input_ids.shape[1]
        if s not in self.ids_bufs:
            self.ids_bufs[s] = torch.zeros(self.batch, s, dtype=torch.int64, device=model.device)
        self.ids_bufs[s].copy_(input_ids)
        self.load_positions()  # each row's position (rows of a ragged batch differ)
        recording = self.layers[0].trail is not None  # a verify step (`Transformer.verify`)
        key = (observer is not None, s, recording)
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        g, H, outs, trails = self.graphs[key]
        g.replay()
        if recording:  # the record's windows after each token: the capture's clones, refilled by this replay
            for ls, trail in zip(self.layers, trails):
                ls.trail[:] = trail
        if observer is not None:
            for layer, Hl in zip(model.layers, outs):
                observer(layer.layer_id, Hl)
        return H
