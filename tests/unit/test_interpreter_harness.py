"""The root conftest's interpreter speed-up (`conftest._skip_nested_lang_patch`) changes no result: a kernel that
calls nested `@triton.jit` helpers (from its own module and from kernels/) computes what torch computes, the
language modules are restored after the launch (no patched builtin leaks out of it), and a failing launch leaves
the bookkeeping clean for the next one."""

from __future__ import annotations

import os
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the speed-up patches the interpreter (TRITON_INTERPRET=1)")


from kernels.jit_formats import round_bf16  # noqa: E402  (a nested helper from another module)


@triton.jit
def _twice(x):
    return x + x


@triton.jit
def _nested_kernel(x_ptr, y_ptr, n, B: tl.constexpr):
    offs = tl.program_id(0) * B + tl.arange(0, B)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(y_ptr + offs, round_bf16(_twice(_twice(x)) - x), mask=m)


@triton.jit
def _reduce_kernel(x_ptr, y_ptr, B: tl.constexpr):  # tl.sum / tl.max / tl.zeros: triton.language.standard's
    x = tl.load(x_ptr + tl.program_id(0) * B + tl.arange(0, B))  # helpers, which see `core`, not `tl`
    acc = tl.zeros([B], dtype=tl.float32)
    for _ in range(3):
        acc += _twice(x) - tl.max(x, axis=0)
    tl.store(y_ptr + tl.program_id(0), tl.sum(acc, axis=0) + tl.max(acc, axis=0))


@triton.jit
def _failing_kernel(x_ptr, B: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, B), _twice(tl.load(x_ptr + tl.arange(0, B))) + undefined_name)  # noqa: F821


def _builtins_unpatched() -> bool:
    return all(getattr(f, "__triton_builtin__", False) for f in (tl.program_id, tl.load, tl.store, tl.where,
                                                                  tl.arange, tl.core.tensor.__add__))


def test_nested_helpers_compute_and_the_language_is_restored():
    import conftest
    assert conftest._interpreter_patch, "the root conftest did not try its interpreter patch"
    ti = sys.modules["triton.runtime.interpreter"]
    assert conftest._interpreter_patch == [getattr(ti._patch_lang, "_dsv4_skip_nested", False),
                                           getattr(ti._get_np_dtype, "_dsv4_memo", False),
                                           getattr(ti.InterpreterBuilder.create_dot, "_dsv4_rowwise", False)]
    if conftest._interpreter_patch[1]:  # the memoized dtype table answers what the original function does
        original = ti._get_np_dtype._dsv4_original
        scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64,
                   tl.float16, tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e5b16, tl.float8e4nv,
                   tl.float8e4b8, tl.float8e4b15]
        kinds = scalars + [tl.pointer_type(t) for t in scalars] + [tl.block_type(t, [2, 4]) for t in scalars] + [
            tl.block_type(tl.pointer_type(tl.float32), [8])]
        for _ in range(2):  # filling the table, then from it
            for t in kinds:
                assert ti._get_np_dtype(t) == original(t), t
        for bad in (tl.void, tl.block_type(tl.void, [2])):  # not in the original's table: its KeyError, each time
            for _ in range(2):
                with pytest.raises(KeyError):
                    ti._get_np_dtype(bad)
    assert _builtins_unpatched()
    x = torch.randn(37)
    y = torch.empty_like(x)
    _nested_kernel[(3,)](x, y, 37, B=16)
    assert torch.equal(y, (3 * x).bfloat16().float()), "a kernel with nested helpers computed a wrong value"
    assert _builtins_unpatched(), "a patched language builtin leaked out of the launch"
    with pytest.raises(Exception, match="undefined_name"):
        _failing_kernel[(1,)](torch.ones(16), B=16)
    assert _builtins_unpatched(), "a failing launch left the language patched"
    _nested_kernel[(3,)](x, y, 37, B=16)  # the next launch patches and computes again
    assert torch.equal(y, (3 * x).bfloat16().float())


def test_standard_library_helpers_compute_in_every_launch():
    """tl.sum / tl.max / tl.zeros are nested jit helpers whose module sees `triton.language.core` (the kernel's
    sees `tl`): the first such call of a launch patches `core`, the next ones skip the walk - each launch, each
    program, still computes the reduction."""
    for _ in range(2):  # two launches: the second starts from a fresh bookkeeping entry
        x = torch.randn(3, 16)
        y = torch.empty(3)
        _reduce_kernel[(3,)](x, y, B=16)
        acc = 3 * (2 * x - x.max(dim=1, keepdim=True).values)
        torch.testing.assert_close(y, acc.sum(1) + acc.max(1).values, rtol=1e-6, atol=1e-5)
    assert _builtins_unpatched()


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    a = tl.load(a_ptr + tl.arange(0, M)[:, None] * K + tl.arange(0, K)[None, :])
    b = tl.load(b_ptr + tl.arange(0, K)[:, None] * N + tl.arange(0, N)[None, :])
    tl.store(c_ptr + tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :], tl.dot(a, b, input_precision="ieee"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_interpreter_dot_row_depends_on_its_own_row_only(dtype):
    """`conftest._rowwise_dot`: in the interpreter's tl.dot, a row of the product is the same bits wherever it sits
    in the tile (16 copies of one row give 16 equal rows; numpy's BLAS on an AVX-512 machine gave two different
    ones), and the product is the product: within fp32 rounding of the fp64 one (K = 64 terms at scales 2^-8..2^8,
    relative to the row's largest |term| sum), for fp32 tiles and for fp8 tiles (widened to fp16 by the original's
    rule)."""
    import conftest
    ti = sys.modules["triton.runtime.interpreter"]
    if not conftest._interpreter_patch[2]:
        pytest.skip("this interpreter has no create_dot / _convert_float to patch")
    assert ti.InterpreterBuilder.create_dot._dsv4_rowwise
    M, K, N = 16, 64, 32
    row = torch.randn(1, K) * 2.0 ** torch.randint(-8, 9, (1, K))
    b = torch.randn(K, N)
    if dtype is not torch.float32:
        row, b = row.clamp(-400, 400).to(dtype), b.to(dtype)
    a = row.repeat(M, 1)
    c = torch.empty(M, N)
    _dot_kernel[(1,)](a, b, c, M=M, K=K, N=N)
    assert torch.equal(c, c[:1].expand(M, N)), "a row of the interpreter's dot depends on its place in the tile"
    ref = a.double() @ b.double()
    scale = (a.double().abs() @ b.double().abs())
    assert ((c.double() - ref).abs() <= 2.0 ** -20 * scale).all(), "the interpreter's dot is not the product"
