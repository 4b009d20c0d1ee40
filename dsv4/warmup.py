"""Warm-up: build every Triton kernel variant a model can need, once, before serving (issue 29).

Triton compiles a kernel per *specialization* (`kernels.compiles`): 1-3 s each on an H200, paid by the first
request that hits it. The kernels take every length, position and batch size as a runtime argument
(`do_not_specialize`) and choose their block sizes from small fixed sets, so the variants a model needs are
finite; `warmup(model)` runs the model once through each of them:

  1. prefill, batch 1, at every length 1..68 (the decode-width paths: the GEMVs' row buckets and the FP8 decode
     tiles from 9 rows, the mHC mix / finish kernels, attention's k-split below 66 queries, every length mod 4) and
     at the lengths around each threshold above that (`prefill_probes`: the MoE tile sizes at 32 / 128 tokens and
     at 32 / 64 pairs per expert, the mHC tile set at 1024, the top-k row tiles at 1024 / 4096 / 16384 tokens,
     its sort widths at 256 / 2048), up to `max_len` (default 65536), with `max_len` itself (where strides reach 2^31 Triton passes them as int64);
  2. eager decode (4 steps, every position mod 4) after the prefill probes of `decode_probes`: the top-k
     buckets of the decode positions, up to `max_len`; and at every batch size 2..`max_batch` (default 32)
     after a prefill of 8 tokens;
  2b. the torch GEMMs (cuBLAS / CUTLASS; prefill-sized linears of more than 64 rows): they run at a bucketed
     row count (`kernels.launch.gemm_rows`: 8 sizes per doubling), and the warm-up runs every shape class at every
     bucket up to `max_len` (80 up to 65536), so cuBLAS's per-shape first-call cost is never a request's;
  3. CUDA-graph decode (`Transformer.use_decode_graphs`), when the model supports it: the static decode step
     (`Transformer.decode_step` run eagerly on a `new_state(b, max_len)`: the launches a capture records) at every batch size
     1..`max_batch` with max_len 1024 (1 and, for the verify steps, 2..`MAX_STEP_TOKENS` tokens per row), and
     at batch 1 for each top-k bucket of the state's max_len (4096, 16384, 65536, capped at `max_len`).

After it, prefill of any length 1..max_len at batch 1, eager decode at any position < max_len and batch
<= max_batch, and graph decode states of any batch <= max_batch and max_len <= max_len build nothing
(`tests/gpu/test_compile_count.py` counts, with `kernels.compiles.CompileLog`). Batched prefill hits the same
variants (every launch choice depends on b*s, s or b alone, each covered), checked there for a few shapes.
Cost (benchmarks/RESULTS.md, issue 29; Flash geometry, 4 layers, H200): about a minute with an empty Triton
cache (~/.triton/cache; the builds), a few seconds when the cache already holds them (a later process).
Outputs are discarded; the model's weights and any other state are not changed. Nothing is skipped
silently: what could not run (graph decode on a model without it) is named in the report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dsv4.config import LimitError
from dsv4.graph import check_graph_model
from dsv4.model import MAX_STEP_TOKENS
from kernels.compiles import CompileLog
from kernels.launch import GEMM_MIN_ROWS, gemm_buckets, record_gemms
from kernels.moe import tile_thresholds

__all__ = ["warmup", "prefill_probes", "decode_probes", "WarmupReport", "DEFAULT_MAX_LEN", "DEFAULT_MAX_BATCH"]

DEFAULT_MAX_LEN = 65536
DEFAULT_MAX_BATCH = 32

# Token counts at which a launch choice changes (prefill, batch 1): kernels.moe GEMV_MAX_PAIRS / TILES_SMALL_MAX_PAIRS
# (6 routed experts a token: 32 and 128 tokens), kernels.mhc PREFILL_TILES_LONG at 1024, the top-k register tiles
# (kernels.indexer.TOPK_BLOCKS: n = T // 4 entries -> 1024, 4096, 16384 tokens) and sort widths (k = T // 4: 256,
# 2048). Each probe takes the lengths around the threshold (every residue mod 4: the FP8 prefill GEMM's path).
_THRESHOLDS = (32, 128, 256, 1024, 2048, 4096, 16384)


def decode_probes(max_len: int = DEFAULT_MAX_LEN) -> list[int]:
    """Prefill lengths after which `warmup` decodes 4 steps at batch 1: each top-k bucket of the decode position
    (entries pos // 4: tiles 256 / 1024 / 4096 / 16384, sort width 64 / 512), the last one ending at max_len - 1."""
    return sorted({x for x in (1, 2, 3, 4, 5, 64, 130, 258, 1029, 2050, 4101, 16389, max_len - 4)
                   if 1 <= x <= max_len - 4})


def prefill_probes(max_len: int = DEFAULT_MAX_LEN, n_experts: int | None = None, topk: int = 6) -> list[int]:
    """The batch-1 prefill lengths `warmup` runs: 1..68, t-2 .. t+5 for each threshold t, the decode probes and
    max_len (where a stride of the attention reaches 2^31 at 64k tokens, Triton passes it as int64). n_experts /
    topk (the model's routed experts and experts per token): also the thresholds of the MoE's large tiles, which
    follow the pairs per expert (`kernels.moe.tile_thresholds`; Flash 1366 / 2731 tokens, Pro 2049 / 4097)."""
    out = set(range(1, 69)) | set(decode_probes(max_len)) | {max_len}
    extra = ()
    if n_experts is not None:
        extra = tuple(tile_thresholds(n_experts, topk))
    for t in _THRESHOLDS + extra:
        out.update(range(t - 2, t + 6))
    return sorted(x for x in out if 1 <= x <= max_len)


@dataclass
class WarmupReport:
    """What `warmup` ran and how long it took (seconds of wall clock, synchronized)."""

    seconds: float = 0.0
    prefill_lengths: list[int] = field(default_factory=list)
    decode_after: list[int] = field(default_factory=list)
    decode_batches: list[int] = field(default_factory=list)
    graph: str = ""
    compiles: int | None = None  # Triton builds during the warm-up (CUDA only; None under the interpreter)
    gemm_keys: list = field(default_factory=list)  # torch GEMM shape classes run at every row bucket (`_gemm_warmup`)
    gemm_buckets: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        c = "" if self.compiles is None else f", {self.compiles} Triton builds"
        return (f"warm-up {self.seconds:.1f} s{c}: prefill at {len(self.prefill_lengths)} lengths "
                f"(1..{max(self.prefill_lengths, default=0)}), eager decode after {len(self.decode_after)} of them "
                f"and at batch sizes {_span(self.decode_batches)}; torch GEMMs: {len(self.gemm_keys)} shapes at "
                f"{len(self.gemm_buckets)} row counts ({_span(self.gemm_buckets)}); graph decode: {self.graph}")


def _span(xs: list[int]) -> str:
    return f"{min(xs)}..{max(xs)}" if xs else "none"


def warmup(model, *, max_len: int | None = None, max_batch: int = DEFAULT_MAX_BATCH, graphs: bool = True,
           log=None) -> WarmupReport:
    """Run `model` (a `dsv4.model.Transformer`, any backend) through every kernel variant it can need for
    prefill lengths 1..max_len at batch 1, decode at any position < max_len and batch 1..max_batch, and (graphs
    and the model supports them) CUDA-graph decode states of batch 1..max_batch (module docstring).

    `max_len` None: DEFAULT_MAX_LEN (65536) or the model's context (original_seq_len x rope_factor) where that is
    smaller. `log`: a callable taking one line (progress), or None. Returns a `WarmupReport` (its `compiles` counts
    the Triton builds on CUDA). Raises ValueError for max_len < 8 or max_batch < 1 (named); LimitError (a
    ValueError) for a max_len over the model's context, which the model refuses to run."""
    ctx = model.args.max_context
    if max_len is None:
        max_len = min(DEFAULT_MAX_LEN, ctx)
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 8:
        raise ValueError(f"warmup: max_len={max_len!r}; expected an int >= 8")
    if max_len > ctx:
        raise LimitError(f"warmup: max_len={max_len} is over the model's context of {ctx} tokens per row "
                         f"(original_seq_len {model.args.original_seq_len} x rope_factor {model.args.rope_factor})")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"warmup: max_batch={max_batch!r}; expected an int >= 1")
    say = log or (lambda line: None)
    rep = WarmupReport()
    dev = model.device
    V = model.args.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)

    def ids(b: int, s: int) -> torch.Tensor:
        return torch.randint(0, V, (b, s), generator=g).to(dev)

    counting = dev.type == "cuda"
    if counting:
        clog = CompileLog().__enter__()
    graph_len = model.decode_graph_max_len
    model.use_decode_graphs(None)  # eager states for 1 and 2; restored at the end
    t0 = time.perf_counter()
    try:
        decode_after = set(decode_probes(max_len))
        for s in prefill_probes(max_len, model.args.n_routed_experts, model.args.n_activated_experts):
            st = model.new_state(1)
            model(ids(1, s), st)
            rep.prefill_lengths.append(s)
            if s in decode_after:
                for _ in range(4):
                    model(ids(1, 1), st)
                rep.decode_after.append(s)
            del st
        say(f"warm-up: prefill probes done ({time.perf_counter() - t0:.1f} s)")
        rep.gemm_keys, rep.gemm_buckets = _gemm_warmup(model, max_len, ids)
        say(f"warm-up: {len(rep.gemm_keys)} torch GEMMs at {len(rep.gemm_buckets)} row counts done "
            f"({time.perf_counter() - t0:.1f} s)")
        for b in range(1, max_batch + 1):
            st = model.new_state(b)
            model(ids(b, 8), st)
            for _ in range(4):
                model(ids(b, 1), st)
            rep.decode_batches.append(b)
            del st
        say(f"warm-up: eager decode batches done ({time.perf_counter() - t0:.1f} s)")
        rep.graph = _graph_warmup(model, max_len, max_batch, ids) if graphs else "not asked (graphs=False)"
        say(f"warm-up: graph decode: {rep.graph} ({time.perf_counter() - t0:.1f} s)")
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    finally:
        model.use_decode_graphs(graph_len)
        if counting:
            clog.__exit__(None, None, None)
    rep.seconds = time.perf_counter() - t0
    rep.compiles = clog.count if counting else None
    return rep


def _gemm_warmup(model, max_len: int, ids) -> tuple[list, list[int]]:
    """The torch GEMMs (cuBLAS / CUTLASS) of a prefill at every row count they can run at up to max_len
    (`kernels.launch.gemm_buckets`, 80 up to 65536): a prefill of GEMM_MIN_ROWS tokens records each shape class
    once (`record_gemms`), then each runs on zero rows at every bucket. cuBLAS's first call at a new shape (kernel
    selection, lazy kernel load) is paid here, never by a request (issue 29). Returns (the shape classes' keys,
    the buckets)."""
    with record_gemms() as rec:
        model(ids(1, GEMM_MIN_ROWS), model.new_state(1))
    buckets = gemm_buckets(max_len)
    for gemm, row_shape, dtype, device in rec.seen.values():
        for m in buckets:
            gemm(torch.zeros((m,) + row_shape, dtype=dtype, device=device))
    return list(rec.seen), buckets


def _graph_warmup(model, max_len: int, max_batch: int, ids) -> str:
    """The decode step on fixed-max_len states (what `dsv4.graph` captures, run eagerly) at every batch size and each top-k
    bucket of the state's max_len. Returns what ran, or why it could not."""
    lens = sorted({min(L, max_len) // 128 * 128 for L in (1024, 4096, 16384, 65536)} - {0})
    try:
        check_graph_model(model, lens[-1])
    except ValueError as e:
        return f"not available ({e})"
    runs = [(b, lens[0]) for b in range(1, max_batch + 1)] + [(1, L) for L in lens[1:]]
    for b, L in runs:
        st = model.new_state(b, L)
        model(ids(b, 8), st)  # the prefill (eager), then static steps at positions 8..11
        for _ in range(4):
            model(ids(b, 1), st)
        if L == lens[0]:  # the verify-sized steps (s tokens per row, captured per s by a graph state)
            for n in range(2, MAX_STEP_TOKENS + 1):
                st.decode_step(model, ids(b, n))
                st.pos = st.pos + n
        del st
    return (f"static step at batch 1..{max_batch} (max_len {lens[0]}; 1..{MAX_STEP_TOKENS} tokens per row) and "
            f"batch 1 at max_len {lens[1:]}")
