"""Lightning indexer (spec §7): scores against float64, the deterministic top-k tie rule against a brute-force
oracle (prefill row vs decode row), and the Triton scoring kernel under TRITON_INTERPRET=1.

Tolerances: fp32 scores rtol 1e-5 with atol 1e-5·max_t Σ_h |w_h|·ReLU(q_h·k) (the sum cancels across signed
weights, so the error scale is the absolute sum, not the result). Indices are compared exactly; the random-float
Triton test compares picks only where the reference's k-th and (k+1)-th scores are separated by more than that
tolerance (tie-aware), the integer test compares everything bitwise.
"""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.testing import assert_close, assert_equal
from kernels.indexer import indexer_scores_ref, indexer_topk_ref

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
needs_triton = pytest.mark.skipif(
    not (INTERPRET or torch.cuda.is_available()),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (CI sets it for tests/unit)")
pytestmark = pytest.mark.hardstop  # kernel / fast path vs reference (issue 22 item 4)


def oracle_topk(scores, k, n_valid):
    """Brute force: sort eligible entries by (-score, index) in Python; pad with -1."""
    b, s, _ = scores.shape
    out = torch.full((b, s, k), -1, dtype=torch.int64)
    for i in range(b):
        for t in range(s):
            row = [(-float(scores[i, t, j]), j) for j in range(int(n_valid[i, t]))]
            picks = [j for _, j in sorted(row)[:k]]
            out[i, t, : len(picks)] = torch.tensor(picks, dtype=torch.int64)
    return out


def tied_scores(b, s, n):
    """Rows with many exact ties: ReLU zeros (±0.0) and a handful of repeated small values."""
    x = torch.randint(-3, 4, (b, s, n)).float() * 0.25
    x = torch.where(x < 0, torch.zeros_like(x), x)
    return torch.where(torch.rand(b, s, n) < 0.2, -x, x)          # some -0.0 next to +0.0


def abs_scale(q, w, k):
    return torch.einsum("bshd,bnd->bshn", q.double(), k.double()).relu().mul(w.double()[..., None].abs()).sum(2)


def test_scores_ref_matches_float64(seed):
    q, w, k = torch.randn(2, 3, 4, 32), torch.randn(2, 3, 4), torch.randn(2, 9, 32)
    ref64 = torch.einsum("bshn,bsh->bsn", torch.einsum("bshd,bnd->bshn", q.double(), k.double()).relu(), w.double())
    got = indexer_scores_ref(q, w, k)
    assert got.dtype == torch.float32 and got.shape == (2, 3, 9)
    assert_close(got, ref64.float(), "indexer_scores_ref", atol=1e-5 * float(abs_scale(q, w, k).max()))


@pytest.mark.parametrize("n, k", [(1, 4), (7, 4), (40, 8), (40, 40), (33, 50)], ids=lambda v: str(v))
def test_topk_follows_tie_rule(seed, n, k):
    scores = tied_scores(2, 5, n)
    n_valid = torch.randint(0, n + 1, (2, 5))
    n_valid[0, 0], n_valid[1, 4] = 0, n
    assert_equal(indexer_topk_ref(scores, k, n_valid), oracle_topk(scores, k, n_valid), "indexer_topk_ref")


def test_topk_full_row_equals_truncated_row(seed):
    """Prefill sees a full score row (non-causal tail masked by n_valid), decode a row of only the causal
    entries; with exact ties everywhere the picks must be identical."""
    scores = tied_scores(3, 4, 64)
    n_valid = torch.tensor([[5, 16, 17, 64], [1, 2, 3, 4], [63, 40, 20, 0]])
    full = indexer_topk_ref(scores, 16, n_valid)
    for i in range(3):
        for t in range(4):
            c = int(n_valid[i, t])
            trunc = indexer_topk_ref(scores[i:i + 1, t:t + 1, :c].contiguous(), 16)
            assert_equal(full[i:i + 1, t:t + 1], trunc, f"picks of row ({i},{t}) with {c} causal entries")


def test_tie_rule_check_catches_wrong_rules(seed):
    """Negative cases for the hard-stop tests: 'first k entries' (the CUDA-graph shortcut bug) and 'ties toward
    the higher index' both fail the oracle comparison."""
    scores = tied_scores(1, 3, 30)
    n_valid = torch.full((1, 3), 30)
    expected = oracle_topk(scores, 8, n_valid)
    first_k = torch.arange(8).expand(1, 3, 8).clone()
    flipped = 29 - torch.sort(-scores.flip(-1) - 0.0, dim=-1, stable=True).indices[..., :8]
    for name, wrong in (("first-k", first_k), ("ties-high", flipped)):
        with pytest.raises(AssertionError):
            assert_equal(wrong, expected, name)


def test_topk_signed_zero_and_nan():
    scores = torch.tensor([[[0.0, -0.0, float("nan"), 1.0, -0.0, float("-inf")]]])
    assert indexer_topk_ref(scores, 6).tolist() == [[[3, 0, 1, 4, 5, 2]]]


@pytest.mark.parametrize("args, match", [
    ((torch.zeros(1, 2, 3, dtype=torch.float64), 2, None), "scores must be float32"),
    ((torch.zeros(1, 2, 3), -1, None), "k must be"),
    ((torch.zeros(1, 2, 3), 2, torch.tensor([[1, 4]])), r"n_valid must lie in \[0, n=3\]"),
    ((torch.zeros(1, 2, 3), 2, torch.tensor([1, 2])), "n_valid must be"),
], ids=["dtype", "k", "n_valid-range", "n_valid-shape"])
def test_topk_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        indexer_topk_ref(*args)


def test_scores_ref_rejects_bad_input():
    with pytest.raises(ValueError, match="weights must be"):
        indexer_scores_ref(torch.randn(1, 2, 4, 32), torch.randn(1, 2, 3), torch.randn(1, 5, 32))
    with pytest.raises(ValueError, match="k must be"):
        indexer_scores_ref(torch.randn(1, 2, 4, 32), torch.randn(1, 2, 4), torch.randn(1, 5, 16))


# ---- Triton under the interpreter ------------------------------------------------------------------------------

@needs_triton
def test_triton_scores_keep_a_nan_key_nan():
    """A NaN in one key makes that key's score NaN (torch's relu keeps NaN; a plain max would score it 0 and the
    top-k would rank it as a real candidate); the other scores stay within tolerance."""
    from kernels.indexer import indexer_scores
    q, w, k = torch.randn(1, 2, 4, 32), torch.randn(1, 2, 4), torch.randn(1, 20, 32)
    k[0, 7, 3] = float("nan")
    q, w, k = q.to(DEV), w.to(DEV), k.to(DEV)
    got, ref = indexer_scores(q, w, k, block_n=16), indexer_scores_ref(q, w, k)
    assert bool(torch.isnan(ref[..., 7]).all()), "control: the reference's NaN column"
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), "NaN scores differ from the reference"
    tol = 1e-5 * float(abs_scale(q.cpu(), w.cpu(), k.nan_to_num().cpu()).max())
    keep = [i for i in range(20) if i != 7]
    assert_close(got[..., keep], ref[..., keep], "finite scores", dtype=torch.float32, atol=tol)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b, s, h, d, n, ppr", [
    (2, 1, 4, 32, 50, None), (1, 3, 3, 64, 37, 2), (1, 2, 20, 32, 16, 1)],
    ids=["decode", "prefill-split", "h20"])
def test_triton_scores_match_ref(seed, dtype, b, s, h, d, n, ppr):
    from kernels.indexer import indexer_scores
    q, w, k = torch.randn(b, s, h, d).to(dtype), torch.randn(b, s, h), torch.randn(b, n, d).to(dtype)
    q, w, k = q.to(DEV), w.to(DEV), k.to(DEV)
    out = torch.full((b, s, n), float("nan"), device=DEV)
    got = indexer_scores(q, w, k, out=out, block_n=16, programs_per_row=ppr)
    ref = indexer_scores_ref(q, w, k)
    tol = 1e-5 * float(abs_scale(q.cpu(), w.cpu(), k.cpu()).max())
    assert_close(got, ref, "indexer_scores", dtype=torch.float32, atol=tol)
    topk = min(8, n)
    ref_idx, got_idx = indexer_topk_ref(ref, topk), indexer_topk_ref(got, topk)
    sorted_ref = ref.sort(dim=-1, descending=True).values
    separated = (sorted_ref[..., topk - 1] - sorted_ref[..., topk]) > 2 * tol if n > topk else torch.ones(b, s, 1)
    for i, t in separated.reshape(b, s).nonzero().tolist():   # tie-aware: rows with a clear k-th boundary
        assert set(got_idx[i, t].tolist()) == set(ref_idx[i, t].tolist()), f"picks of row ({i},{t})"


@needs_triton
def test_triton_integer_scores_and_picks_exact(seed):
    """Small-integer q, k and power-of-two weights make every score exact in fp32: Triton's scores and the
    picks must equal the reference bitwise, including the many exact ties."""
    from kernels.indexer import indexer_scores
    q = torch.randint(-2, 3, (2, 3, 4, 32)).to(torch.bfloat16)
    k = torch.randint(-2, 3, (2, 45, 32)).to(torch.bfloat16)
    w = torch.tensor([-1.0, -0.5, 0.5, 1.0])[torch.randint(0, 4, (2, 3, 4))]
    got = indexer_scores(q.to(DEV), w.to(DEV), k.to(DEV), block_n=16)
    ref = indexer_scores_ref(q, w, k)
    assert_equal(got.cpu() + 0.0, ref + 0.0, "indexer_scores (exact)")
    n_valid = torch.tensor([[0, 11, 45], [3, 44, 12]])
    assert_equal(indexer_topk_ref(got.cpu(), 10, n_valid), indexer_topk_ref(ref, 10, n_valid), "picks")


@needs_triton
def test_triton_rejects_bad_launch():
    from kernels.indexer import indexer_scores
    q, w, k = torch.randn(1, 1, 4, 32, device=DEV), torch.randn(1, 1, 4, device=DEV), torch.randn(1, 8, 32, device=DEV)
    with pytest.raises(ValueError, match="out must be"):
        indexer_scores(q, w, k, out=torch.empty(1, 1, 7, device=DEV))
    with pytest.raises(ValueError, match="block_n"):
        indexer_scores(q, w, k, block_n=10)
    with pytest.raises(ValueError, match="contiguous"):
        indexer_scores(q, w, torch.randn(1, 32, 8, device=DEV).transpose(1, 2))


# ---- Triton top-k and one-launch selection under the interpreter (issue 14) --------------------------------

@needs_triton
@pytest.mark.parametrize("n, k", [(1, 4), (7, 4), (40, 8), (40, 40), (33, 50), (100, 16)], ids=lambda v: str(v))
def test_triton_topk_follows_tie_rule(seed, n, k):
    """Same tied rows as the reference's hard-stop test (±0.0, repeated values): the Triton top-k must equal
    the brute-force oracle exactly, order included (output poisoned first); with a NaN and a -inf added (the
    oracle cannot order NaN) it must equal indexer_topk_ref."""
    from kernels.indexer import indexer_topk
    scores = tied_scores(2, 5, n)
    n_valid = torch.randint(0, n + 1, (2, 5))
    n_valid[0, 0], n_valid[1, 4] = 0, n
    out = torch.full((2, 5, k), 123456789, dtype=torch.int64, device=DEV)
    got = indexer_topk(scores.to(DEV), k, n_valid.to(DEV), out=out).cpu()
    assert_equal(got, oracle_topk(scores, k, n_valid), "indexer_topk")
    scores[:, :, n // 2] = float("nan")
    scores[:, 1:, n // 3] = float("-inf")
    got = indexer_topk(scores.to(DEV), k, n_valid.to(DEV)).cpu()
    assert_equal(got, indexer_topk_ref(scores, k, n_valid), "indexer_topk vs indexer_topk_ref (NaN, -inf)")


@needs_triton
def test_triton_topk_chunked_path(seed, monkeypatch):
    """Rows longer than the register tile take the chunked path (re-read per pass); same picks."""
    import kernels.indexer as ix
    monkeypatch.setattr(ix, "TOPK_ROW_IN_REGISTERS", 32)
    scores = tied_scores(1, 3, 100)
    n_valid = torch.tensor([[100, 57, 3]])
    got = ix.indexer_topk(scores.to(DEV), 16, n_valid.to(DEV)).cpu()
    assert_equal(got, oracle_topk(scores, 16, n_valid), "indexer_topk (chunked)")


@needs_triton
def test_triton_topk_guard_without_sync():
    """n_valid outside [0, n]: no host check by default, the row becomes -2 (rejected by sparse_attn's guard);
    check=True raises instead (negative control for the guard's message)."""
    from kernels.indexer import indexer_topk
    scores = torch.randn(1, 2, 10, device=DEV)
    got = indexer_topk(scores, 4, torch.tensor([[11, 3]], device=DEV)).cpu()
    assert (got[0, 0] == -2).all() and got[0, 1, 3] == -1 and (got[0, 1, :3] >= 0).all()
    with pytest.raises(ValueError, match=r"n_valid must lie in \[0, n=10\]"):
        indexer_topk(scores, 4, torch.tensor([[11, 3]], device=DEV), check=True)
    with pytest.raises(ValueError, match="k must be"):
        indexer_topk(scores, -1)
    with pytest.raises(ValueError, match="out must be"):
        indexer_topk(scores, 4, out=torch.empty(1, 2, 4, dtype=torch.int32, device=DEV))


@needs_triton
def test_triton_select_exact_with_ties(seed):
    """One launch (scores + top-k, several programs per row): integer q/k and power-of-two weights give
    exact scores with ties; picks must equal indexer_topk_ref(indexer_scores_ref(...)) bitwise."""
    from kernels.indexer import indexer_select
    q = torch.randint(-2, 3, (2, 3, 4, 32)).to(torch.bfloat16)
    k = torch.randint(-2, 3, (2, 45, 32)).to(torch.bfloat16)
    w = torch.tensor([-1.0, -0.5, 0.5, 1.0])[torch.randint(0, 4, (2, 3, 4))]
    n_valid = torch.tensor([[45, 3, 20], [0, 44, 45]])
    scores = torch.full((2, 3, 45), float("nan"), device=DEV)
    got = indexer_select(q.to(DEV), w.to(DEV), k.to(DEV), 8, n_valid.to(DEV), scores=scores, block_n=16,
                         programs_per_row=2).cpu()
    ref_scores = indexer_scores_ref(q, w, k)
    assert_equal(scores.cpu() + 0.0, ref_scores + 0.0, "indexer_select scores (exact)")
    assert_equal(got, indexer_topk_ref(ref_scores, 8, n_valid), "indexer_select picks")
