"""Issue 29 on CPU: a new prompt length, decode position or graph state size must not need a new Triton build.

Under TRITON_INTERPRET=1 nothing compiles, so `kernels.compiles.LaunchLog` records the specialization key each
launch would compile under on the GPU (Triton 3.6's rules: constexprs, ints == 1 and % 16 unless listed in
do_not_specialize, 16-byte pointer alignment; `spec_key`). The tiny model's launches at two prompt lengths in
the same bucket of every launch choice (and two decode positions, and two graph-state max_len) must map onto
the same keys. Negative controls: the log sees a kernel without do_not_specialize take two keys for n = 16
and n = 17, and one key with it. `tests/gpu/test_compile_count.py` counts real compiles on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels.compiles import _int_spec

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1 (the launch log wraps the interpreter)")


def test_int_spec_follows_triton_rules():
    assert _int_spec(1, False, False) == ("constexpr", 1)
    assert _int_spec(16, False, False) == ("i32", "D") and _int_spec(0, False, False) == ("i32", "D")
    assert _int_spec(17, False, False) == ("i32", "")
    assert _int_spec(2 ** 31, False, False) == ("i64", "D")        # strides >= 2^31 change type
    assert _int_spec(1, True, False) == _int_spec(16, True, False) == _int_spec(17, True, False) == ("i32", None)
    assert _int_spec(16, False, True) == ("i32", "")               # do_not_specialize_on_alignment
    try:  # the mirror agrees with the installed Triton's own specialization where it can be asked
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl
    except ImportError:
        return
    for v in (1, 2, 16, 17, 32, 1000, 1001, 2 ** 31):
        for dns in (False, True):
            assert native_specialize_impl(BaseBackend, v, False, not dns, True)[:2] == _int_spec(v, dns, False), v


@needs_interp
def test_launch_log_sees_a_specialized_int():
    """Negative control: without do_not_specialize, n = 16 and n = 17 are two builds; with it, one."""
    import triton
    import triton.language as tl

    from kernels.compiles import LaunchLog

    @triton.jit
    def _probe(x_ptr, n, B: tl.constexpr):
        offs = tl.arange(0, B)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n, other=0.0) + 1.0, mask=offs < n)

    @triton.jit(do_not_specialize=["n"])
    def _probe_dns(x_ptr, n, B: tl.constexpr):
        offs = tl.arange(0, B)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n, other=0.0) + 1.0, mask=offs < n)

    x = torch.zeros(32)
    with LaunchLog() as log:
        for n in (16, 17, 19):
            _probe[(1,)](x, n, B=32)
            _probe_dns[(1,)](x, n, B=32)
        _probe_dns[(1,)](x, 1, B=32)
        _probe_dns[(1,)](x, 17, B=16)  # a new constexpr is a new build
    keys = {k.rsplit(".", 1)[-1]: v for k, v in log.keys.items()}
    assert len(keys["_probe"]) == 2, keys["_probe"]
    assert len(keys["_probe_dns"]) == 2, keys["_probe_dns"]
    assert float(x[0]) > 0  # the kernels ran


def _tiny():
    from dsv4.model import Transformer
    from dsv4.tiny import random_state_dict, tiny_args
    args = tiny_args(vocab_size=512).with_layers(2)  # SWA + CSA (compressor, indexer, top-k): every kernel kind
    m = Transformer(args, backend="triton")
    m.load_weights({k: v for k, v in random_state_dict(args, seed=5).items() if not k.startswith("mtp.")})
    return m


def _keys(fn) -> set:
    from kernels.compiles import LaunchLog
    with LaunchLog() as log:
        fn()
    assert log.launches > 0
    return {(name, k) for name, ks in log.keys.items() for k in ks}


def _diff(a: set, b: set) -> str:
    only = sorted(a ^ b, key=str)[:6]
    return "\n".join(f"{n}: {k}" for n, k in only)


# The fp32-linear GEMV keeps its row count M specialized on purpose (== 1 / % 16 within a row bucket, M <= 64:
# a finite set that `dsv4.warmup` runs length by length), so two prompt lengths <= 64 may differ there only.
ROW_BUCKET_KERNELS = {"kernels.fp32_linear._bf16w_gemv_kernel"}


@pytest.mark.slow
@needs_interp
def test_prefill_and_decode_keys_do_not_depend_on_the_length():
    """Prefill 64 tokens (a multiple of 16; 16 CSA entries) and 37 (odd; 9 entries), each with a decode step: the
    same launch choices (one bucket of each: FP8 decode tiles / GEMV rows 33..64, two-launch mHC, one top-k tile), so the same keys
    (outside ROW_BUCKET_KERNELS). Before issue 29 T, S, N, k and the strides made them differ."""
    m = _tiny()
    g = torch.Generator().manual_seed(0)

    def run(s):
        def f():
            st = m.new_state(1)
            m(torch.randint(0, 512, (1, s), generator=g), st)
            m(torch.randint(0, 512, (1, 1), generator=g), st)
        return f
    a, b = ({x for x in _keys(run(s)) if x[0] not in ROW_BUCKET_KERNELS} for s in (64, 37))
    assert a == b, f"launch specializations differ between prompt lengths 64 and 37:\n{_diff(a, b)}"


@pytest.mark.slow
@needs_interp
def test_graph_step_keys_do_not_depend_on_max_len():
    """The static decode step (what a CUDA graph captures) of states with max_len 256 and 384 (64 / 96 key slots
    of the indexer, one top-k tile): the same keys."""
    m = _tiny()
    g = torch.Generator().manual_seed(1)

    def run(max_len):
        def f():
            st = m.new_state(1, max_len)
            m(torch.randint(0, 512, (1, 5), generator=g), st)
            m(torch.randint(0, 512, (1, 1), generator=g), st)
        return f
    a, b = _keys(run(256)), _keys(run(384))
    assert a == b, f"graph-step specializations differ between max_len 256 and 384:\n{_diff(a, b)}"


def test_warmup_probes_cover_the_kernels_thresholds():
    """Each length at which a launch choice changes (taken from the kernels' constants) has probes on both
    sides in `dsv4.warmup.prefill_probes`, with every residue mod 4 (the FP8 prefill GEMM's M % 4 rule)."""
    from dsv4.warmup import decode_probes, prefill_probes
    from kernels import gemm, indexer, mhc, moe
    probes = set(prefill_probes(65536))
    assert set(range(1, gemm.GEMV_MAX_M + 5)) <= probes and mhc.ONE_LAUNCH_MAX_T + 1 in probes
    assert {gemm.DECODE_TILES_MIN_M - 1, gemm.DECODE_TILES_MIN_M} <= probes  # the GEMV / decode tiles switch
    topk = 6  # routed experts per token (Flash and Pro)
    tokens = {moe.GEMV_MAX_PAIRS // topk, moe.TILES_SMALL_MAX_PAIRS // topk, 1024}  # 1024: mhc PREFILL_TILES_LONG
    for E in (256, 384):  # the large MoE tiles follow the pairs per expert (Flash, Pro)
        with_e = set(prefill_probes(65536, E, topk))
        assert probes <= with_e
        for t in moe.tile_thresholds(E, topk):
            assert {t - 1, t} <= with_e and len({x % 4 for x in range(t - 2, t + 6)} & {x % 4 for x in with_e}) == 4
        assert {1365, 1366, 2730, 2731} <= with_e if E == 256 else {2048, 2049, 4096, 4097} <= with_e
    tokens |= {4 * b for b in indexer.TOPK_BLOCKS[:-1]} | {4 * w for w in indexer.TOPK_SORT_WIDTHS}
    for t in sorted(tokens):
        below, above = {t - 1, t - 2, t - 3, t - 4} & probes, {t, t + 1, t + 2, t + 3, t + 4, t + 5} & probes
        assert len({x % 4 for x in below | above}) == 4 and below and above, f"threshold {t}: {below}, {above}"
    assert 65536 in probes and max(decode_probes(65536)) == 65532
    assert max(prefill_probes(300)) == 300 and max(decode_probes(300)) == 296
