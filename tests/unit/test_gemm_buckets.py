"""The triton backend's torch GEMMs at bucketed row counts (issue 29, `kernels.launch.bucketed_gemm`): cuBLAS pays
a per-shape cost on the first call at a new row count, so above 64 rows the backend runs its torch GEMMs at
`gemm_rows(M)` (8 sizes per doubling) and `dsv4.warmup` runs every recorded GEMM at every one of them
(tests/gpu/test_compile_count.py checks a prefill sweep meets only warmed shapes).

Anchors: the definition (M <= gemm_rows(M) <= 9/8 M rounded to a multiple of 8; idempotent), the padded GEMM's
rows equal to the unpadded GEMM's (exact here: an fp64 matmul of integers), and the triton backend's entries at
M > 64 against their references at the dtype tolerance of dsv4.testing."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.launch import GEMM_MIN_ROWS, bucketed_gemm, gemm_buckets, gemm_rows, record_gemms

INTERP = os.environ.get("TRITON_INTERPRET") == "1"


def test_gemm_rows_definition():
    assert [gemm_rows(m) for m in (0, 1, 64)] == [0, 1, 64]
    assert [gemm_rows(m) for m in (65, 72, 73, 128, 129, 1000, 1500, 4096, 4097, 65536)] == \
        [72, 72, 80, 128, 144, 1024, 1536, 4096, 4608, 65536]
    prev = 0
    for m in range(GEMM_MIN_ROWS, 20000):
        r = gemm_rows(m)
        assert m <= r <= m + m // 8 + 8 and r % 8 == 0 and gemm_rows(r) == r and r >= prev, m
        prev = r
    for bad in (-1, 1.5, "3"):
        with pytest.raises(ValueError, match="gemm_rows"):
            gemm_rows(bad)


def test_gemm_buckets_are_every_row_count():
    b = gemm_buckets(65536)
    assert len(b) == 80 and b[0] == 72 and b[-1] == 65536 and b == sorted(set(b))
    assert {gemm_rows(m) for m in range(GEMM_MIN_ROWS, 65537)} == set(b)
    assert gemm_buckets(64) == [] and gemm_buckets(71) == [72] and gemm_buckets(4097) == gemm_buckets(4096) + [4608]


def test_bucketed_gemm_pads_with_zeros_and_drops_the_extra_rows(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-8, 8, (5, 3), generator=g).double()
    seen = []

    def gemm(xp):
        seen.append(xp.clone())
        return xp @ w.T

    for M in (1, 64, 65, 72, 100):
        x = torch.randint(-8, 8, (M, 3), generator=g).double()
        y = bucketed_gemm(gemm, x, "k")
        xp = seen[-1]
        assert xp.shape[0] == gemm_rows(M) and torch.equal(xp[:M], x) and not xp[M:].any()
        assert y.shape == (M, 5) and y.is_contiguous() and torch.equal(y, x @ w.T)


def test_record_gemms_records_each_key_once_and_the_rows():
    x = torch.ones(100, 4)
    with record_gemms() as rec:
        bucketed_gemm(lambda t: t * 2, x, ("a", 1))
        bucketed_gemm(lambda t: t * 3, x[:70], ("a", 1))
        bucketed_gemm(lambda t: t, x[:10], ("b", 2))
        with pytest.raises(ValueError, match="reentrant"):
            record_gemms().__enter__()
    assert list(rec.seen) == [("a", 1), ("b", 2)] and rec.seen[("a", 1)][1:3] == ((4,), torch.float32)
    assert rec.rows == {(("a", 1), 104), (("a", 1), 72), (("b", 2), 10)}
    bucketed_gemm(lambda t: t, x, ("c", 3))  # outside: nothing recorded
    assert ("c", 3) not in rec.seen


@pytest.mark.hardstop  # a kernel entry's fast path against its reference
@pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 (CPU) - CI sets it for the unit run")
@pytest.mark.parametrize("M", [65, 100])
def test_triton_entries_above_64_rows_match_their_references(M, seed):
    """`kernels.gemm.linear` (FP8 codes, act quantization), `grouped_linear` (bmm) and
    `kernels.fp32_linear.fp32_linear_op` (torch.mm in fp32) at M rows, padded to gemm_rows(M), against
    `linear_ref` / `grouped_linear_ref` / `fp32_linear_ref` (bf16: dsv4.testing's bf16 tolerance; fp32 1e-5)."""
    from dsv4.testing import assert_close
    from kernels.fp32_linear import fp32_linear_op, fp32_linear_ref
    from kernels.gemm import grouped_linear, grouped_linear_ref, linear, linear_ref
    from kernels.numerics import fp8_block_quant
    g = torch.Generator().manual_seed(seed)
    w, s = fp8_block_quant(torch.randn(256, 256, generator=g) * 0.05)
    x = torch.randn(M, 256, generator=g).bfloat16()
    with record_gemms() as rec:
        y = linear(x, w, s, 128)
        o = torch.randn(1, M, 2, 128, generator=g).bfloat16()
        wg, sg = fp8_block_quant(torch.randn(2 * 128, 128, generator=g) * 0.05)
        z = grouped_linear(o, wg, sg)
        wf = torch.randn(24, 256, generator=g).bfloat16()
        f = fp32_linear_op(x, wf)
    assert {r for _, r in rec.rows} == {gemm_rows(M)} and len(rec.seen) == 3
    assert_close(y, linear_ref(x, w, s, 128), "linear M>64", dtype=torch.bfloat16)
    assert_close(z, grouped_linear_ref(o, wg, sg), "grouped_linear M>64", dtype=torch.bfloat16)
    assert_close(f, fp32_linear_ref(x, wf), "fp32_linear_op M>64", dtype=torch.float32)
