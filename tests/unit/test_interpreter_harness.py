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
                                           getattr(ti._get_np_dtype, "_dsv4_memo", False)]
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
