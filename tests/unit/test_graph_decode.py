"""The decode step (`Transformer.decode_step`: device position, preallocated ring + entry slots, branch-free
compressors, fixed-k indexer over every key slot) that every backend runs eagerly and the triton backend captures in
a CUDA graph (`dsv4/graph.py`), run eagerly on CPU.

Anchor: prefill == decode. The decode step's logits at position t must equal row t of ONE prefill of the whole
sequence (`Attention.prefill` / `Compressor.prefill`: another code path, whole-window pooling, keys of the call
itself) to fp32 rounding (atol 2e-5 on logits of magnitude ~4, `test_model.DECODE_ATOL`: only the order of fp32
sums over the attention keys differs) across CSA (ratio 4, indexer top-k 4 below the entries) and HCA (ratio 128)
compression boundaries, with equal greedy tokens; the triton step against the reference backend's prefill at
atol 1e-4 (the backends' fp32 distance, as the Flash-width GPU test). The CUDA-graph replay itself, the sync-free
run and the bf16 Flash-width parity are GPU tests (tests/gpu/test_graph_decode.py).
"""

from __future__ import annotations

import copy
import os
import weakref

import pytest
import torch

from dsv4.model import DecodeState, Transformer
from dsv4.testing import assert_close
from dsv4.tiny import random_state_dict, tiny_args

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.hardstop  # kernel / fast path vs reference (issue 22 item 4)
DECODE_ATOL = 2e-5  # tests/unit/test_model.py: same model, same ops, only the attention key order differs


def _pair(backend: str, dtype=torch.float32):
    args = tiny_args(vocab_size=512)
    sd = {k: v for k, v in random_state_dict(args, seed=5).items() if not k.startswith("mtp.")}
    m = Transformer(args, backend=backend, dtype=dtype)
    m.load_weights(sd)
    return m


def _fork(m, st):
    """A deep copy of the decode state `st`, owned by model `m` (a state of the same weights: the caches hold the
    same keys whichever backend made them)."""
    return DecodeState(copy.deepcopy(st.layers), pos=st.pos, max_len=st.max_len, growable=st.growable,
                       owner=weakref.ref(m))


@pytest.fixture(scope="module")
def triton_prefill():
    """(triton fp32 model, its state after an 11-token prefill of 2 sequences, the prefill ids, logits): the triton
    prefill costs ~20 s under the interpreter, so the module runs it once and the tests decode from `_fork`s of it
    (the triton model's backend is replaced only through monkeypatch, restored after each test)."""
    m = _pair("triton")
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(11))
    st = m.new_state(2, 256)
    return m, st, ids, m(ids, st)


@pytest.mark.parametrize("backend,prefill,steps", [
    ("reference", 21, 12),    # CSA entries complete at 24, 28, 32; top-k 4 < entries
    ("reference", 124, 8),    # the HCA entry completes at 128
    # the triton step (fp32) at the CSA boundary 11 and the read of its entry at 12, top-k 4 over 2-3 entries
    # (the padded slots); the bf16 step with every kernel checked per call: tests/unit/test_bf16_backend.py
    pytest.param("triton", 11, 2, marks=pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")),
])
def test_static_step_equals_decode(backend, prefill, steps, request):
    """The decode step equals ONE prefill of the same tokens (module docstring; the name, from when a second
    decode implementation was the anchor, is kept: hard-stop ids are the merge gate's contract)."""
    ref = _pair("reference")
    if backend == "triton":  # the module's triton prefill (2 x 11); decoded from a copy of its state
        m, st0, ids, a = request.getfixturevalue("triton_prefill")
        assert st0.pos == prefill
        st, atol = _fork(m, st0), 1e-4
    else:
        m = ref
        ids = torch.randint(0, 512, (2, prefill), generator=torch.Generator().manual_seed(prefill))
        st, atol = m.new_state(2), DECODE_ATOL
        a = m(ids, st)
    got = [a]
    for _ in range(steps):
        ids = torch.cat((ids, got[-1].argmax(-1, keepdim=True)), 1)
        got.append(m(ids[:, -1:], st))
    assert st.pos == prefill + steps == ids.shape[1]
    full = ref(ids, ref.new_state(2), all_logits=True)  # one prefill of every token (reference backend)
    for i, g in enumerate(got):
        t = prefill - 1 + i
        assert torch.equal(g.argmax(-1), full[:, t].argmax(-1)), f"greedy token differs at position {t}"
        assert_close(g, full[:, t], f"logits at position {t} ({backend} decode step vs prefill)", atol=atol, rtol=0)


def test_growable_state_reallocates_between_calls():
    """A state made without max_len holds the first multiple of 128 that fits the prompt and is reallocated (its
    contents copied) when a decode step needs more: decoding across the growth at 128 equals the prefill."""
    m = _pair("reference")
    ids = torch.randint(0, 512, (1, 131), generator=torch.Generator().manual_seed(4))
    st = m.new_state(1)
    got = [m(ids[:, :126], st)]
    assert (st.max_len, st.growable) == (128, True)
    for t in range(126, 131):
        got.append(m(ids[:, t:t + 1], st))
    assert st.max_len == 256
    for layer, ls in zip(m.layers, st.layers):
        r = layer.attn.ratio
        assert ls.keys.shape[1] == m.args.window_size + (256 // r if r else 0)
    full = m(ids, m.new_state(1), all_logits=True)
    for i, g in enumerate(got):
        assert_close(g, full[:, 125 + i], f"logits at position {125 + i} (across the growth)", atol=DECODE_ATOL, rtol=0)


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")
def test_static_step_uses_the_backends_kernels(triton_prefill, monkeypatch):
    """The captured step runs the backend's top-k (the triton kernel, not the torch.topk reference), like the
    eager decode, and the backend's compressor pooling and RoPE kernels: results are equal or nearly so, so
    only a count of the calls can tell. From a copy of the module's 11-token triton prefill."""
    import dataclasses

    import dsv4.model
    import kernels.indexer

    m, prefilled, _, _ = triton_prefill
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
    assert m.backend.kv_finish is kernels.rope.kv_finish
    assert m.backend.qkv_finish is kernels.rope.qkv_finish
    calls.update(pool=0, rope=0, kv=0, q=0, qkv=0, attn_rope=0, qrot=0)
    monkeypatch.setattr(m, "backend", dataclasses.replace(m.backend, indexer_topk=count("kernel", kernel),
                                                          compress_pool=count("pool", m.backend.compress_pool),
                                                          rope_tail=count("rope", m.backend.rope_tail),
                                                          kv_finish=count("kv", m.backend.kv_finish),
                                                          q_finish=count("q", m.backend.q_finish),
                                                          qkv_finish=count("qkv", m.backend.qkv_finish),
                                                          sparse_attn_rope=count("attn_rope",
                                                                                 m.backend.sparse_attn_rope),
                                                          rope_rotate_fp4=count("qrot", m.backend.rope_rotate_fp4)))
    monkeypatch.setattr(dsv4.model, "indexer_topk_ref", count("ref", ref))
    st = _fork(m, prefilled)
    assert st.pos == 11
    before = dict(calls)
    m(torch.randint(0, 512, (2, 1)), st)  # position 11: a CSA boundary; the counts are per step
    n_csa = sum(layer.attn.indexer is not None for layer in m.layers)
    n_comp = sum((layer.attn.compressor is not None) + (layer.attn.indexer is not None) for layer in m.layers)
    assert n_csa >= 1
    assert calls["kernel"] - before["kernel"] == n_csa and calls["ref"] == 0, calls
    # every compressor pools through the kernel each step; RoPE: the indexer's q through `rope_tail` (inside
    # `rope_rotate_fp4` with the FP4 simulation, bf16 mode), o per layer inside `sparse_attn_rope` (the attention's
    # epilogue), the q and kv of every layer inside `qkv_finish` (one launch), the entry of every compressor inside
    # `kv_finish` (issue 27)
    assert calls["pool"] - before["pool"] == n_comp, calls
    fused_q = m.layers[0].attn.sim.enabled
    assert calls["rope"] - before["rope"] == (0 if fused_q else n_csa), calls
    assert calls["qrot"] - before["qrot"] == (n_csa if fused_q else 0), calls
    assert calls["attn_rope"] - before["attn_rope"] == len(m.layers), calls
    assert calls["qkv"] - before["qkv"] == len(m.layers) and calls["q"] == before["q"], calls
    assert calls["kv"] - before["kv"] == n_comp, calls


def test_static_state_refuses_past_max_len():
    m = _pair("reference")
    st = m.new_state(1, 128)
    m(torch.ones(1, 128, dtype=torch.int64), st)
    with pytest.raises(ValueError, match="max_len=128 tokens; position 128 \\+ 1"):
        m(torch.ones(1, 1, dtype=torch.int64), st)
    for bad in (0, 100, -128, 128.0, True):
        with pytest.raises(ValueError, match="max_len"):
            m.new_state(1, bad)


def test_graph_decode_needs_triton_bf16_quantized():
    m = _pair("reference")
    with pytest.raises(ValueError, match="backend 'reference'.*dtype torch.float32.*weights='dequantized'"):
        m.use_decode_graphs(256)


def test_graph_state_check_reads_the_stacked_flag_not_the_experts(monkeypatch):
    """`check_graph_model` runs at every `new_state` of a graph model (each prefill's state): it reads the MoE's
    `stacked` flag, set once at construction, instead of rebuilding each layer's 256 `ExpertWeights` (1-3 ms of
    host time per layer at Flash width, before the prefill's first kernel; issue 23). Negative case: a layer
    whose experts are not stacked is refused, by name."""
    from dsv4.graph import check_graph_model
    from dsv4.model import MoE

    m = Transformer(tiny_args(dim=128, moe_inter_dim=128, n_layers=2, compress_ratios=(4, 128, 0), vocab_size=256),
                    dtype=torch.bfloat16, backend="triton", weights="quantized")
    assert all(layer.ffn.stacked is not None for layer in m.layers)
    calls = []
    monkeypatch.setattr(MoE, "expert_weights", lambda self: calls.append(1) or [])
    with pytest.raises(ValueError, match="device cpu") as e:  # only the device is wrong on this CPU model
        check_graph_model(m, 256)
    assert "routed experts" not in str(e.value) and calls == [], "the check walked the experts"
    m.layers[1].ffn.stacked = None
    with pytest.raises(ValueError, match="routed experts not all FP4"):
        check_graph_model(m, 256)


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")
def test_static_step_quantization_sims_use_the_backend(monkeypatch):
    """bf16 numerics: the static step's e4m3 (KV nope, inside `kv_finish`) and e2m1 (indexer q and keys, fused with their rotation:
    `rotate_fp4`) simulations run the backend's one-launch kernels (bitwise equal to dsv4.quant, tests/unit/test_quant_kernels.py), not dsv4.quant.
    (Each of those calls against its reference on the same input, inside the bf16 model run:
    tests/unit/test_bf16_backend.py; whole-model bf16 logits of two backends differ by the bf16 noise.)"""
    import dataclasses

    import kernels.quant
    args = tiny_args(vocab_size=512)
    sd = {k: v for k, v in random_state_dict(args, seed=5).items() if not k.startswith("mtp.")}
    m = Transformer(args, backend="triton", dtype=torch.bfloat16)
    m.load_weights(sd)
    assert m.backend.act_quant_sim is kernels.quant.act_quant_sim
    calls = {"q8": 0, "q4": 0, "r4": 0, "kv": 0, "ref": 0}

    def count(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapped

    m.backend = dataclasses.replace(m.backend, act_quant_sim=count("q8", m.backend.act_quant_sim),
                                    fp4_act_quant_sim=count("q4", m.backend.fp4_act_quant_sim),
                                    rotate_fp4=count("r4", m.backend.rotate_fp4),
                                    kv_finish=count("kv", m.backend.kv_finish),
                                    qkv_finish=count("kv", m.backend.qkv_finish),
                                    rope_rotate_fp4=count("r4", m.backend.rope_rotate_fp4))
    ids = torch.randint(0, 512, (1, 11), generator=torch.Generator().manual_seed(3))  # counts are per step
    st = m.new_state(1, 256)
    m(ids, st)
    from dsv4.model import _Sim

    def torch_sim(fn):  # counts the model's own (torch, dsv4.quant) roundings: a call without a backend op
        def wrapped(self, x, op=None):
            calls["ref"] += op is None
            return fn(self, x, op)
        return wrapped

    monkeypatch.setattr(_Sim, "kv_nope", torch_sim(_Sim.kv_nope))
    monkeypatch.setattr(_Sim, "fp4", torch_sim(_Sim.fp4))
    before = dict(calls)
    tok = torch.randint(0, 512, (1, 1))
    b = m(tok, st)
    n_csa = sum(layer.attn.indexer is not None for layer in m.layers)
    n_plain = sum(layer.attn.compressor is not None for layer in m.layers)
    # KV nope per layer + each entry: the e4m3 rounding inside `kv_finish` (one launch with the norm and RoPE; the
    # attention's KV with its q: `qkv_finish`, counted here too), which also finishes each indexer entry (no e4m3)
    assert calls["kv"] - before["kv"] == len(m.layers) + n_plain + n_csa and calls["q8"] == before["q8"], calls
    # indexer q + indexer entry: the rotation and its e2m1 rounding in one launch (`kernels.indexer.rotate_fp4`;
    # the q's with its RoPE: `rope_rotate_fp4`, counted here too)
    assert calls["r4"] - before["r4"] == 2 * n_csa and calls["q4"] == before["q4"], calls
    assert calls["ref"] == before["ref"], calls
    assert bool(torch.isfinite(b).all())


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")
def test_triton_decode_with_64_heads_runs_the_all_heads_kernel(monkeypatch):
    """With 64 attention heads (Flash's count) the triton backend's decode runs `_sparse_decode_kernel` (the
    all-heads kernel, issue 14 item 1) and its logits equal the reference backend's (fp32, atol 1e-4 as the GPU
    Flash-width test); prefill (s > 1) runs it too (the default at every s since the ninth session of 2026-12-06:
    one launch per layer over the b*s queries). Counted by wrapping the kernel."""
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
    assert calls == [(8, 1, 1)] * args.n_layers, f"prefill: one all-heads launch per layer over 2 x 4 queries, {calls}"
    for i in range(2):
        tok = a.argmax(-1, keepdim=True)
        a, b = models["reference"](tok, st["reference"]), models["triton"](tok, st["triton"])
        assert_close(b, a, f"decode step {i} logits (triton vs reference, 64 heads)", atol=1e-4, rtol=0)
    assert len(calls) == 3 * args.n_layers, f"one all-heads launch per layer and call, got {len(calls)}"
