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


# ---- Hadamard rotation + FP4 rounding in one launch (spec §7.1-7.3) ------------------------------------------

def _rotate_input(shape, gen, nan_row: bool = True):
    """bf16 x whose rows span many binades (row scale 2^-24..2^23: the FP4 block scale differs row to row) and
    whose elements span 2^-3..2^3 within a row; one all-zero row (the amax floor) and, if asked, one row holding a
    NaN (the whole output row must be NaN: every output channel sums every input)."""
    x = torch.randn(shape, generator=gen) * 2.0 ** torch.randint(-3, 4, shape, generator=gen)
    x = x * 2.0 ** torch.randint(-24, 24, (*shape[:-1], 1), generator=gen)
    flat = x.view(-1, shape[-1])
    if flat.shape[0] > 2:
        flat[1] = 0.0
    if nan_row:
        flat[-1, 3] = float("nan")
    return x.to(torch.bfloat16)


def _fp4_levels(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Signed e2m1 level index (-7..7, -6 -> -7, 0 -> 0, 6 -> 7) of v / s; v, s fp32; NaN where v / s is not on the
    e2m1 grid (a value of another block scale)."""
    grid = torch.tensor([-6.0, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6])
    q = v / s
    lvl = torch.searchsorted(grid, q.clamp(-6, 6).contiguous()).float() - 7
    return torch.where(torch.isin(q, grid), lvl, float("nan"))


def assert_fp4_within_one_code(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, name: str) -> None:
    """`got` vs `ref = rotate_fp4_ref(x)`. Tolerance: the kernel sums the n products of the rotation in another fp32
    order than the reference's matmul (and, at n = 32 / 128, scales the sum once by the inexact fp32 1/sqrt(n)
    instead of every product), so the fp32 value can differ by a few ulps; that changes its bf16 rounding only near a
    bf16 rounding boundary (one bf16 ulp), and a bf16 ulp moves the FP4 rounding only near an e2m1 midpoint: at most
    ONE e2m1 code of the block, in a small fraction of elements. So: NaN exactly where the reference has NaN,
    >= 99% of the other elements bitwise equal, every differing one at most one e2m1 level from the reference's at
    the block scale of the reference's bf16 intermediate (a value of another scale fails)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype == torch.bfloat16, f"{name}: {got.shape} {got.dtype}"
    got, ref, x = got.cpu(), ref.cpu(), x.cpu()
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan), f"{name}: NaN positions differ from the reference"
    n = x.shape[-1]
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    z = (x.float() @ (h / n ** 0.5).T).to(torch.bfloat16).float()            # the reference's bf16 intermediate
    from kernels.numerics import FP4_AMAX_FLOOR, ceil_log2
    k = ceil_log2(z.unflatten(-1, (-1, 32)).abs().amax(-1).nan_to_num(0.0).clamp_min(FP4_AMAX_FLOOR) / 6.0)
    s = torch.ldexp(torch.ones(()), k.float()).repeat_interleave(32, -1)
    same = (got.view(torch.int16) == ref.view(torch.int16))[~nan]
    frac = float(same.float().mean()) if same.numel() else 1.0
    assert frac >= 0.99, f"{name}: only {frac:.4f} of the finite elements bitwise equal (>= 0.99 expected)"
    steps = (_fp4_levels(got.float(), s) - _fp4_levels(ref.float(), s)).abs()[~nan]
    assert not bool(torch.isnan(steps).any()), f"{name}: a value off the reference block's e2m1 grid"
    worst = float(steps.max()) if steps.numel() else 0.0
    assert worst <= 1, f"{name}: an element {worst:g} e2m1 codes away"


@needs_triton
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # the interpreter's max of a NaN row
@pytest.mark.parametrize("n", [32, 64, 128])
def test_rotate_fp4_matches_ref(seed, n):
    """One launch vs the torch chain on fresh inputs (several binades, a zero row, a NaN row), shapes [1, 1, n] and
    [3, 5, 4, n] (60 rows: 4 programs, the last one partly masked); poisoning is moot (a fresh output)."""
    from kernels.indexer import rotate_fp4, rotate_fp4_ref
    gen = torch.Generator().manual_seed(seed)
    for shape in ((1, 1, n), (3, 5, 4, n)):
        x = _rotate_input(shape, gen, nan_row=len(shape) > 3)
        got = rotate_fp4(x.to(DEV))
        ref = rotate_fp4_ref(x)
        assert_fp4_within_one_code(got, ref, x, f"rotate_fp4 {shape}")
        if len(shape) > 3:
            assert bool(torch.isnan(got.cpu().view(-1, n)[-1]).all()), "the NaN row must be NaN in every channel"
            assert bool((got.cpu().view(-1, n)[1] == 0).all()), "the zero row must stay zero"


@needs_triton
@pytest.mark.parametrize("n", [64, 256])
def test_rotate_fp4_exact_sums_bitwise(seed, n):
    """Inputs whose rotation is exact in fp32 in any order (bf16 values m * 2^e, |m| <= 255, e in 0..3: the sums
    stay below 2^24; 1/sqrt(n) a power of two for n = 64, 256): no summation-order freedom is left, so the kernel
    must equal the reference BITWISE; this is the check that sees a wrong bf16 rounding (the tolerant comparison
    allows one code, test_rotate_fp4_check_rejects_mutants)."""
    from kernels.indexer import rotate_fp4, rotate_fp4_ref
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randint(-255, 256, (7, 3, n), generator=gen) * 2 ** torch.randint(0, 4, (7, 3, n), generator=gen))
    x = x.float().to(torch.bfloat16)
    assert_equal(rotate_fp4(x.to(DEV)).cpu().view(torch.int16), rotate_fp4_ref(x).view(torch.int16),
                 f"rotate_fp4 exact sums n={n} (bits: the sign of zero too)")


def test_rotate_fp4_ref_is_the_model_chain(seed):
    """`rotate_fp4_ref` is bitwise the model's chain with `dsv4.model.hadamard_matrix` and `dsv4.quant`'s FP4
    simulation (Indexer.select, the indexer Compressor._finish), and its private Sylvester matrix is the model's."""
    from dsv4.model import hadamard_matrix
    from dsv4.quant import fp4_act_quant_sim
    from kernels.indexer import _sylvester, rotate_fp4_ref
    gen = torch.Generator().manual_seed(seed)
    for n in (32, 64, 128, 256):
        assert_equal(_sylvester(n), hadamard_matrix(n), f"Sylvester matrix n={n}")
        x = _rotate_input((2, 3, n), gen)
        chain = fp4_act_quant_sim((x.float() @ hadamard_matrix(n).T).to(torch.bfloat16), 32)
        got = rotate_fp4_ref(x)
        assert torch.equal(got.view(torch.int16), chain.view(torch.int16)), f"rotate_fp4_ref n={n} (bitwise)"


def test_rotate_fp4_check_rejects_mutants(seed):
    """Negative cases: the tolerant comparison rejects a rotation missing its 1/sqrt(n) (a plausible kernel bug);
    the exact-sum bitwise comparison rejects one that skips the bf16 rounding before the FP4 step (fp32 straight
    into the FP4 simulation) and one that truncates instead of rounding to bf16 (the triton interpreter's own
    cast: why the kernel uses `round_bf16`)."""
    from dsv4.model import hadamard_matrix
    from kernels.indexer import rotate_fp4_ref
    from kernels.numerics import fp4_act_quant_sim
    gen = torch.Generator().manual_seed(seed)
    n = 64
    h = hadamard_matrix(n)
    x = _rotate_input((3, 5, 4, n), gen)
    unscaled = fp4_act_quant_sim((x.float() @ (h * n ** 0.5).T).to(torch.bfloat16), 32)
    assert_fp4_within_one_code(rotate_fp4_ref(x), rotate_fp4_ref(x), x, "control: ref vs itself")
    with pytest.raises(AssertionError):
        assert_fp4_within_one_code(unscaled, rotate_fp4_ref(x), x, "mutant: no 1/sqrt(n)")
    x = (torch.randint(-255, 256, (7, 3, n), generator=gen) * 2 ** torch.randint(0, 4, (7, 3, n), generator=gen))
    x = x.float().to(torch.bfloat16)
    z = x.float() @ h.T
    no_bf16 = fp4_act_quant_sim(z, 32).to(torch.bfloat16)
    truncated = fp4_act_quant_sim((z.view(torch.int32) & ~0xFFFF).view(torch.float32), 32).to(torch.bfloat16)
    for name, wrong in (("no bf16 rounding", no_bf16), ("truncated bf16", truncated)):
        with pytest.raises(AssertionError):
            assert_equal(wrong, rotate_fp4_ref(x), f"mutant: {name}")


@needs_triton
@pytest.mark.parametrize("x, match", [
    (torch.zeros(2, 64), r"x must be a bfloat16 tensor.*float32"),
    (torch.zeros(2, 48, dtype=torch.bfloat16), r"power of two in 16\.\.256, got n=48"),
    (torch.zeros(2, 512, dtype=torch.bfloat16), r"power of two in 16\.\.256, got n=512"),
    (torch.zeros(2, 16, dtype=torch.bfloat16), r"multiple of the FP4 block 32, got n=16"),
], ids=["fp32", "n48", "n512", "n16"])
def test_rotate_fp4_rejects_bad_input(x, match):
    from kernels.indexer import rotate_fp4, rotate_fp4_ref
    for fn in (rotate_fp4, rotate_fp4_ref):
        with pytest.raises(ValueError, match=match):
            fn(x.to(DEV))


@needs_triton
def test_rotate_fp4_layouts_and_empty(seed):
    """A non-contiguous x (copied), an empty x (empty result, no launch), one build for any row count."""
    from kernels.indexer import rotate_fp4, rotate_fp4_ref
    gen = torch.Generator().manual_seed(seed)
    x = _rotate_input((4, 6, 32), gen, nan_row=False).transpose(0, 1)
    assert_fp4_within_one_code(rotate_fp4(x.to(DEV)), rotate_fp4_ref(x), x, "rotate_fp4 non-contiguous")
    empty = rotate_fp4(torch.zeros(0, 3, 64, dtype=torch.bfloat16, device=DEV))
    assert empty.shape == (0, 3, 64) and empty.dtype == torch.bfloat16
    if INTERPRET:
        from kernels.compiles import LaunchLog
        with LaunchLog() as log:
            for rows in (1, 16, 17, 33):
                rotate_fp4(torch.ones(rows, 64, dtype=torch.bfloat16))
        keys = {k: v for k, v in log.keys.items() if k.endswith("_rotate_fp4_kernel")}
        assert len(keys) == 1 and len(next(iter(keys.values()))) == 1, keys



@needs_triton
def test_topk_counts_from_positions(seed):
    """`ratio` (issue 27: the decode step passes its positions, no launch computes the counts): the top-k of
    positions p with ratio r equals the top-k with counts min((p + 1) // r, n), in the kernel and the reference;
    positions at, below and past a window boundary and past the last entry. Negative control: (p + 2) // r (an
    entry visible one token early) differs."""
    from kernels.indexer import indexer_topk, indexer_topk_ref
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(2, 3, 9, generator=g)
    pos = torch.tensor([[2, 3, 4], [30, 35, 36]])
    counts = ((pos + 1) // 4).clamp(max=9)
    want = indexer_topk_ref(scores, 4, counts)
    assert torch.equal(indexer_topk_ref(scores, 4, pos, ratio=4), want)
    dev = "cpu" if INTERPRET else "cuda"
    got = indexer_topk(scores.to(dev), 4, pos.to(dev), ratio=4).cpu()
    assert torch.equal(got, want)
    assert not torch.equal(indexer_topk_ref(scores, 4, ((pos + 2) // 4).clamp(max=9)), want)
    with pytest.raises(ValueError, match="ratio"):
        indexer_topk_ref(scores, 4, None, ratio=4)


@needs_triton
@pytest.mark.parametrize("per_row", [False, True], ids=["pos-s", "pos-bs"])
def test_rope_rotate_fp4_is_rope_tail_then_rotate_fp4(seed, per_row):
    """`rope_rotate_fp4` (the indexer query's RoPE inside the rotation kernel, issue 27) is bitwise
    `rotate_fp4(rope_tail_(x))`: rd 64 of n 128 (the tail's pairs rotated at each row's token position, the rows
    [b, s, h] of 2 x 3 x 8 heads spanning program blocks of 16 rows), positions [s] or [b, s]; the rotation is
    applied (not the rotation of the unrotated x)."""
    from dsv4.model import rope_inv_freq
    from dsv4.tiny import tiny_args
    from kernels.indexer import rope_rotate_fp4, rotate_fp4
    from kernels.rope import rope_tail_
    dev = DEV
    f = rope_inv_freq(tiny_args(rope_head_dim=64, index_head_dim=128), 0, 64).to(dev)
    x = (torch.randn(2, 3, 8, 128) * 3).to(torch.bfloat16).to(dev)
    pos = (torch.tensor([[4, 90, 1000], [7, 8, 9]]) if per_row else torch.tensor([11, 12, 4093])).to(dev)
    got = rope_rotate_fp4(x, pos, f, 64)
    want = rotate_fp4(rope_tail_(x.clone(), pos, f, 64))
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} differ"
    assert not torch.equal(got, rotate_fp4(x)), "the RoPE must change the result"
    with pytest.raises(ValueError, match=r"rope_rotate_fp4: pos must be contiguous int64 \[3\] or \[2, 3\]"):
        rope_rotate_fp4(x, pos.int(), f, 64)
    with pytest.raises(ValueError, match=r"rope_rotate_fp4: rd=130, expected an even int in 2..128"):
        rope_rotate_fp4(x, pos, f, 130)


@needs_triton
def test_indexer_scores_scaled_is_the_product_then_the_scores(seed):
    """`indexer_scores_scaled` (the head-weight scale of spec §7.2 inside the scoring kernel, issue 27) is bitwise
    `indexer_scores(q, w * scale, k)` with the model's bf16 product (fp32 maths, one rounding): w of varied
    magnitude so the rounding of the product matters (an unrounded product differs), 64 heads x d 128, keys of
    two rows, the scale of Flash (128^-0.5 * 64^-0.5)."""
    from kernels.indexer import indexer_scores, indexer_scores_scaled
    dev = DEV
    q = torch.randn(2, 3, 64, 128).to(torch.bfloat16).to(dev)
    k = torch.randn(2, 40, 128).to(torch.bfloat16).to(dev)
    w = (torch.randn(2, 3, 64) * torch.logspace(-2, 2, 64)).to(torch.bfloat16).to(dev)
    scale = 128 ** -0.5 * 64 ** -0.5
    got = indexer_scores_scaled(q, w, k, scale)
    want = indexer_scores(q, w * scale, k)
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} scores differ"
    unrounded = indexer_scores(q.float(), w.float() * scale, k.float())
    assert not torch.equal(got, unrounded), "negative control: the product's bf16 rounding matters here"
    with pytest.raises(ValueError, match="weight_scale must be None or a finite float > 0, got -1.0"):
        indexer_scores(q, w, k, weight_scale=-1.0)
    with pytest.raises(ValueError, match="weight_scale needs the bf16 weights_proj output"):
        indexer_scores(q.float(), w.float(), k.float(), weight_scale=scale)
    from kernels.indexer import indexer_scores_scaled_ref
    for bad in (2, True, float("nan"), None):
        with pytest.raises(ValueError, match="weight_scale must be"):
            indexer_scores_scaled(q, w, k, bad)
        with pytest.raises(ValueError, match="weight_scale must be"):
            indexer_scores_scaled_ref(q, w, k, bad)


@needs_triton
@pytest.mark.parametrize("sorted_picks", [True, False], ids=["sorted", "unsorted"])
def test_topk_writes_key_slots_into_the_index_tensor(seed, sorted_picks):
    """The CSA decode step's key slots without a `step_index` launch (issue 27): `qkv_finish(index=(W, 0, 0, k))`
    writes the window slots of idx [b, s, W + k] and leaves the k entry columns to `indexer_topk(out=idx[..., W:],
    offset=...)`, which writes each pick as entry + offset (-1 kept; rows of fewer visible entries than k); the
    whole idx then equals `step_index_ref(P, W, picks)`, bitwise (the picks' order as `indexer_topk_ref`'s, or the
    same set ascending without the sort). One token per row at positions of 5 / 40 / 900 visible entries."""
    from dsv4.model import rope_inv_freq
    from dsv4.tiny import tiny_args
    from kernels.attention import step_index_offset, step_index_ref
    from kernels.indexer import indexer_topk
    from kernels.rope import qkv_finish
    dev = DEV
    b, W, k, n = 3, 8, 16, 1024
    P = torch.tensor([[20], [160], [3600]], device=dev)
    scores = torch.randn(b, 1, n, device=dev)
    scores[0, 0, :3] = scores[0, 0, 3]  # ties at the row's top: the lower index first
    f = rope_inv_freq(tiny_args(rope_head_dim=64, index_head_dim=128), 0, 64).to(dev)
    q, kv, w = torch.randn(b, 1, 2, 128, device=dev), torch.randn(b, 1, 128, device=dev), torch.randn(128, device=dev)
    idx = qkv_finish(q, 1e-6, P, f, 64, kv, w, 1e-6, index=(W, 0, 0, k))[2]
    assert idx.shape == (b, 1, W + k)
    got = indexer_topk(scores, k, P, ratio=4, out=idx[..., W:], offset=step_index_offset(W, 1),
                       sorted_picks=sorted_picks)
    assert got.data_ptr() == idx[..., W:].data_ptr()
    picks = indexer_topk_ref(scores, k, P, ratio=4)
    if not sorted_picks:  # the same set in ascending entry order, -1 after
        srt = torch.where(picks >= 0, picks, n + 1).sort(-1).values
        picks = torch.where(srt > n, -1, srt)
    assert torch.equal(idx, step_index_ref(P, W, picks)), "idx vs step_index_ref of the picks"
    assert bool((idx[0, 0, W + 5:] == -1).all()) and bool((idx[2, 0, W:] >= W).all())
    with pytest.raises(ValueError, match="offset=-1, expected an int >= 0"):
        indexer_topk(scores, k, P, ratio=4, offset=-1)
    with pytest.raises(ValueError, match="out must be contiguous int64"):
        indexer_topk(scores, k, P, ratio=4, out=idx[..., W:])
