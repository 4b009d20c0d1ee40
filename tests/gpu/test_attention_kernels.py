"""GPU: Triton sparse attention and indexer scoring against the references at DeepSeek-V4 sizes (spec §5, §7).

Index sets come from `benchmarks.bench_attention.{decode,prefill}_case` (official plumbing: window ring slots,
compressed entries offset by 128 in decode / by S in prefill, -1 padding). Contexts sit below, on and above
each boundary: window 127/128/129, HCA entry 128·w±1, CSA 4·topk±1. Outputs are poisoned with NaN before launch.
Tolerances: bf16 table (rtol 1.6e-2, atol 1e-2); fp32 1e-5; indexer fp32 scores rtol 1e-5 with atol 1e-5 times
the row's absolute score sum scale; indices bitwise.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.testing import assert_close, assert_equal

pytestmark = [pytest.mark.gpu, pytest.mark.hardstop,  # kernel / backend vs reference on CUDA (issue 22 item 4)
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]

HD = 512
SCALE = HD ** -0.5
DECODE = {  # kind, topk, contexts (one decode sequence per context, ragged in one batch)
    "swa": ("swa", 0, [1, 2, 5, 127, 128, 129, 4000]),
    "hca": ("hca", 0, [1, 127, 128, 129, 255, 256, 257, 4097]),
    "csa-flash": ("csa", 512, [1, 4, 5, 2047, 2048, 2049, 4096, 65536]),
    "csa-pro": ("csa", 1024, [3, 4, 4095, 4096, 4097, 9000]),
}


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("case", list(DECODE))
def test_decode_matches_ref(seed, heads, case):
    from benchmarks.bench_attention import decode_case
    from kernels.attention import sparse_attn, sparse_attn_ref
    kind, topk, contexts = DECODE[case]
    q, kv, sink, idx = decode_case(contexts, heads, kind, topk, generator=_gen(seed))
    out = torch.full_like(q, float("nan"))
    got = sparse_attn(q, kv, sink, idx, SCALE, out=out)
    assert_close(got, sparse_attn_ref(q, kv, sink, idx, SCALE), f"sparse_attn decode {case} h={heads}")
    n_slots = (idx >= 0).sum(-1)[:, 0]
    expect = {"swa": [min(c, 128) for c in contexts], "hca": [min(c, 128) + c // 128 for c in contexts],
              "csa": [min(c, 128) + min(topk, c // 4) for c in contexts]}[kind]
    assert n_slots.tolist() == expect, "visible-set sizes per context (window 128 incl. query, causal entries)"


@pytest.mark.parametrize("splits", [1, 2, 7, 40])
@pytest.mark.parametrize("block_h, block_n, warps", [(16, 32, 4), (16, 64, 4), (32, 32, 8)])
def test_decode_configs_agree(seed, splits, block_h, block_n, warps):
    from benchmarks.bench_attention import decode_case
    from kernels.attention import sparse_attn, sparse_attn_ref
    q, kv, sink, idx = decode_case([100, 3000, 9000], 64, "csa", 512, generator=_gen(seed))
    out = torch.full_like(q, float("nan"))
    got = sparse_attn(q, kv, sink, idx, SCALE, out=out, num_splits=splits, block_h=block_h, block_n=block_n,
                      num_warps=warps, path="blocks")
    assert_close(got, sparse_attn_ref(q, kv, sink, idx, SCALE), f"sparse_attn splits={splits}")


@pytest.mark.parametrize("heads, topk", [(64, 512), (128, 1024)], ids=["flash", "pro"])
@pytest.mark.parametrize("path, kw", [
    ("heads", {}), ("heads", dict(prefetch=False, num_stages=3)), ("heads", dict(dv=256)),
    ("heads", dict(dv=128, num_warps=4, num_splits=4)), ("heads", dict(num_splits=1)), ("heads", dict(block_n=16)),
    ("heads", dict(num_splits=7, num_stages=3)), ("blocks", {})],
    ids=["heads", "heads-no-prefetch", "heads-dv256", "heads-dv128-sp4", "heads-sp1", "heads-bn16", "heads-sp7-st3",
         "blocks"])
def test_decode_all_heads_kernel(seed, heads, topk, path, kw):
    """Both decode kernels at Flash / Pro sizes (64 / 128 heads, window 128 + top-512 / top-1024), batch 16 with
    ragged contexts (4k and 64k pools, a 5-token sequence, an all-empty query), NaN-poisoned output."""
    from benchmarks.bench_attention import decode_case
    from kernels.attention import sparse_attn, sparse_attn_ref
    contexts = [4096, 65536, 5, 300] * 4
    q, kv, sink, idx = decode_case(contexts, heads, "csa", topk, generator=_gen(seed))
    idx[3] = -1
    out = torch.full_like(q, float("nan"))
    got = sparse_attn(q, kv, sink, idx, SCALE, out=out, path=path, **kw)
    assert got.data_ptr() == out.data_ptr()
    assert_close(got, sparse_attn_ref(q, kv, sink, idx, SCALE), f"sparse_attn {path} {kw} h={heads}")
    assert torch.equal(got[3], torch.zeros_like(got[3])), "all-empty query gives exact zeros"


def test_decode_all_heads_bad_index_is_nan(seed):
    """The sync-free guard on the all-heads kernel: an index == n poisons its query (all heads, all columns,
    every dv slice and split), other queries keep the reference result."""
    from benchmarks.bench_attention import decode_case
    from kernels.attention import sparse_attn, sparse_attn_ref
    q, kv, sink, idx = decode_case([4096, 4096, 9000], 64, "csa", 512, generator=_gen(seed))
    idx[1, 0, 300] = kv.shape[1]
    for kw in ({}, dict(dv=128, num_warps=4), dict(num_splits=1)):
        got = sparse_attn(q, kv, sink, idx, SCALE, path="heads", **kw)
        assert bool(torch.isnan(got[1]).all()), f"bad index must poison its query ({kw})"
        keep = torch.tensor([0, 2], device="cuda")
        assert_close(got[keep], sparse_attn_ref(q[keep], kv[keep], sink, idx[keep], SCALE), f"others {kw}")


@pytest.mark.parametrize("kind, topk", [("swa", 0), ("hca", 0), ("csa", 16)])
@pytest.mark.parametrize("seqlen", [1, 4, 5, 127, 129, 300])
def test_prefill_matches_ref(seed, kind, topk, seqlen):
    from benchmarks.bench_attention import prefill_case
    from kernels.attention import sparse_attn, sparse_attn_ref
    q, kv, sink, idx = prefill_case(seqlen, 64, kind, topk, generator=_gen(seed))
    out = torch.full_like(q, float("nan"))
    got = sparse_attn(q, kv, sink, idx, SCALE, out=out)
    assert_close(got, sparse_attn_ref(q, kv, sink, idx, SCALE), f"sparse_attn prefill {kind} S={seqlen}")


@pytest.mark.parametrize("path", [None, "blocks"], ids=["default", "blocks"])
def test_prefill_pro_heads_with_rope_matches_ref(seed, path):
    """Pro's 128 heads at prefill (CSA, 300 tokens): the default (the all-heads kernel, two head blocks) and the
    head-block kernel, with the output's RoPE de-rotated in the epilogue (rd 64, per-token positions), against
    `sparse_attn_rope_ref`."""
    from benchmarks.bench_attention import prefill_case
    from kernels.attention import sparse_attn
    from kernels.rope import sparse_attn_rope_ref
    q, kv, sink, idx = prefill_case(300, 128, "csa", 16, generator=_gen(seed))
    rd = 64
    f = (1.0 / 10000 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)).cuda()
    pos = torch.arange(300, dtype=torch.int64, device="cuda") + 17
    got = sparse_attn(q, kv, sink, idx, SCALE, out=torch.full_like(q, float("nan")), path=path, rope=(pos, f, rd))
    assert_close(got, sparse_attn_rope_ref(q, kv, sink, idx, SCALE, pos, f, rd), f"sparse_attn prefill {path}")


def test_fp32_and_all_invalid(seed):
    """fp32 path (exact 'ieee' dots, rtol 1e-5) and a query with every slot -1 (exact zeros)."""
    from benchmarks.bench_attention import decode_case
    from kernels.attention import sparse_attn, sparse_attn_ref
    q, kv, sink, idx = decode_case([5, 300, 5000], 128, "csa", 512, dtype=torch.float32, generator=_gen(seed))
    idx[1] = -1
    got = sparse_attn(q, kv, sink, idx, SCALE, out=torch.full_like(q, float("nan")))
    assert_close(got, sparse_attn_ref(q, kv, sink, idx, SCALE), "sparse_attn fp32")
    assert torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.parametrize("b, s, n", [(4, 1, 1024), (2, 1, 16387), (1, 64, 1000)], ids=["dec4k", "dec64k", "pre"])
def test_indexer_scores_match_ref(seed, b, s, n):
    from kernels.indexer import indexer_scores, indexer_scores_ref
    g = _gen(seed)
    q = torch.randn(b, s, 64, 128, device="cuda", generator=g).bfloat16()
    w = torch.randn(b, s, 64, device="cuda", generator=g)
    k = torch.randn(b, n, 128, device="cuda", generator=g).bfloat16()
    out = torch.full((b, s, n), float("nan"), device="cuda")
    got = indexer_scores(q, w, k, out=out)
    scale = torch.einsum("bshd,bnd->bshn", q.float(), k.float()).relu_().mul_(w.abs()[..., None]).sum(2).max()
    assert_close(got, indexer_scores_ref(q, w, k), "indexer_scores", atol=1e-5 * float(scale))


@pytest.mark.parametrize("topk", [512, 1024])
def test_indexer_exact_scores_and_picks(seed, topk):
    """Integer-valued q/k and power-of-two weights: scores exact, so Triton's scores and picks equal the
    reference bitwise, with thousands of exact ties (ReLU zeros), on rows above and below 4·topk tokens."""
    from kernels.indexer import indexer_scores, indexer_scores_ref, indexer_topk_ref
    g = _gen(seed)
    b, n = 4, 3 * topk
    q = torch.randint(-1, 2, (b, 1, 64, 128), device="cuda", generator=g).bfloat16()
    k = torch.randint(-1, 2, (b, n, 128), device="cuda", generator=g).bfloat16()
    w = torch.tensor([-1.0, -0.5, 0.5, 1.0], device="cuda")[torch.randint(0, 4, (b, 1, 64), device="cuda",
                                                                           generator=g)]
    got = indexer_scores(q, w, k)
    ref = indexer_scores_ref(q, w, k)
    assert_equal(got + 0.0, ref + 0.0, "indexer_scores (exact)")
    n_valid = torch.tensor([[topk - 1], [topk], [topk + 1], [n]], device="cuda")
    picks = indexer_topk_ref(got, topk, n_valid)
    assert_equal(picks, indexer_topk_ref(ref, topk, n_valid), "picks")
    assert_equal(picks.cpu(), indexer_topk_ref(ref.cpu(), topk, n_valid.cpu()), "picks CUDA vs CPU")
    for i in range(b):  # decode row (only existing entries) == prefill row (full, masked by n_valid)
        c = int(n_valid[i, 0])
        assert_equal(indexer_topk_ref(ref[i:i + 1, :, :c].contiguous(), topk), picks[i:i + 1], f"row {i}")
    assert not torch.equal(picks[3, 0], torch.arange(topk, device="cuda")), "picks must not be entries 0..k-1"
