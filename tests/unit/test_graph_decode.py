"""The static decode step that the triton backend captures in a CUDA graph (`dsv4/graph.py`), run eagerly on CPU.

`GraphDecodeState(..., capture=False)` executes exactly the step the graph records (device position, static
buffers, branch-free compressors, fixed-k indexer over all key slots). In fp32 (exact mode) it must equal the
model's ordinary decode to fp32 rounding (atol 1e-5 on logits of magnitude ~4; the only differences are the
order of fp32 sums over the extra empty slots) across CSA (ratio 4, indexer top-k 4 below the entries) and HCA
(ratio 128) compression boundaries, with equal greedy tokens. The CUDA-graph replay itself, the sync-free run
and the bf16 Flash-width parity are GPU tests (tests/gpu/test_graph_decode.py).
"""

from __future__ import annotations

import copy
import os
import weakref

import pytest
import torch

from dsv4.graph import GraphDecodeState
from dsv4.model import DecodeState, Transformer
from dsv4.testing import assert_close
from dsv4.tiny import random_state_dict, tiny_args

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.hardstop  # kernel / fast path vs reference (issue 22 item 4)


def _pair(backend: str):
    args = tiny_args(vocab_size=512)
    sd = {k: v for k, v in random_state_dict(args, seed=5).items() if not k.startswith("mtp.")}
    m = Transformer(args, backend=backend)
    m.load_weights(sd)
    return m


def _fork(m, st, static: bool):
    """A copy of the prefilled (not yet decoded) state `st`: a `GraphDecodeState` (static) or a plain
    `DecodeState` (the eager decode) holding deep copies of its layer states. A `GraphDecodeState`'s prefill is
    the model's ordinary eager prefill (dsv4/graph.py; `Transformer.forward` dispatches on the state only for
    decode), so this is the state a second prefill of the same ids would give, bitwise."""
    layers = copy.deepcopy(st.layers)
    if static:
        new = GraphDecodeState(m, st.batch, st.max_len, capture=False)
        new.layers, new.pos = layers, st.pos
    else:
        new = DecodeState(layers, pos=st.pos)
    new.owner = weakref.ref(m)
    return new


@pytest.fixture(scope="module")
def triton_prefill():
    """(triton fp32 model, its GraphDecodeState after an 11-token prefill of 2 sequences, the prefill logits): the
    triton prefill costs ~20 s under the interpreter, so the module runs it once and the tests decode from
    `_fork`s of it (the triton model's backend is replaced only through monkeypatch, restored after each test)."""
    m = _pair("triton")
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(11))
    st = GraphDecodeState(m, 2, 256, capture=False)
    return m, st, m(ids, st)


@pytest.mark.parametrize("backend,prefill,steps", [
    ("reference", 21, 12),    # CSA entries complete at 24, 28, 32; top-k 4 < entries
    ("reference", 124, 8),    # the HCA entry completes at 128
    # the triton twin (fp32) at the CSA boundary 11 and the read of its entry at 12, top-k 4 over 2-3 entries
    # (the padded slots); the bf16 twin with every kernel checked per call: tests/unit/test_bf16_backend.py
    pytest.param("triton", 11, 2, marks=pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")),
])
def test_static_step_equals_decode(backend, prefill, steps, request):
    if backend == "triton":  # the module's triton prefill (the same ids, 2 x 11); both states are copies of it
        m, st, a = request.getfixturevalue("triton_prefill")
        assert st.pos == prefill
        ref, static, b = _fork(m, st, False), _fork(m, st, True), a
    else:
        m = _pair(backend)
        ids = torch.randint(0, 512, (2, prefill), generator=torch.Generator().manual_seed(prefill))
        ref, static = m.new_state(2), GraphDecodeState(m, 2, 256, capture=False)
        a, b = m(ids, ref), m(ids, static)
        assert_close(b, a, "prefill logits", atol=1e-5, rtol=0)
    for i in range(steps):
        tok = a.argmax(-1, keepdim=True)
        assert torch.equal(b.argmax(-1, keepdim=True), tok), f"greedy token differs at decode step {i}"
        a, b = m(tok, ref), m(tok, static)
        assert_close(b, a, f"decode step {i} logits (static step vs decode)", atol=1e-5, rtol=0)
    assert static.pos == ref.pos == prefill + steps


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")
def test_static_step_uses_the_backends_kernels(triton_prefill, monkeypatch):
    """The captured step runs the backend's top-k (the triton kernel, not the torch.topk reference), like the
    eager decode, and the backend's compressor pooling and RoPE kernels: results are equal or nearly so, so
    only a count of the calls can tell. From a copy of the module's 11-token triton prefill."""
    import dataclasses

    import dsv4.graph
    import kernels.indexer

    m, prefilled, _ = triton_prefill
    calls = {"kernel": 0, "ref": 0}
    kernel, ref = m.backend.indexer_topk, kernels.indexer.indexer_topk_ref

    def count(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    import kernels.compressor
    import kernels.rope
    assert m.backend.compress_pool is kernels.compressor.compress_pool and m.backend.rope_tail is kernels.rope.rope_tail_
    calls.update(pool=0, rope=0)
    monkeypatch.setattr(m, "backend", dataclasses.replace(m.backend, indexer_topk=count("kernel", kernel),
                                                          compress_pool=count("pool", m.backend.compress_pool),
                                                          rope_tail=count("rope", m.backend.rope_tail)))
    monkeypatch.setattr(dsv4.graph, "indexer_topk_ref", count("ref", ref))
    st = _fork(m, prefilled, True)
    assert st.pos == 11
    before = dict(calls)
    m(torch.randint(0, 512, (2, 1)), st)  # position 11: a CSA boundary; the counts are per step
    n_csa = sum(layer.attn.indexer is not None for layer in m.layers)
    n_comp = sum((layer.attn.compressor is not None) + (layer.attn.indexer is not None) for layer in m.layers)
    assert n_csa >= 1
    assert calls["kernel"] - before["kernel"] == n_csa and calls["ref"] == 0, calls
    # every compressor pools through the kernel each step; RoPE: q, kv, o per layer, the indexer's q, and the
    # entry of every compressor
    assert calls["pool"] - before["pool"] == n_comp, calls
    assert calls["rope"] - before["rope"] == 3 * len(m.layers) + n_csa + n_comp, calls


def test_static_state_refuses_past_max_len():
    m = _pair("reference")
    st = GraphDecodeState(m, 1, 4, capture=False)
    m(torch.zeros(1, 4, dtype=torch.int64), st)
    with pytest.raises(ValueError, match="max_len=4"):
        m(torch.zeros(1, 1, dtype=torch.int64), st)


def test_graph_decode_needs_triton_bf16_quantized():
    m = _pair("reference")
    with pytest.raises(ValueError, match="backend 'reference'.*dtype torch.float32.*weights='dequantized'"):
        m.use_decode_graphs(256)


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")
def test_static_step_quantization_sims_use_the_backend(monkeypatch):
    """bf16 numerics: the static step's e4m3 (KV nope) and e2m1 (indexer q and keys) simulations run the
    backend's one-launch kernels (bitwise equal to dsv4.quant, tests/unit/test_quant_kernels.py), not dsv4.quant,
    and the step still equals the eager decode."""
    import dataclasses

    import kernels.quant
    from dsv4.model import _Sim
    args = tiny_args(vocab_size=512)
    sd = {k: v for k, v in random_state_dict(args, seed=5).items() if not k.startswith("mtp.")}
    m = Transformer(args, backend="triton", dtype=torch.bfloat16)
    m.load_weights(sd)
    assert m.backend.act_quant_sim is kernels.quant.act_quant_sim
    calls = {"q8": 0, "q4": 0, "ref": 0}

    def count(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    m.backend = dataclasses.replace(m.backend, act_quant_sim=count("q8", m.backend.act_quant_sim),
                                    fp4_act_quant_sim=count("q4", m.backend.fp4_act_quant_sim))
    ids = torch.randint(0, 512, (1, 11), generator=torch.Generator().manual_seed(3))  # counts are per step
    st = GraphDecodeState(m, 1, 256, capture=False)
    m(ids, st)
    ref = _fork(m, st, False)  # the eager decode's state: a copy of the same prefill (one triton prefill, not two)
    monkeypatch.setattr(_Sim, "kv_nope", count("ref", _Sim.kv_nope))       # the model's own (torch) sims
    monkeypatch.setattr(_Sim, "fp4", count("ref", _Sim.fp4))
    before = dict(calls)
    tok = torch.randint(0, 512, (1, 1))
    b = m(tok, st)
    n_csa = sum(layer.attn.indexer is not None for layer in m.layers)
    n_plain = sum(layer.attn.compressor is not None for layer in m.layers)
    assert calls["q8"] - before["q8"] == len(m.layers) + n_plain, calls   # KV nope per layer + each entry
    assert calls["q4"] - before["q4"] == 2 * n_csa, calls                 # indexer q + indexer entry
    assert calls["ref"] == before["ref"], calls
    monkeypatch.undo()
    a = m(tok, ref)
    assert_close(b.float(), a.float(), "bf16 static step vs decode", atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")
def test_triton_decode_with_64_heads_runs_the_all_heads_kernel(monkeypatch):
    """With 64 attention heads (Flash's count) the triton backend's decode runs `_sparse_decode_kernel` (the
    all-heads kernel, issue 14 item 1) and its logits equal the reference backend's (fp32, atol 1e-4 as the GPU
    Flash-width test); prefill (s > 1) stays on the head-block kernel. Counted by wrapping the kernel."""
    import kernels.attention as attention

    calls = []
    kernel = attention._sparse_decode_kernel

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]

    monkeypatch.setattr(attention, "_sparse_decode_kernel", Spy())
    args = tiny_args(vocab_size=512, n_heads=64)
    sd = {k: v for k, v in random_state_dict(args, seed=7).items() if not k.startswith("mtp.")}
    models = {}
    for backend in ("reference", "triton"):
        models[backend] = Transformer(args, backend=backend)
        models[backend].load_weights(sd)
    # 4 tokens: the first CSA entry (position 3) is complete, so both decode steps' all-heads launches read a
    # compressed entry as well as the window (6 tokens before: the same, at 1.5x the triton prefill's time)
    ids = torch.randint(0, 512, (2, 4), generator=torch.Generator().manual_seed(3))
    st = {k: m.new_state(2) for k, m in models.items()}
    a, b = models["reference"](ids, st["reference"]), models["triton"](ids, st["triton"])
    assert_close(b, a, "prefill logits (triton vs reference, 64 heads)", atol=1e-4, rtol=0)
    assert not calls, "prefill must not run the decode kernel"
    for i in range(2):
        tok = a.argmax(-1, keepdim=True)
        a, b = models["reference"](tok, st["reference"]), models["triton"](tok, st["triton"])
        assert_close(b, a, f"decode step {i} logits (triton vs reference, 64 heads)", atol=1e-4, rtol=0)
    assert len(calls) == 2 * args.n_layers, f"one all-heads launch per layer and step, got {len(calls)}"
