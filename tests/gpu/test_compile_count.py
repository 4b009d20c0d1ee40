"""Issue 29: after `dsv4.warmup.warmup`, a new prompt length, decode position or batch size builds no Triton kernel.

Counts every Triton compile (`kernels.compiles.CompileLog`: an in-process cache miss of a JIT kernel) across
sweeps of prefill lengths, eager decode positions and batch sizes, CUDA-graph decode states and batched
prefills, at the tiny width (dim 64) and the Flash geometry (first 4 layers, bf16, weights="quantized"), and
fails on any compile after the warm-up, naming the kernel and its specialization. Negative controls: the
counter sees a fresh kernel's compile, a new constexpr, and the divisibility class of a specialized int (and
not that of an int listed in do_not_specialize).

    pytest -q tests/gpu/test_compile_count.py
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.flash_width,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]

ROOT = Path(__file__).resolve().parents[2]
MAX_LEN = {"tiny": 4096, "flash": 20480}
MAX_BATCH = 8


def _model(kind: str):
    from dsv4.config import ModelArgs
    from dsv4.model import Transformer
    from dsv4.testing import fill_random_quantized_
    from dsv4.tiny import tiny_args
    if kind == "tiny":
        args = tiny_args(rope_factor=64.0)  # a context of 64 x 64 = 4096 = MAX_LEN["tiny"] (the model refuses more)
    else:
        args = ModelArgs.from_hf_config(ROOT / "fixtures/configs/deepseek_v4_flash.config.json").with_layers(4)
    m = Transformer(args, dtype=torch.bfloat16, device="cuda", backend="triton", weights="quantized")
    fill_random_quantized_(m, 0)
    return m.eval()


@pytest.fixture(scope="module", params=["tiny", "flash"])
def warm(request):
    """(kind, model, warm-up report): the model after `warmup(max_len=MAX_LEN[kind], max_batch=MAX_BATCH)`."""
    from dsv4.warmup import warmup
    m = _model(request.param)
    rep = warmup(m, max_len=MAX_LEN[request.param], max_batch=MAX_BATCH)
    print(f"\n[{request.param}] {rep}")
    yield request.param, m, rep
    del m


def _ids(m, b: int, s: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, m.args.vocab_size, (b, s), generator=g).cuda()


def _assert_none(log, what: str) -> None:
    assert log.count == 0, f"{what}: {log.count} Triton compiles after the warm-up:\n{log.report()}"


def _lengths(max_len: int) -> list[int]:
    """A spread of prefill lengths: small ones, odd / even / multiples of 16 and a seeded random draw."""
    rng = random.Random(29)
    fixed = [1, 2, 3, 7, 15, 16, 17, 33, 47, 65, 99, 100, 127, 129, 511, 1000, 1001, 1003, 1500, 2048, 2049, 3000,
             4096, 4097, 5000, max_len - 1, max_len]
    return sorted({x for x in fixed if x <= max_len} | {rng.randint(1, max_len) for _ in range(12)})


@pytest.fixture(scope="module")
def prefill_sweep(warm):
    """(kind, model, warm-up report, CompileLog, record_gemms) of one batch-1 prefill sweep after the warm-up: the
    Triton builds and the torch GEMM shapes it met, recorded together."""
    from kernels.compiles import CompileLog
    from kernels.launch import record_gemms
    kind, m, rep = warm
    g = torch.Generator().manual_seed(1)
    with CompileLog() as log, record_gemms() as rec:
        for s in _lengths(MAX_LEN[kind]):
            m(_ids(m, 1, s, g), m.new_state(1))
        torch.cuda.synchronize()
    return kind, m, rep, log, rec


def test_prefill_lengths_compile_nothing(prefill_sweep):
    kind, _, _, log, _ = prefill_sweep
    _assert_none(log, f"[{kind}] prefill sweep")


def test_prefill_lengths_meet_only_warmed_torch_gemms(prefill_sweep):
    """The torch GEMMs (cuBLAS / CUTLASS) of the prefill sweep run only at (shape class, row count) pairs the
    warm-up ran (`kernels.launch.bucketed_gemm`; cuBLAS's first call at a new shape costs 2-16 ms of host time per
    prefill, issue 29). Negative control: against the buckets of a warm-up to 1024 tokens only, the same sweep
    meets new shapes (the check can fail)."""
    from kernels.launch import GEMM_MIN_ROWS, gemm_buckets
    kind, _, rep, _, rec = prefill_sweep
    met = {(k, r) for k, r in rec.rows if r >= GEMM_MIN_ROWS}
    assert met, f"[{kind}] the prefill sweep ran no torch GEMM above {GEMM_MIN_ROWS - 1} rows (the check is blind)"
    new = met - {(k, r) for k in rep.gemm_keys for r in rep.gemm_buckets}
    assert not new, f"[{kind}] torch GEMM shapes the warm-up did not run: {sorted(new, key=str)[:8]}"
    short = {(k, r) for k in rep.gemm_keys for r in gemm_buckets(1024)}
    assert met - short, f"[{kind}] negative control: a 1024-token GEMM warm-up covered the whole sweep"


def test_decode_positions_and_batches_compile_nothing(warm):
    from kernels.compiles import CompileLog
    kind, m, _ = warm
    g = torch.Generator().manual_seed(2)
    with CompileLog() as log:
        for b, s, steps in ((1, 100, 9), (1, 1500, 5), (1, MAX_LEN[kind] - 6, 5), (3, 777, 5), (MAX_BATCH, 260, 5),
                            (5, 31, 3), (2, 2049, 3)):
            st = m.new_state(b)
            m(_ids(m, b, s, g), st)
            for _ in range(steps):
                m(_ids(m, b, 1, g), st)
        torch.cuda.synchronize()
    _assert_none(log, f"[{kind}] eager decode sweep")


def test_graph_decode_states_compile_nothing(warm):
    from kernels.compiles import CompileLog
    kind, m, rep = warm
    if rep.graph.startswith("not available"):
        pytest.skip(f"[{kind}] graph decode {rep.graph}")
    g = torch.Generator().manual_seed(3)
    with CompileLog() as log:
        try:
            for b, max_len, s in ((1, 1024, 40), (MAX_BATCH, 2048, 9), (3, 8192, 130), (1, MAX_LEN[kind], 301)):
                m.use_decode_graphs(max_len)
                st = m.new_state(b)
                m(_ids(m, b, s, g), st)
                for _ in range(3):  # capture, then replays
                    m(_ids(m, b, 1, g), st)
                del st
        finally:
            m.use_decode_graphs(None)
        torch.cuda.synchronize()
    _assert_none(log, f"[{kind}] graph decode states")


def test_batched_prefill_compiles_nothing(warm):
    from kernels.compiles import CompileLog
    kind, m, _ = warm
    g = torch.Generator().manual_seed(4)
    with CompileLog() as log:
        for b, s in ((2, 777), (3, 130), (4, 64), (MAX_BATCH, 33)):
            m(_ids(m, b, s, g), m.new_state(b))
        torch.cuda.synchronize()
    _assert_none(log, f"[{kind}] batched prefill")


# ------------------------------------------------------------------------------------------ negative controls
def test_counter_sees_compiles():
    """The counter is not blind: a fresh kernel compiles once, a new constexpr compiles again, an int's
    divisibility class (16 vs 17) is a new build unless the int is in do_not_specialize."""
    import triton
    import triton.language as tl

    from kernels.compiles import CompileLog

    salt = random.randrange(1 << 30)  # a constexpr value no earlier process compiled (no on-disk cache hit)

    @triton.jit
    def _probe(x_ptr, n, SALT: tl.constexpr, B: tl.constexpr):
        offs = tl.arange(0, B)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n, other=0.0) + SALT, mask=offs < n)

    @triton.jit(do_not_specialize=["n"])
    def _probe_dns(x_ptr, n, SALT: tl.constexpr, B: tl.constexpr):
        offs = tl.arange(0, B)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n, other=0.0) + SALT, mask=offs < n)

    x = torch.zeros(64, device="cuda")
    with CompileLog() as log:
        _probe[(1,)](x, 17, SALT=salt, B=32)
    assert log.count == 1 and "_probe" in log.events[0].name, log.report()
    with CompileLog() as log:
        _probe[(1,)](x, 19, SALT=salt, B=32)       # same class (not 1, not % 16): cached
    assert log.count == 0, log.report()
    with CompileLog() as log:
        _probe[(1,)](x, 16, SALT=salt, B=32)       # n % 16 == 0: a new specialization
        _probe[(1,)](x, 17, SALT=salt, B=64)       # a new constexpr
    assert log.count == 2, log.report()
    assert "n:i32/16" in log.events[0].spec and "B=64" in log.events[1].spec, log.report()
    with CompileLog() as log:
        for n in (1, 16, 17, 32, 33):
            _probe_dns[(1,)](x, n, SALT=salt, B=32)
    assert log.count == 1, f"do_not_specialize: expected one build for every n\n{log.report()}"
    torch.cuda.synchronize()
