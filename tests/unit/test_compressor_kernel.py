"""`kernels.compressor.compress_pool` / `compress_commit` (the graph decode's compressor step) against their
references (the decode step's torch code, whose model run equals the prefill: tests/unit/test_graph_decode.py),
under TRITON_INTERPRET=1 at the real slot counts (CSA r = 4 with the overlap, HCA r = 128 at a small width) over
enough consecutive positions that windows complete, shift and reset; tests/gpu/test_kernel_launchers.py runs
real widths.

Tolerance: the state writes and the committed entries are bitwise (same fp32 operations, then copies); pooled
values are fp32 maths in another order (one division instead of n): within the fp32 bound of an n-term weighted
sum, 4 n 2^-24 sum_i w_i |A_i|. Edge values:
scores around +80 (exp overflows without the max subtraction), ape that matters (different per slot), the first
window of the CSA compressor (previous-window slots at -inf)."""

from __future__ import annotations

import math
import os

import pytest
import torch

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP or not torch.cuda.is_available() else "cuda"
pytestmark = [pytest.mark.hardstop,  # kernel / fast path vs reference (issue 22 item 4)
              pytest.mark.skipif(not INTERP and not torch.cuda.is_available(),
                                 reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set before import)"),
              # the interpreter's numpy evaluates -inf - -inf of masked / empty columns, as intended
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def _state(b, r, d, overlap):
    c = 2 if overlap else 1
    kv = torch.zeros(b, c * r, c * d, device=DEV)
    score = torch.full((b, c * r, c * d), -math.inf, device=DEV)
    return kv, score


def _pool_close(got, want, kv, score, r, overlap, what):
    """fp32 bound of an n-term weighted sum: |err| <= 4 n 2^-24 sum_i w_i |A_i| (relative to the terms, not to
    the result, which cancellation can make small)."""
    d = got.shape[-1]
    if overlap:
        A = torch.cat((kv[:, :r, :d], kv[:, r:, d:]), 1)
        Z = torch.cat((score[:, :r, :d], score[:, r:, d:]), 1)
    else:
        A, Z = kv, score
    bound = 4 * A.shape[1] * 2.0 ** -24 * (Z.softmax(1) * A.abs()).sum(1, keepdim=True) + 1e-30
    err = (got - want).abs()
    assert bool((err <= bound).all()), f"{what}: max excess {(err - bound).max():.3e}"


@pytest.mark.parametrize("joint", [False, True], ids=["plain", "joint"])
@pytest.mark.parametrize("r,overlap,d,b", [(4, True, 96, 2), (128, False, 40, 1), (4, False, 64, 3)],
                         ids=["csa", "hca", "r4_plain"])
def test_compress_step_matches_reference(seed, r, overlap, d, b, joint):
    """joint: a and z are the two halves of one [b, 2W] projection (`dsv4.model.Compressor.join_wkv_wgate`, issue
    27), read in place at the row stride 2W; the reference reads the same views."""
    from kernels.compressor import compress_commit, compress_commit_ref, compress_pool, compress_pool_ref
    c = 2 if overlap else 1
    W = c * d
    ape = torch.randn(r, W, device=DEV)
    kv_r, sc_r = _state(b, r, d, overlap)
    kv_k, sc_k = _state(b, r, d, overlap)
    n_out = 3
    out_r = torch.full((b, 2 + n_out, d), 7.0, device=DEV)[:, 2:]          # a strided view, as the key buffer
    out_k = out_r.clone().new_full((b, 2 + n_out, d), 7.0)[:, 2:]
    steps = 2 * r + 3 if r <= 8 else r + 2
    for p in range(steps):
        pos = torch.tensor([p], device=DEV)
        a = torch.randn(b, W, device=DEV)
        z = torch.randn(b, W, device=DEV) * 3 + 80.0
        if joint:
            az = torch.cat((a, z), 1)
            a, z = az[:, :W], az[:, W:]
        want = compress_pool_ref(a, z, ape, pos, kv_r, sc_r, r, overlap)
        got = compress_pool(a, z, ape, pos, kv_k, sc_k, r, overlap)
        _pool_close(got, want, kv_r, sc_r, r, overlap, f"pooled at {p}")
        assert torch.equal(kv_k, kv_r) and torch.equal(sc_k, sc_r), f"state after the write at {p}"
        new = torch.randn(b, 1, d, device=DEV)
        compress_commit_ref(new, pos, kv_r, sc_r, out_r, r, overlap)
        compress_commit(new, pos, kv_k, sc_k, out_k, r, overlap)
        assert torch.equal(kv_k, kv_r) and torch.equal(sc_k, sc_r), f"state after the commit at {p}"
        assert torch.equal(out_k, out_r), f"entries after the commit at {p}"
    assert bool((out_r[:, 0] != 7.0).all()), "negative control: a window completed and was committed"


def test_compress_names_bad_input():
    from kernels.compressor import compress_commit, compress_pool
    kv, sc = _state(1, 4, 16, True)
    a = torch.randn(1, 32, device=DEV)
    pos = torch.tensor([0], device=DEV)
    ape = torch.randn(4, 32, device=DEV)
    with pytest.raises(ValueError, match=r"compress_pool: kv/score is shapes \(1, 8, 32\)"):
        compress_pool(a, a, ape, pos, kv, sc, 4, False)
    with pytest.raises(ValueError, match="pos is torch.int32"):
        compress_pool(a, a, ape, pos.int(), kv, sc, 4, True)
    with pytest.raises(ValueError, match=r"ape is torch.float32 shape \(3, 32\)"):
        compress_pool(a, a, ape[:3], pos, kv, sc, 4, True)
    with pytest.raises(ValueError, match="new is torch.bfloat16"):
        compress_commit(torch.randn(1, 1, 16, device=DEV, dtype=torch.bfloat16), pos, kv, sc,
                        torch.zeros(1, 3, 16, device=DEV), 4, True)


def test_compress_edges_fail_loud():
    """A negative device position writes nothing and pools NaN (no host sync to refuse it), an empty entry
    buffer is refused by name (it used to write before the buffer), None / non-bool arguments are named."""
    from kernels.compressor import compress_commit, compress_pool
    kv, sc = _state(1, 4, 16, False)
    kv0, sc0 = kv.clone(), sc.clone()
    a = torch.randn(1, 16, device=DEV)
    ape = torch.randn(4, 16, device=DEV)
    neg = torch.tensor([-1], device=DEV)
    pooled = compress_pool(a, a, ape, neg, kv, sc, 4, False)
    assert bool(torch.isnan(pooled).all()) and torch.equal(kv, kv0) and torch.equal(sc, sc0)
    out = torch.full((1, 2, 16), 7.0, device=DEV)
    compress_commit(torch.randn(1, 1, 16, device=DEV), torch.tensor([-1], device=DEV), kv, sc, out, 4, False)
    assert bool((out == 7.0).all()) and torch.equal(sc, sc0)
    with pytest.raises(ValueError, match=r"out is shape \(1, 0, 16\)"):
        compress_commit(torch.randn(1, 1, 16, device=DEV), torch.tensor([3], device=DEV), kv, sc,
                        torch.zeros(1, 0, 16, device=DEV), 4, False)
    with pytest.raises(ValueError, match="compress_pool: ape is NoneType"):
        compress_pool(a, a, None, torch.tensor([0], device=DEV), kv, sc, 4, False)
    with pytest.raises(ValueError, match="overlap is 'yes'"):
        compress_pool(a, a, ape, torch.tensor([0], device=DEV), kv, sc, 4, "yes")
    with pytest.raises(ValueError, match=r"pos is torch.int64 shape \(\)"):
        compress_pool(a, a, ape, torch.tensor(0, device=DEV), kv, sc, 4, False)


@pytest.mark.parametrize("r,overlap,d", [(4, True, 48), (8, False, 32)], ids=["csa", "r8_plain"])
@pytest.mark.parametrize("impl", ["ref", "kernel"])
def test_per_row_positions_equal_each_row_alone(seed, r, overlap, d, impl):
    """A ragged batch (issue 24): pos [b] puts each row at its own position, so rows complete, commit, shift and
    reset their windows at different steps. The anchor is the same op run on each row alone with pos [1] (the
    lockstep form): state writes, pooled entries and committed entries bitwise equal, row by row, at every step.
    Row offsets 0, 1, r // 2 + 1 and r - 1 put every phase of the window in some row at every step. Negative
    control: feeding every row row 0's position (the bug class of a ragged step that broadcasts one position)
    changes some row's committed entries."""
    from kernels import compressor as kc
    pool, commit = ((kc.compress_pool_ref, kc.compress_commit_ref) if impl == "ref"
                    else (kc.compress_pool, kc.compress_commit))
    c = 2 if overlap else 1
    W, b = c * d, 4
    offs = torch.tensor([0, 1, r // 2 + 1, r - 1], device=DEV)
    ape = torch.randn(r, W, device=DEV)
    kv, sc = _state(b, r, d, overlap)
    out = torch.full((b, 4, d), 7.0, device=DEV)
    alone = [(*_state(1, r, d, overlap), torch.full((1, 4, d), 7.0, device=DEV)) for _ in range(b)]
    wrong_kv, wrong_sc = _state(b, r, d, overlap)
    wrong_out = out.clone()
    for step in range(2 * r + 1):
        pos = offs + step
        a = torch.randn(b, W, device=DEV)
        z = torch.randn(b, W, device=DEV) * 3 + 80.0
        new = torch.randn(b, 1, d, device=DEV)
        got = pool(a, z, ape, pos, kv, sc, r, overlap)
        commit(new, pos, kv, sc, out, r, overlap)
        for i, (kv_i, sc_i, out_i) in enumerate(alone):
            want = pool(a[i:i + 1], z[i:i + 1], ape, pos[i:i + 1], kv_i, sc_i, r, overlap)
            commit(new[i:i + 1], pos[i:i + 1], kv_i, sc_i, out_i, r, overlap)
            assert torch.equal(got[i], want[0]), f"row {i} pooled at step {step}"
            assert torch.equal(kv[i], kv_i[0]) and torch.equal(sc[i], sc_i[0]), f"row {i} state at step {step}"
            assert torch.equal(out[i], out_i[0]), f"row {i} entries at step {step}"
        row0 = pos[:1].expand(b).contiguous()
        pool(a, z, ape, row0, wrong_kv, wrong_sc, r, overlap)
        commit(new, row0, wrong_kv, wrong_sc, wrong_out, r, overlap)
    assert bool((out[:, 0] != 7.0).all()), "every row completed and committed a window"
    assert not torch.equal(wrong_out, out), "negative control: row 0's position for every row must differ"


def test_per_row_pos_shape_is_checked():
    from kernels.compressor import compress_pool, compress_pool_ref
    kv, sc = _state(2, 4, 16, False)
    a = torch.randn(2, 16, device=DEV)
    ape = torch.randn(4, 16, device=DEV)
    for fn in (compress_pool, compress_pool_ref):
        with pytest.raises(ValueError, match=r"pos is torch.int64 shape \(3,\).*int64 \[1\] or \[2\]"):
            fn(a, a, ape, torch.tensor([0, 1, 2], device=DEV), kv, sc, 4, False)


def test_compress_commit_ref_refuses_positions_outside_out_and_bad_new_or_out():
    """`compress_commit_ref` took a negative position (negative indexing overwrote out's last entry, where the
    kernel commits nothing) and clamped a position past the end into the last entry; a `new` of the wrong width
    or an `out` of another dtype failed inside torch. Now ValueErrors naming pos / new / out (the launcher reads
    no device value: its docstring says what it does instead). Controls: pos 3 commits entry 0, pos 11 (the last
    position out holds) entry 2, with the CSA shift and the -inf reset."""
    from kernels.compressor import compress_commit_ref
    kv, sc = torch.randn(1, 8, 16), torch.randn(1, 8, 16)
    out = torch.zeros(1, 3, 8)
    new = torch.ones(1, 1, 8)
    for pos in (-1, -4, 12, 99):
        with pytest.raises(ValueError, match=rf"compress_commit_ref: pos is min {pos} max {pos} \(shape \(1,\)\); "
                                             r"expected positions in 0\.\.11"):
            compress_commit_ref(new, torch.tensor([pos]), kv, sc, out, 4, True)
    with pytest.raises(ValueError, match=r"pos is min 3 max 12 \(shape \(2,\)\)"):
        compress_commit_ref(torch.ones(2, 1, 8), torch.tensor([3, 12]), torch.zeros(2, 8, 16),
                            torch.zeros(2, 8, 16), torch.zeros(2, 3, 8), 4, True)
    with pytest.raises(ValueError, match=r"compress_commit_ref: new is torch.float32 shape \(1, 1, 6\)"):
        compress_commit_ref(torch.ones(1, 1, 6), torch.tensor([3]), kv, sc, out, 4, True)
    with pytest.raises(ValueError, match=r"compress_commit_ref: new is torch.float32 shape \(1, 1, 8\); "
                                         r"expected torch.bfloat16"):
        compress_commit_ref(new, torch.tensor([3]), kv, sc, out.bfloat16(), 4, True)
    with pytest.raises(ValueError, match=r"compress_commit_ref: out is torch.float32 shape \(1, 0, 8\)"):
        compress_commit_ref(new, torch.tensor([3]), kv, sc, out[:, :0], 4, True)
    with pytest.raises(ValueError, match=r"compress_commit_ref: out is torch.int64 shape \(1, 3, 8\)"):
        compress_commit_ref(new.long(), torch.tensor([3]), kv, sc, out.long(), 4, True)
    kv0, sc0 = kv.clone(), sc.clone()
    compress_commit_ref(new, torch.tensor([3]), kv, sc, out, 4, True)
    assert torch.equal(out[0, 0], new[0, 0]) and bool((out[0, 1:] == 0).all())
    assert torch.equal(kv[:, :4], kv0[:, 4:]) and torch.equal(sc[:, :4], sc0[:, 4:])
    assert bool((sc[:, 4:] == -math.inf).all())
    compress_commit_ref(2 * new, torch.tensor([11]), kv, sc, out, 4, True)
    assert torch.equal(out[0, 2], 2 * new[0, 0]) and torch.equal(out[0, 0], new[0, 0])
    out1 = out.clone()
    compress_commit_ref(3 * new, torch.tensor([10]), kv, sc, out, 4, True)  # not a window end: nothing changes
    assert torch.equal(out, out1)


def test_softmax_pool_ref_refuses_shapes_that_would_broadcast_and_non_fp32():
    """`softmax_pool_ref(Z [1, 4, 8], A [1, 4, 1])` broadcast A over d, and bf16 Z / A were pooled in bf16
    (the docstring says fp32). Now ValueErrors naming Z / A; control: the formula on fp32 [b, n, d]."""
    from kernels.compressor import softmax_pool_ref
    Z, A = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match=r"softmax_pool_ref: A is shape \(1, 4, 1\); expected Z's shape \(1, 4, 8\)"):
        softmax_pool_ref(Z[:1], A[:1, :, :1])
    with pytest.raises(ValueError, match=r"softmax_pool_ref: Z is torch.bfloat16 shape \(2, 4, 8\); expected a "
                                         r"float32 tensor"):
        softmax_pool_ref(Z.bfloat16(), A.bfloat16())
    with pytest.raises(ValueError, match=r"softmax_pool_ref: A is torch.float64"):
        softmax_pool_ref(Z, A.double())
    with pytest.raises(ValueError, match=r"softmax_pool_ref: Z is torch.float32 shape \(4, 8\)"):
        softmax_pool_ref(Z[0], A[0])
    w = torch.exp(Z - Z.amax(1, keepdim=True))
    want = (w * A).sum(1, keepdim=True) / w.sum(1, keepdim=True)
    torch.testing.assert_close(softmax_pool_ref(Z, A), want, rtol=1e-6, atol=1e-6)
