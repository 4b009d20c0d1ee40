"""The explicit backend switch and the Triton backend at model level (CPU: Triton interpreter).

Model-level parity is checked in fp32 (exact mode): there the kernels agree with the reference to fp32
rounding, so logits agree to atol 1e-4 (measured ~3e-6 on logits of ~4) and greedy tokens are equal. In bf16
mode the official quantization simulations (FP8/FP4 rounding, expert routing) turn one-ulp kernel differences
into O(0.1-1) logit changes on a random tiny model, so bf16 model parity is judged on the GPU against the
bf16-vs-fp32 gap instead (tests/gpu/test_model_backends.py).
"""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch

from dsv4.backend import get_backend
from dsv4.model import Transformer
from dsv4.testing import assert_close
from dsv4.tiny import random_state_dict, tiny_args

pytestmark = pytest.mark.hardstop  # the Triton backend equals the reference at model level

INTERP = os.environ.get("TRITON_INTERPRET") == "1"


def test_unknown_backend_is_an_error():
    with pytest.raises(ValueError, match="backend='cuda-magic'"):
        get_backend("cuda-magic", torch.device("cpu"))


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_backend("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Transformer(tiny_args(vocab_size=64, n_layers=1), backend="triton")


def test_reference_backend_is_the_kernels_refs():
    from kernels import attention, indexer, mhc
    b = get_backend("reference", torch.device("cpu"))
    assert (b.hc_pre, b.hc_post, b.hc_head, b.sparse_attn, b.indexer_scores) == (
        mhc.hc_pre_ref, mhc.hc_post_ref, mhc.hc_head_ref, attention.sparse_attn_ref, indexer.indexer_scores_ref)


@pytest.fixture(scope="module")
def prefilled():
    """(args, reference model, triton model, their states after the same 21-token prefill, the prefill logits).
    The triton prefill is the costly part under the interpreter (~20 s): run once for this module; each test
    decodes from its own deep copies of the states (`copy.deepcopy`: the same tensors a repeated prefill of the
    same ids would give, bitwise - the model is deterministic on CPU)."""
    args = tiny_args(vocab_size=512)
    sd = {k: v for k, v in random_state_dict(args, seed=21).items() if not k.startswith("mtp.")}
    ref, tri = Transformer(args), Transformer(args, backend="triton")
    ref.load_weights(sd)
    tri.load_weights(sd)
    # 21 tokens: 5 CSA entries > index_topk 4, window 8 full
    ids = torch.randint(0, 512, (1, 21), generator=torch.Generator().manual_seed(21))
    s_ref, s_tri = ref.new_state(1), tri.new_state(1)
    l_ref, l_tri = ref(ids, s_ref, all_logits=True), tri(ids, s_tri, all_logits=True)
    return args, ref, tri, s_ref, s_tri, l_ref, l_tri


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 (CPU) - CI sets it for the unit run")
def test_triton_backend_matches_reference_fp32(prefilled):
    _, ref, tri, s_ref, s_tri, l_ref, l_tri = prefilled
    s_ref, s_tri = copy.deepcopy(s_ref), copy.deepcopy(s_tri)
    assert_close(l_tri, l_ref, "prefill logits triton vs reference", atol=1e-4, rtol=0)
    g_ref, g_tri = [], []
    a, b = l_ref[:, -1], l_tri[:, -1]
    for _ in range(3):
        ta, tb = a.argmax(-1, keepdim=True), b.argmax(-1, keepdim=True)
        g_ref.append(int(ta))
        g_tri.append(int(tb))
        a, b = ref(ta, s_ref), tri(tb, s_tri)
        assert_close(b, a, "decode logits triton vs reference", atol=1e-4, rtol=0)
    assert g_tri == g_ref


@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 (CPU) - CI sets it for the unit run")
def test_triton_decode_fuses_layer_boundaries(prefilled, monkeypatch):
    """Decode with the triton backend at a fused-boundary threshold of 4 tokens (`hc_post_pre_max_t`) and
    `hc_post_pre(one_launch=True)` (the default threshold is `kernels.mhc.POST_PRE_ONE_LAUNCH_MAX_T`, 0 since the
    separate launches were measured faster - the deferred path stays for a backend that sets both) runs every layer boundary through `hc_post_pre` (2·n_layers - 1 fused
    boundaries, one plain hc_post at the end) and gives the logits of the per-site path (forced by a residual
    observer) within fp32 rounding; the reference backend never takes the deferred path. Both decodes start
    from copies of the module's 21-token triton prefill (the state two identical prefills would give)."""
    import dataclasses

    from kernels import indexer, mhc
    args, _, tri, _, s_tri, _, _ = prefilled
    assert tri.backend.indexer_topk is indexer.indexer_topk and tri.backend.hc_post_pre is mhc.hc_post_pre
    calls = {"hc_post_pre": 0, "hc_post": 0}

    def counting(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    assert tri.backend.hc_post_pre_max_t == mhc.POST_PRE_ONE_LAUNCH_MAX_T
    fused = functools.partial(mhc.hc_post_pre, one_launch=True)  # the fused kernel (not hc_post_pre's default)
    monkeypatch.setattr(tri, "backend", dataclasses.replace(
        tri.backend, hc_post_pre=counting("hc_post_pre", fused), hc_post=counting("hc_post", mhc.hc_post),
        hc_post_pre_max_t=4))
    s_fused, s_plain = copy.deepcopy(s_tri), copy.deepcopy(s_tri)
    nxt = torch.randint(0, 512, (1, 1))
    fused = tri(nxt, s_fused)
    assert calls == {"hc_post_pre": 2 * args.n_layers - 1, "hc_post": 1}, calls
    plain = tri(nxt, s_plain, observer=lambda i, H: None)
    assert calls == {"hc_post_pre": 2 * args.n_layers - 1, "hc_post": 1 + 2 * args.n_layers}, calls
    assert_close(fused, plain, "decode logits: fused boundaries vs per-site path", atol=1e-4, rtol=0)
    ref = Transformer(args)
    assert not ref._defer_hc_post(torch.zeros(1, 1, 4, 8), None)
