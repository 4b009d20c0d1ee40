"""Serving shapes at Flash width (issue 24 item 5): ragged decode and chunked prefill, triton backend, bf16,
`weights="quantized"` (random codes), the first `--layers` layers (default 4) of the Flash geometry, one GPU.

Run: `PYTHONPATH=. python benchmarks/bench_ragged.py [--layers 4] [--markdown out.md]`

Rows:
  * ragged decode at batch 8 and 32: rows spread evenly over positions 1k..16k (`DecodeState.row_pos`), against a
    lockstep batch whose rows all sit at the spread's mean position; CUDA-graph replays (`use_decode_graphs`),
    ms per step and tokens/s (median of `--reps` steps after `--warmup`). States are synthetic (random keys,
    entries and indexer keys in the slots, as `bench_model.synthetic_state`): the ratio ragged / lockstep is the
    cost of per-row positions, the byte floor of one step is `bench_model.py`'s.
  * a verify step of 1 / 2 / 4 / 8 tokens per row (the decode step with s tokens, one CUDA graph per s) at batch
    1 and context 4096: ms, and the ratio to the one-token step (the cost of checking k = s - 1 drafts).
  * chunked prefill of 16k tokens in 2k chunks (8 appended calls, `Attention.extend`) against one 16k prefill,
    fresh states, each timed on its second run (the first compiles nothing after the first shapes but allocates).
Timing: wall clock with torch.cuda.synchronize() before and after each call (the user's latency).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_model import (CONFIGS, build, copy_bandwidth, decode_bytes, distinct_experts,  # noqa: E402
                                    synthetic_state, timed)
from dsv4.config import ModelArgs  # noqa: E402


def _time(fn, warmup: int, reps: int) -> float:
    """Median ms of fn() (`bench_model.timed`: synchronized wall clock after `warmup` calls)."""
    return timed(fn, warmup, reps) * 1e3


def ragged_rows(model, batch: int, lo: int, hi: int, ragged: bool, warmup: int, reps: int) -> float:
    st = synthetic_state(model, batch, hi)
    spread = [lo + (hi - lo) * i // max(1, batch - 1) for i in range(batch)]
    st.row_pos = spread if ragged else [sum(spread) // batch] * batch
    tok = torch.randint(0, model.args.vocab_size, (batch, 1), device="cuda")
    return _time(lambda: model(tok, st), warmup, reps)


def floor_ms(model, batch: int, ctx: int, gbps: float) -> float:
    """The step's byte floor (bench_model.decode_bytes at context ctx: the KV / indexer bytes are linear in each
    row's context, so a ragged batch's floor is the lockstep floor at the rows' mean context) / copy bandwidth;
    the distinct routed experts counted by a gate hook on one eager step."""
    graphs, model.decode_graph_max_len = model.decode_graph_max_len, None
    try:
        st = synthetic_state(model, batch, ctx)
        tok = torch.randint(0, model.args.vocab_size, (batch, 1), device="cuda")
        distinct = distinct_experts(model, lambda: model(tok, st))
    finally:
        model.decode_graph_max_len = graphs
    return decode_bytes(model, batch, ctx, distinct) / (gbps * 1e9) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--markdown", type=Path)
    a = ap.parse_args()
    args = ModelArgs.from_hf_config(CONFIGS["flash"]).with_layers(a.layers)
    model = build(args, "triton")
    lo, hi = 1024, 16384
    model.use_decode_graphs(hi + 256)
    gbps = copy_bandwidth()
    lines = [f"Flash geometry, first {a.layers} layers, bf16, weights=quantized, triton, CUDA-graph decode; "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth {gbps:.0f} GB/s", "",
             "| decode | batch | rows at | ms / step | tokens/s | ragged / lockstep | byte floor ms | / floor |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for b in (8, 32):
        lock = ragged_rows(model, b, lo, hi, False, a.warmup, a.reps)
        rag = ragged_rows(model, b, lo, hi, True, a.warmup, a.reps)
        mean = (lo + hi) // 2
        fl = floor_ms(model, b, mean // 128 * 128, gbps)
        lines.append(f"| lockstep | {b} | all at ~{mean} | {lock:.2f} | {b / lock * 1e3:.0f} | | {fl:.2f} | "
                     f"{lock / fl:.2f} |")
        lines.append(f"| ragged | {b} | {lo}..{hi} | {rag:.2f} | {b / rag * 1e3:.0f} | {rag / lock:.3f} | "
                     f"{fl:.2f} | {rag / fl:.2f} |")
        print(lines[-2], lines[-1], sep="\n", flush=True)
    lines += ["", "| verify step (graph), batch 1, context 4096 | ms | / one-token step |", "|---|---:|---:|"]
    one = None
    for k1 in (1, 2, 4, 8):  # a step of k + 1 tokens per row: what a speculative verify of k drafts costs
        st = synthetic_state(model, 1, 4096)
        tok = torch.randint(0, model.args.vocab_size, (1, k1), device="cuda")

        def step():
            model(tok, st)
            st.pos = 4096  # stay at the same context (the step writes the same slots again)
        t = _time(step, a.warmup, a.reps)
        one = one or t
        lines.append(f"| {k1} token(s) | {t:.2f} | {t / one:.2f} |")
        print(lines[-1], flush=True)
    model.use_decode_graphs(None)
    n, chunk = 16384, 2048
    ids = torch.randint(0, args.vocab_size, (1, n), device="cuda")

    def one():
        model(ids, model.new_state(1, n))

    def chunked():
        st = model.new_state(1, n)
        for p in range(0, n, chunk):
            model(ids[:, p:p + chunk], st)

    t_one, t_chunk = _time(one, 1, 3), _time(chunked, 1, 3)
    lines += ["", "| prefill 16384 tokens | ms | tokens/s | / one prefill |", "|---|---:|---:|---:|",
              f"| one call | {t_one:.1f} | {n / t_one * 1e3:.0f} | 1.000 |",
              f"| 8 chunks of 2048 | {t_chunk:.1f} | {n / t_chunk * 1e3:.0f} | {t_chunk / t_one:.3f} |"]
    text = "\n".join(lines)
    print(text)
    if a.markdown:
        a.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
