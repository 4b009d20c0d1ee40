"""Speculative decoding at Flash width (issue 26 item 5): tokens/s at batch 1, plain greedy against speculative
greedy with the oracle drafter (the model's own greedy continuation: every draft accepted, the upper bound) and
with the MTP block (random weights: its drafts are random, so its acceptance and speed mean nothing about the
trained model; the row shows what a verify round costs when drafts are rejected, plus the drafter's own cost).

Run: `PYTHONPATH=. python benchmarks/bench_speculative.py [--layers 4] [--prompt 1024] [--tokens 128]
      [--ks 1,2,3,4] [--no-graphs] [--markdown out.md]`

Setup: Flash geometry (first `--layers` layers), bf16, `weights="quantized"` (random codes, as bench_model),
triton backend, CUDA-graph decode (`use_decode_graphs`; the verify steps replay their own captures, `dsv4.graph`)
unless --no-graphs. Timing: wall clock of the whole call (prefill included) with a synchronize around it, one
warm-up call first (captures, compiles); the decode part = the call minus the prefill of the same prompt timed
alone (median of 3). Every speculative run's tokens are compared with plain greedy's (equal up to bf16 near-ties:
the count of differing positions is reported, not hidden).

The oracle: on random weights at Flash width the top two logits are often within bf16 rounding, so a verify step
(k + 1 positions rounded in another order than one-token steps) can pick the other token of a near-tie; after
that the plain greedy continuation no longer follows the context and no draft would be accepted. The oracle is
therefore the speculative decoder's own output, iterated to a fixed point (the run's tokens with the previous
run's output as drafts, until they repeat; the re-runs are printed): every draft accepted, the upper bound.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_model import CONFIGS  # noqa: E402
from dsv4.config import ModelArgs  # noqa: E402
from dsv4.model import STATE_GRAIN, Transformer  # noqa: E402
from dsv4.speculative import ContinuationDrafter, MTPDrafter, speculative_greedy  # noqa: E402
from dsv4.testing import fill_random_quantized_  # noqa: E402


def wall(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


@torch.no_grad()
def plain_greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding, batch 1: the prefill, then n - 1 one-token steps (argmax read each step)."""
    dev = model.device
    st = model.new_state(1)
    logits = model(torch.tensor([prompt], device=dev), st)
    out = [int(logits[0].argmax(-1))]
    while len(out) < n:
        logits = model(torch.tensor([[out[-1]]], device=dev), st)
        out.append(int(logits[0].argmax(-1)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--markdown", type=Path, default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_speculative.py needs a CUDA GPU", file=sys.stderr)
        return 2
    ks = [int(x) for x in a.ks.split(",") if x]
    args = ModelArgs.from_hf_config(CONFIGS["flash"]).with_layers(a.layers)
    model = Transformer(args, dtype=torch.bfloat16, device="cuda", backend="triton", weights="quantized", mtp=True)
    fill_random_quantized_(model, 0)
    model.eval()
    max_len = -(-(a.prompt + a.tokens + max(ks) + 1) // STATE_GRAIN) * STATE_GRAIN
    if not a.no_graphs:
        model.use_decode_graphs(max_len)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, args.vocab_size, (a.prompt,), generator=g).tolist()
    n = a.tokens
    ids = torch.tensor([prompt], device="cuda")
    model(ids, model.new_state(1))
    t_prefill = statistics.median(wall(lambda: model(ids, model.new_state(1)))[0] for _ in range(3))
    plain_greedy(model, prompt, n)  # warm-up (captures the one-token step)
    t_plain, ref = wall(lambda: plain_greedy(model, prompt, n))
    rows = [("plain greedy", None, t_plain, 1.0, 0)]
    print(f"prefill {a.prompt}: {t_prefill * 1e3:.1f} ms; plain greedy {n} tokens: {t_plain * 1e3:.1f} ms", flush=True)
    oracles: dict[int, list[int]] = {}
    for k in ks:  # the oracle: the speculative decoder's own greedy continuation (a fixed point, see below)
        cont = ref
        for it in range(6):
            out = speculative_greedy(model, prompt, ContinuationDrafter(len(prompt), cont), k=k, max_tokens=n).ids
            if out == cont:
                break
            cont = out
        oracles[k] = cont
        print(f"oracle k={k}: fixed point after {it} re-runs", flush=True)
    for name, make in (("oracle", lambda k: ContinuationDrafter(len(prompt), oracles[k])),
                       ("MTP (random weights)", lambda k: MTPDrafter(model))):
        for k in ks:
            speculative_greedy(model, prompt, make(k), k=k, max_tokens=n)  # warm-up (the s = k + 1 capture)
            t, res = wall(lambda: speculative_greedy(model, prompt, make(k), k=k, max_tokens=n))
            diff = sum(x != y for x, y in zip(res.ids, ref)) + abs(len(res.ids) - len(ref))
            rows.append((name, k, t, res.mean_accepted_length, diff))
            print(f"{name} k={k}: {t * 1e3:.1f} ms, mean accepted length {res.mean_accepted_length:.2f}, "
                  f"{diff} tokens differ from plain greedy", flush=True)
    dec_plain = t_plain - t_prefill
    lines = [f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; Flash {a.layers} layers, bf16, "
             f"weights=quantized, triton, {'eager' if a.no_graphs else 'CUDA-graph'} decode, batch 1, prompt "
             f"{a.prompt}, {n} tokens; prefill {t_prefill * 1e3:.1f} ms (subtracted).", "",
             "| drafter | k | ms (decode part) | tokens/s | speed-up vs plain | mean accepted length "
             "| tokens differing from plain |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, k, t, mal, diff in rows:
        dec = t - t_prefill
        lines.append(f"| {name} | {k or ''} | {dec * 1e3:.1f} | {n / dec:.0f} | {dec_plain / dec:.2f}x | "
                     f"{mal:.2f} | {diff} |")
    md = "\n".join(lines) + "\n"
    print(md)
    if a.markdown:
        a.markdown.write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
