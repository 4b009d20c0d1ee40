"""Measured GPU memory and speed of dsv4 at real DeepSeek-V4 width, next to dsv4.memory_plan's prediction.

    python benchmarks/measure_real_width.py --ckpt /tmp/dsv4-flash4 --out OUTDIR [--modes dequantized,quantized]
                                            [--world 1,2] [--decode-steps 8]
    python benchmarks/measure_real_width.py --ckpt synth:pro:61 --world 8 --modes quantized --out OUTDIR

--ckpt takes a directory or a synthetic source `synth:GEOMETRY[:LAYERS[:SEED]]` (dsv4.synth.parse_source: the
tensors are generated on each rank's GPU as it loads them, bitwise those `dsv4 make-checkpoint` writes; "read" and
"load GB/s" then count bytes generated, not read from disk; the report says so).
For each weight mode, at world size 1 (in this process) and each W > 1 of --world (torchrun, when W GPUs are
visible), every rank
loads the checkpoint through `dsv4.parallel.load_parallel_model` (rank-local reads, streamed one tensor at a time,
bf16 numerics, TEST_LAYERS honoured) and records:
    weights      bytes of the rank's state dict (what dsv4.memory_plan models) vs `rank_memory(...).weights`;
                 must agree within 5 % (exit 1 otherwise: fix the plan)
    held / peak  torch.cuda.memory_allocated after the load / max_memory_allocated through load + prefill + decode
                 (minus what was allocated before), vs the plan's peak (weights + per-use dequantization
                 temporary; activations and decode state are not in the plan)
    load         wall time of the load, bytes the rank read from disk (its parts of the shards, from the read
                 plan) and GB/s; the shards' pages are dropped from the page cache first (posix_fadvise
                 DONTNEED; clean pages only, so this is a cold read when the checkpoint was fsync'ed)
    check        time of dsv4.checkpoint.check_values (NaN codes / scale bytes) over every tensor the rank holds
                 as on disk (weights=quantized), i.e. the fail-closed check's cost, as a fraction of the load
    TTFT         prefill of the 11-token seed prompt (chat template ids) to the first greedy token
    decode       median ms per greedy decode step (batch 1) over --decode-steps steps after the first
World size 2 logits (last prefill position) are compared with world size 1: max |dlogit| and greedy agreement.
Writes OUTDIR/real_width.json and OUTDIR/real_width.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPT = [0, 128803, 3085, 344, 270, 6102, 294, 8760, 33, 128804, 128821]  # gold ids of the seed prompt
PLANS = {"dequantized": "bf16", "quantized": "quantized"}
HELD_DT = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0", torch.bfloat16: "BF16",
           torch.float32: "F32"}
GiB = 2 ** 30


def _drop_page_cache(ckpt: Path) -> None:
    from dsv4.synth import is_synth_source

    if is_synth_source(ckpt):  # nothing on disk
        return
    for f in ckpt.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _bytes_read(ckpt: Path, comm, n_layers: int, weights: str) -> int:
    """On-disk bytes of the rank's read plan (its rows / columns of split tensors, its experts, the rest)."""
    from dsv4.checkpoint import DTYPE_BYTES
    from dsv4.parallel import _open_for

    ck, _, plan = _open_for(ckpt, comm, n_layers, weights)
    total = 0
    for name, part in plan.items():
        shape, dt, _ = ck.info(name)
        nb = math.prod(shape) * DTYPE_BYTES[dt]
        total += nb if part is None else nb * part[2] // shape[part[0]]
        if weights == "dequantized" and dt in ("F8_E4M3", "I8"):
            s_shape, s_dt, _ = ck.info(name.removesuffix(".weight") + ".scale")
            total += math.prod(s_shape) * DTYPE_BYTES[s_dt]
    return total


def measure(ckpt: Path, comm, dev: str, weights: str, decode_steps: int) -> dict:
    """One rank, one weight mode: the numbers of the module docstring (bytes, seconds), plus last-position
    prefill logits (float32, CPU) for the world-size comparison."""
    from dsv4.checkpoint import check_values, open_source
    from dsv4.config import layers_from_env
    from dsv4.memory_plan import rank_memory
    from dsv4.parallel import load_parallel_model

    args = open_source(ckpt).args
    n = layers_from_env(args.n_layers)
    plan = rank_memory(args.with_layers(n), comm.world_size, comm.rank, PLANS[weights])
    read = _bytes_read(ckpt, comm, n, weights)
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    _drop_page_cache(ckpt)
    t0 = time.perf_counter()
    model = load_parallel_model(ckpt, comm, n_layers=n, dtype=torch.bfloat16, device=dev, weights=weights)
    torch.cuda.synchronize(dev)
    load_s = time.perf_counter() - t0
    held = torch.cuda.memory_allocated(dev) - base
    sd = model.state_dict()
    state = sum(t.numel() * t.element_size() for t in sd.values())
    check_s = None
    if weights == "quantized":
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for name, t in sd.items():
            if t.dtype in HELD_DT:
                check_values(t, HELD_DT[t.dtype], name, "<held>")
        torch.cuda.synchronize(dev)
        check_s = time.perf_counter() - t0
    ids = torch.tensor([PROMPT], device=dev)
    with torch.no_grad():
        st = model.new_state(1)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        logits = model(ids, st)
        tok = logits.argmax(-1, keepdim=True)
        torch.cuda.synchronize(dev)
        ttft = time.perf_counter() - t0
        last = logits[0].float().cpu() if logits.dim() == 2 else logits[0, -1].float().cpu()
        steps = []
        for _ in range(decode_steps + 1):
            t0 = time.perf_counter()
            tok = model(tok.view(1, 1), st).argmax(-1, keepdim=True)
            torch.cuda.synchronize(dev)
            steps.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del model, sd, st
    torch.cuda.empty_cache()
    return {"world_size": comm.world_size, "rank": comm.rank, "weights": weights, "test_layers": n,
            "weights_bytes": state, "plan_weights_bytes": plan.weights,
            "weights_rel_diff": state / plan.weights - 1, "held_bytes": held, "peak_bytes": peak,
            "plan_peak_bytes": plan.peak, "load_s": load_s, "read_bytes": read, "load_gb_per_s": read / 1e9 / load_s,
            "check_s": check_s, "ttft_ms": ttft * 1e3, "decode_ms_per_step": statistics.median(steps[1:]) * 1e3,
            "decode_steps": decode_steps, "greedy_first": int(last.argmax()), "_logits": last}


def _worker(ckpt: Path, out: Path, modes: list[str], decode_steps: int) -> None:
    from dsv4.parallel import comm_from_env, leave_process_group

    comm, dev = comm_from_env("cuda")
    rows = [measure(ckpt, comm, dev, m, decode_steps) for m in modes]
    torch.save(rows, out / f"w{comm.world_size}.rank{comm.rank}.pt")
    leave_process_group()


def _fmt_table(rows: list[dict]) -> str:
    head = ("| world | rank | weights | weights GiB measured | plan GiB (computed) | diff | held GiB | peak GiB "
            "measured | plan peak GiB | load s | read GB | load GB/s | NaN check s (% of load) | TTFT ms | "
            "decode ms/step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        chk = "n/a" if r["check_s"] is None else f"{r['check_s']:.2f} ({100 * r['check_s'] / r['load_s']:.1f} %)"
        lines.append(f"| {r['world_size']} | {r['rank']} | {r['weights']} | {r['weights_bytes'] / GiB:.2f} | "
                     f"{r['plan_weights_bytes'] / GiB:.2f} | {100 * r['weights_rel_diff']:+.2f} % | "
                     f"{r['held_bytes'] / GiB:.2f} | {r['peak_bytes'] / GiB:.2f} | {r['plan_peak_bytes'] / GiB:.2f} | "
                     f"{r['load_s']:.1f} | {r['read_bytes'] / 1e9:.2f} | {r['load_gb_per_s']:.2f} | {chk} | "
                     f"{r['ttft_ms']:.0f} | {r['decode_ms_per_step']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--modes", default="dequantized,quantized")
    p.add_argument("--world", default="1,2", help="world sizes to measure (W > 1 only when W GPUs are visible)")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in PLANS:
            p.error(f"--modes: {m!r} is not one of {list(PLANS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    if a.worker:
        _worker(a.ckpt, a.out, modes, a.decode_steps)
        return 0
    if not torch.cuda.is_available():
        print("measure_real_width: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from dsv4.checkpoint import open_source, read_index
    from dsv4.parallel import Comm

    worlds = [int(w) for w in a.world.split(",") if w]
    rows: list[dict] = []
    notes: list[str] = []
    if 1 in worlds:
        rows += [measure(a.ckpt, Comm(0, 1), "cuda:0", m, a.decode_steps) for m in modes]
    for w in (w for w in worlds if w > 1):
        if torch.cuda.device_count() < w:
            notes.append(f"world size {w} not measured: {torch.cuda.device_count()} GPU visible")
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(w),
                   __file__, "--worker", "--ckpt", str(a.ckpt), "--out", str(a.out), "--modes", a.modes,
                   "--decode-steps", str(a.decode_steps)]
            pr = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if pr.returncode:
                print(pr.stdout[-4000:], pr.stderr[-8000:], file=sys.stderr)
                notes.append(f"world size {w} failed (rc {pr.returncode}), see stderr")
            else:
                for r in range(w):
                    rows += torch.load(a.out / f"w{w}.rank{r}.pt")
    ref = {r["weights"]: r["_logits"] for r in rows if r["world_size"] == 1}
    for r in rows:
        lg = r.pop("_logits")
        if r["world_size"] > 1 and r["weights"] in ref:
            r["vs_world1_max_abs_dlogit"] = float((lg - ref[r["weights"]]).abs().max())
            r["vs_world1_same_greedy"] = bool(lg.argmax() == ref[r["weights"]].argmax())
    ck = open_source(a.ckpt)
    idx = a.ckpt / "model.safetensors.index.json"
    prov = a.ckpt / "dsv4_synth.json"
    from dsv4.synth import is_synth_source, parse_source, source_provenance

    generated = is_synth_source(a.ckpt)
    meta = {"ckpt": str(a.ckpt), "n_layers_in_ckpt": ck.args.n_layers, "dim": ck.args.dim,
            "total_size": read_index(idx)[1] if idx.is_file() else None,
            "synthetic": source_provenance(parse_source(a.ckpt)) if generated
            else json.loads(prov.read_text()) if prov.is_file() else None,
            "device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                     text=True).stdout.strip() or None, "notes": notes}
    (a.out / "real_width.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    table = _fmt_table(rows)
    extra = [f"- W=2 {r['weights']} rank {r['rank']}: max |dlogit| vs W=1 {r['vs_world1_max_abs_dlogit']:.3g}, "
             f"same greedy token: {r['vs_world1_same_greedy']}" for r in rows if "vs_world1_same_greedy" in r]
    md = (f"Measured on {meta['device']} x{meta['gpus']}, commit {meta['commit']}, torch {meta['torch']}; checkpoint "
          f"{a.ckpt} ({ck.args.n_layers} layers, dim {ck.args.dim}, total_size {meta['total_size']}), "
          f"TEST_LAYERS {rows[0]['test_layers'] if rows else '-'}; bf16, batch 1, 11-token prompt."
          + (" SYNTHETIC weights generated on each rank's GPU at load (no file): read GB and load GB/s count bytes "
             "generated." if generated else "") + "\n\n"
          + table + "\n" + "\n".join(extra + [f"- {n}" for n in notes]) + "\n")
    (a.out / "real_width.md").write_text(md)
    print(md)
    bad = [r for r in rows if abs(r["weights_rel_diff"]) > 0.05]
    if bad:
        print(f"measure_real_width: {len(bad)} row(s) differ from dsv4.memory_plan by more than 5 %: fix the plan",
              file=sys.stderr)
        return 1
    return 0 if not any("failed" in n for n in notes) else 1


if __name__ == "__main__":
    sys.exit(main())
