"""Model-level benchmark (issue 13): prefill and decode of the first N layers at real DeepSeek-V4 width (H200).

Run: `PYTHONPATH=. python benchmarks/bench_model.py [--quick] [--flash-layers 4,12] [--markdown out.md] [--profile DIR]`

Per layer (issue 27): with two or more depths (`--flash-layers 4,12`, `--pro-layers 2,6`) the report ends with the
slope between the shallowest and the deepest run of each geometry (decode and prefill time per layer, the floor
per layer, the ratio, GPU kernels per layer of an eager triton decode step counted by torch.profiler) and the
full-depth projection (Flash 43 layers, Pro 61): the head and the embedding cancel in the slope.

What is measured (one GPU, bf16 numerics, `weights="quantized"`: FP8 / FP4 codes + ue8m0 scales resident):
  * models: Flash geometry (first `--flash-layers` layers, default 4: ratios 0/0/4/128 = SWA, SWA, CSA, HCA,
    layers 0-2 hash-routed) and Pro geometry (first `--pro-layers`, default 2: ratios 128/128 = HCA, hash-routed).
    Weights are random codes in the on-disk formats, filled in GPU memory (`dsv4.testing.fill_random_quantized_`, no disk): e4m3
    codes ~N(0, 32^2) with one ue8m0 scale per 128x128 block, FP4 bytes uniform (every e2m1 code) with one
    ue8m0 scale per 32 inputs, scales chosen so each weight has std ~ 1/sqrt(in); the rest as `dsv4.tiny`.
  * rows: prefill of 1k and 4k tokens at batch 1 (tokens/s), decode step at 4k context for batch 1 / 8 / 32 (ms
    per step and per layer). Decode states at 4k context are synthetic (random ring, compressed entries and
    indexer keys of the right shapes, position 4096): the reference would need minutes to prefill 32 x 4k.
  * columns: dsv4 reference, dsv4 triton, (with `--batch-invariant`) dsv4 triton in the batch-invariant mode
    (`triton-bi`, issue 25), transformers' DeepseekV4ForCausalLM (eager attention, bf16 weights
    = the exact dequantization of the same codes; batch 1 only: eager attention over 4k x 4k scores at batch 8+
    needs more memory than the GPU has), the floor and each backend's ratio to it.
  * floor: decode = bytes the step must read (every weight that the step touches in its on-disk format: the
    attention / shared-expert / indexer projections, the DISTINCT routed experts the router picked in this step
    (counted by a hook on the gate), router, compressors, hc weights, the head in bf16; plus the KV rows
    attended and the indexer keys scanned) / copy bandwidth (1 GiB device-to-device copy, read + write, in the
    same run). prefill = FLOPs of its GEMMs (projections, experts at top-k, router, compressors, hc mixes,
    attention QK and PV over the selected keys, indexer scores) / bf16 GEMM peak (8192^3 torch.mm in the same run).
  * timing: wall clock around the call with torch.cuda.synchronize() before and after (the user's latency,
    host time included), median of `--reps` calls after `--warmup` calls (the reference's prefill: one warm-up
    and a third of the reps, at least one; the first triton call compiles; the
    first graph-state decode call captures the CUDA graph). The triton decode replays a CUDA graph
    (`Transformer.use_decode_graphs`, max_len = context + 256) unless `--no-graphs`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsv4.config import ModelArgs  # noqa: E402
from dsv4.model import Linear, Transformer  # noqa: E402
from dsv4.testing import fill_random_quantized_  # noqa: E402

CONFIGS = {"flash": ROOT / "fixtures/configs/deepseek_v4_flash.config.json",
           "pro": ROOT / "fixtures/configs/deepseek_v4_pro.config.json"}


# ----------------------------------------------------------------------------------------------- weights
def build(args: ModelArgs, backend: str, seed: int = 0, device: str = "cuda") -> Transformer:
    """The bf16 quantized model on `backend`: "reference", "triton", or "triton-bi" (the triton backend in the
    batch-invariant mode, `Transformer(batch_invariant=True)`, issue 25)."""
    bi = backend == "triton-bi"
    model = Transformer(args, dtype=torch.bfloat16, device=device, backend="triton" if bi else backend,
                        weights="quantized", batch_invariant=bi)
    fill_random_quantized_(model, seed)
    return model.eval()


def synthetic_state(model: Transformer, batch: int, ctx: int, seed: int = 1):
    """A decode state at position `ctx` (a multiple of 128) with random contents in the slots of positions < ctx:
    the graph state of `use_decode_graphs`, else a fixed state of max_len ctx + 256 (the same buffers)."""
    dev = model.device
    g = torch.Generator(device=dev).manual_seed(seed)
    st = model.new_state(batch) if model.decode_graph_max_len else model.new_state(batch, ctx + 256)
    for layer, ls in zip(model.layers, st.layers):
        ls.ring.copy_(torch.randn(ls.ring.shape, device=dev, generator=g))
        a = layer.attn
        if a.compressor is not None:
            ls.entries[:, :ctx // a.ratio] = torch.randn(batch, ctx // a.ratio, a.hd, device=dev, generator=g)
            if a.compressor.overlap:  # slots 0..r-1: the previous full window
                r = a.ratio
                ls.compressor.kv[:, :r].normal_(generator=g)
                ls.compressor.score[:, :r].normal_(generator=g)
        if a.indexer is not None:
            ls.index_keys[:, :ctx // 4] = torch.randn(batch, ctx // 4, a.indexer.head_dim, device=dev, generator=g)
            ls.index_compressor.kv[:, :4].normal_(generator=g)
            ls.index_compressor.score[:, :4].normal_(generator=g)
    st.pos = ctx
    return st


# ----------------------------------------------------------------------------------------------- floors
def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write counted), median of 20."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ts = []
    for i in range(25):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src)
        e1.record()
        torch.cuda.synchronize()
        if i >= 5:
            ts.append(e0.elapsed_time(e1))
    return 2 * src.numel() / (statistics.median(ts) * 1e-3) / 1e9


def gemm_peak() -> float:
    """TFLOP/s of an 8192^3 bf16 torch.mm (fp32 accumulation), median of 20."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ts = []
    for i in range(25):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ b
        e1.record()
        torch.cuda.synchronize()
        if i >= 5:
            ts.append(e0.elapsed_time(e1))
    return 2 * n ** 3 / (statistics.median(ts) * 1e-3) / 1e12


def _lin_bytes(lin: Linear) -> int:
    """On-disk bytes of one linear: codes + scales, or bf16 for a bf16-on-disk weight (fp32 compute too)."""
    if lin.fmt in ("fp8", "fp4"):
        return lin._buffers["weight"].nbytes + lin._buffers["scale"].nbytes
    return lin.codes.numel() * 2


def decode_bytes(model: Transformer, batch: int, ctx: int, distinct: list[int]) -> int:
    """Bytes one decode step must read (see the module docstring); `distinct[i]` = routed experts picked."""
    a = model.args
    total = _lin_bytes(model.head) + batch * a.dim * 2
    for layer, n_exp in zip(model.layers, distinct):
        at = layer.attn
        mods = [at.wq_a, at.wq_b, at.wkv, at.wo_a, at.wo_b, layer.ffn.shared_experts.w1,
                layer.ffn.shared_experts.w2, layer.ffn.shared_experts.w3]
        if at.compressor is not None:
            mods += [at.compressor.wkv, at.compressor.wgate]
        if at.indexer is not None:
            mods += [at.indexer.wq_b, at.indexer.weights_proj, at.indexer.compressor.wkv,
                     at.indexer.compressor.wgate]
        total += sum(_lin_bytes(m) for m in mods)
        e0 = layer.ffn.experts[0]
        total += n_exp * sum(_lin_bytes(m) for m in (e0.w1, e0.w2, e0.w3))
        total += layer.ffn.gate.weight.nbytes  # bf16 as on disk (weights="quantized")
        total += 2 * 4 * layer.hc_attn_fn.numel()
        kv_rows = a.window_size
        if at.ratio == 128:
            kv_rows += ctx // 128
        elif at.ratio == 4:
            kv_rows += a.index_topk
            total += batch * (ctx // 4) * a.index_head_dim * 2  # indexer keys scanned
        total += batch * kv_rows * a.head_dim * 2
    return total


def prefill_flops(args: ModelArgs, s: int) -> float:
    """GEMM FLOPs of a batch-1 prefill of s tokens over `args.n_layers` layers (see the module docstring)."""
    d, H, hd = args.dim, args.n_heads, args.head_dim
    f = 0.0
    for i in range(args.n_layers):
        r = args.ratio(i)
        per_tok = (d * args.q_lora_rank + args.q_lora_rank * H * hd + d * hd + H * hd * args.o_lora_rank
                   + args.o_groups * args.o_lora_rank * d
                   + d * args.n_routed_experts
                   + 3 * d * args.moe_inter_dim * (args.n_activated_experts + args.n_shared_experts)
                   + 2 * (2 + args.hc_mult) * args.hc_mult * args.hc_mult * d)
        keys = min(s, args.window_size) * s
        if r:
            c = 2 if r == 4 else 1
            per_tok += 2 * d * c * hd
        if r == 128:
            keys += sum(min(t + 1, s) // 128 for t in range(s))
        if r == 4:
            n_h, d_i = args.index_n_heads, args.index_head_dim
            per_tok += args.q_lora_rank * n_h * d_i + d * n_h + 2 * d * 2 * d_i
            keys += sum(min((t + 1) // 4, args.index_topk) for t in range(s))
            f += 2 * n_h * d_i * sum((t + 1) // 4 for t in range(s))  # indexer scores (causal part)
        f += 2 * per_tok * s + 2 * 2 * H * hd * keys
    return f + 2 * d * args.vocab_size


# ----------------------------------------------------------------------------------------------- timing
def timed(fn, warmup: int, reps: int) -> float:
    """Median seconds of fn() (synchronized wall clock) after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def distinct_experts(model: Transformer, step) -> list[int]:
    """Distinct routed experts each layer's gate picks during one call of `step` (forward hooks)."""
    seen: dict[int, int] = {}
    hooks = [layer.ffn.gate.register_forward_hook(
        lambda m, i, o, lid=layer.layer_id: seen.__setitem__(lid, int(o[1].unique().numel())))
        for layer in model.layers]
    try:
        step()
    finally:
        for h in hooks:
            h.remove()
    return [seen[layer.layer_id] for layer in model.layers]


def bench_dsv4(model: Transformer, prefills: list[int], batches: list[int], ctx: int, warmup: int,
               reps: int, results: dict, tag: str) -> None:
    V = model.args.vocab_size
    for s in prefills:
        ids = torch.randint(0, V, (1, s), device="cuda")
        # the median of `reps` calls after `warmup` (at least one) for the fast backends; the reference (seconds
        # per call) a third of them. One timed call after one warm-up made the 4-layer prefill 1024 point an
        # outlier in several runs (65 ms against 54 ms at 8 layers: a negative per-layer slope).
        slow = tag == "reference"  # seconds per call: one warm-up, a third of the reps (as before 87bed03)
        t = timed(lambda: model(ids, model.new_state(1)), 1 if slow else max(1, warmup),
                  max(1, reps // 3) if slow else max(1, reps))
        results[(tag, "prefill", s)] = t
        print(f"  {tag:10s} prefill {s:5d}: {t * 1e3:9.1f} ms  {s / t:10.0f} tok/s", flush=True)
    for b in batches:
        tok = torch.randint(0, V, (b, 1), device="cuda")
        if ("distinct", b) not in results:  # counted on an eager state (a hook cannot read back in a graph)
            graphs, model.decode_graph_max_len = model.decode_graph_max_len, None
            st = synthetic_state(model, b, ctx)
            results[("distinct", b)] = distinct_experts(model, lambda: model(tok, st))
            model.decode_graph_max_len = graphs
        st = synthetic_state(model, b, ctx)
        t = timed(lambda: model(tok, st), warmup, reps)
        results[(tag, "decode", b)] = t
        print(f"  {tag:10s} decode b={b:3d} @ {ctx}: {t * 1e3:9.2f} ms/step", flush=True)
        del st


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Official-name bf16 state dict with every quantized linear dequantized exactly (same weights), in HOST
    memory: tensor by tensor to the CPU, so the GPU holds the quantized model and transformers' bf16 copy only
    (a GPU-resident dequantized dict as well ran the 4-layer Flash column out of an H200's memory)."""
    sd = {}
    quant = {n for n, m in model.named_modules() if isinstance(m, Linear) and m.fmt in ("fp8", "fp4")}
    for k, v in model.state_dict().items():
        mod = k.rsplit(".", 1)[0]
        if mod in quant:
            if k.endswith(".weight"):
                sd[k] = model.get_submodule(mod).dequantized_weight().to(torch.bfloat16).cpu()
            continue
        sd[k] = v.cpu()
    return sd


def host_free_bytes() -> int:
    """Available host memory in bytes (Linux /proc/meminfo MemAvailable; 0 if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def build_hf(model: Transformer):
    """transformers DeepseekV4ForCausalLM on CUDA in bf16 holding `model`'s weights (dequantized exactly)."""
    from transformers import DeepseekV4ForCausalLM

    from dsv4.hf_adapter import hf_config, to_hf_state_dict

    cfg = hf_config(model.args)
    cfg._attn_implementation = "eager"
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            hf = DeepseekV4ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    hsd = to_hf_state_dict(hf_state_dict(model), model.args)
    own = hf.state_dict()
    hf.load_state_dict({k: v.to(own[k].dtype) if k in own else v for k, v in hsd.items()}, strict=True)
    del hsd
    return hf


def bench_hf(hf, args: ModelArgs, prefills: list[int], ctx: int, warmup: int, reps: int, results: dict) -> None:
    V = args.vocab_size
    with torch.no_grad():
        for s in prefills:
            ids = torch.randint(0, V, (1, s), device="cuda")
            t = timed(lambda: hf(ids, use_cache=True, logits_to_keep=1), 1, max(1, reps // 3))
            results[("transformers", "prefill", s)] = t
            print(f"  transformers prefill {s:5d}: {t * 1e3:9.1f} ms  {s / t:10.0f} tok/s", flush=True)
        ids = torch.randint(0, V, (1, ctx), device="cuda")
        out = hf(ids, use_cache=True, logits_to_keep=1)
        pkv = out.past_key_values
        tok = torch.randint(0, V, (1, 1), device="cuda")
        t = timed(lambda: hf(tok, past_key_values=pkv, use_cache=True), warmup, reps)
        results[("transformers", "decode", 1)] = t
        print(f"  transformers decode b=  1 @ {ctx}: {t * 1e3:9.2f} ms/step", flush=True)


def profile(model: Transformer, ctx: int, prefill: int, out_dir: Path, tag: str) -> None:
    """torch.profiler tables of one decode step (batch 1 @ ctx) and one prefill, sorted by CUDA time."""
    from torch.profiler import ProfilerActivity, profile as tprof
    V = model.args.vocab_size
    st = synthetic_state(model, 1, ctx)
    tok = torch.randint(0, V, (1, 1), device="cuda")
    ids = torch.randint(0, V, (1, prefill), device="cuda")
    for what, fn in (("decode", lambda: model(tok, st)), ("prefill", lambda: model(ids, model.new_state(1)))):
        fn()
        torch.cuda.synchronize()
        with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            fn()
            torch.cuda.synchronize()
        ka = p.key_averages()
        kern = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        n_kernels = len(kern)
        gpu_us = sum(getattr(e, "device_time", getattr(e, "cuda_time", 0.0)) for e in kern)
        launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
        table = ka.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60)
        head = (f"== {tag} {what}: {n_kernels} GPU kernel/memcpy events, {launches} launch calls, "
                f"{gpu_us / 1e3:.2f} ms GPU time ==\n")
        print(head + table[:6000], flush=True)
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"profile_{tag}_{what}.txt").write_text(head + table)


def decode_launches(model: Transformer, batch: int, ctx: int) -> int:
    """GPU kernels (and memcpys) one eager decode step launches (torch.profiler CUDA events; the CUDA graph
    replays the same step, so the same kernels)."""
    from torch.profiler import ProfilerActivity, profile as tprof
    graphs, model.decode_graph_max_len = model.decode_graph_max_len, None
    try:
        st = synthetic_state(model, batch, ctx)
        tok = torch.randint(0, model.args.vocab_size, (batch, 1), device="cuda")
        model(tok, st)
        torch.cuda.synchronize()
        with tprof(activities=[ProfilerActivity.CUDA]) as p:
            model(tok, st)
            torch.cuda.synchronize()
        return sum(1 for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    finally:
        model.decode_graph_max_len = graphs


def _depths(spec) -> list[int]:
    """--flash-layers / --pro-layers: "4" or "4,12" -> [4] / [4, 12] (ValueError on anything else)."""
    try:
        ds = [int(x) for x in str(spec).split(",") if x]
    except ValueError:
        raise ValueError(f"--*-layers={spec!r}: expected comma-separated positive ints, e.g. 4,12") from None
    if not ds or any(d < 1 for d in ds) or len(set(ds)) != len(ds):
        raise ValueError(f"--*-layers={spec!r}: expected distinct positive ints, e.g. 4,12")
    return sorted(ds)


# ----------------------------------------------------------------------------------------------- report
def markdown(results: dict, meta: dict, geometries: dict) -> str:
    bw, peak = meta["copy_GBps"], meta["gemm_TFLOPs"]
    lines = [f"GPU {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, transformers "
             f"{meta['transformers']}, commit {meta['commit']}; copy bandwidth {bw:.0f} GB/s, bf16 GEMM peak "
             f"{peak:.0f} TFLOP/s (both measured in this run).", ""]
    cols = ["reference", "triton"] + (["triton-bi"] if any(k[0].endswith(":triton-bi") for k in results) else []) \
        + ["transformers"]
    lines.append("| geometry | row | " + " | ".join(cols) + " | floor | " + " | ".join(f"{c} / floor" for c in cols)
                 + " | triton speedup vs reference |")
    lines.append("|" + "---|" * (4 + 2 * len(cols)))
    for geo, info in geometries.items():
        for s in info["prefills"]:
            fl = info["prefill_flops"][s] / (peak * 1e12)
            vals = [results.get((f"{geo}:{c}", "prefill", s)) for c in cols]
            cells = [f"{s / v:,.0f} tok/s ({v * 1e3:.0f} ms)" if v else "n/a" for v in vals]
            ratios = [f"{v / fl:.0f}x" if v else "n/a" for v in vals]
            sp = f"{vals[0] / vals[1]:.1f}x" if vals[0] and vals[1] else "n/a"
            lines.append(f"| {info['name']} {info['layers']}L | prefill {s} b=1 | " + " | ".join(cells)
                         + f" | {fl * 1e3:.2f} ms | " + " | ".join(ratios) + f" | {sp} |")
        for b in info["batches"]:
            fl = info["decode_bytes"][b] / (bw * 1e9)
            vals = [results.get((f"{geo}:{c}", "decode", b)) for c in cols]
            L = info["layers"]
            cells = [f"{v * 1e3:.2f} ms ({v * 1e6 / L:.0f} µs/layer)" if v else "n/a" for v in vals]
            ratios = [f"{v / fl:.0f}x" if v else "n/a" for v in vals]
            sp = f"{vals[0] / vals[1]:.1f}x" if vals[0] and vals[1] else "n/a"
            lines.append(f"| {info['name']} {L}L | decode b={b} @ {info['ctx']} | " + " | ".join(cells)
                         + f" | {fl * 1e6:.0f} µs ({info['decode_bytes'][b] / 1e6:.0f} MB, "
                         f"{sum(info['distinct'][b])} experts) | " + " | ".join(ratios) + f" | {sp} |")
    return "\n".join(lines) + "\n"


def slope_markdown(results: dict, meta: dict, geometries: dict) -> str:
    """Per-layer cost (issue 27): for each geometry run at two or more depths, the slope between the shallowest
    and the deepest run (time / floor / launches per layer; the head and embedding cancel) and the full-depth
    projection (time at the shallowest depth + slope x the remaining layers)."""
    bw, peak = meta["copy_GBps"], meta["gemm_TFLOPs"]
    cols = ["reference", "triton", "triton-bi", "transformers"]
    by_name: dict[str, list] = {}
    for geo, info in geometries.items():
        by_name.setdefault(info["name"], []).append((info["layers"], geo, info))
    lines = []
    for name, runs in by_name.items():
        if len(runs) < 2:
            continue
        (la, ga, ia), (lb, gb, ib) = min(runs), max(runs)
        d, full = lb - la, ia["full_layers"]
        if not lines:
            lines += [f"Per layer (slope between {la} and {lb} layers, same run; projection = {la}-layer time + "
                      f"slope x (full depth - {la})):", "",
                      "| geometry | row | backend | per layer | floor per layer | / floor | launches per layer "
                      "| projected full depth |", "|---|---|---|---:|---:|---:|---:|---:|"]
        def slopes(kind: str, key: int):
            """(backend, time at the shallow depth, per-layer slope) for each backend measured at both depths."""
            for c in cols:
                ta, tb = results.get((f"{ga}:{c}", kind, key)), results.get((f"{gb}:{c}", kind, key))
                if ta and tb:
                    yield c, ta, (tb - ta) / d

        for s in ia["prefills"]:
            fl = (ib["prefill_flops"][s] - ia["prefill_flops"][s]) / d / (peak * 1e12)
            for c, ta, per in slopes("prefill", s):
                lines.append(f"| {name} | prefill {s} b=1 | {c} | {per * 1e3:.2f} ms | {fl * 1e3:.2f} ms | "
                                 f"{per / fl:.1f}x | | {(ta + per * (full - la)) * 1e3:.0f} ms ({full}L) |")
        for b in ia["batches"]:
            fl = (ib["decode_bytes"][b] - ia["decode_bytes"][b]) / d / (bw * 1e9)
            la_, lb_ = ia.get("launches", {}).get(b), ib.get("launches", {}).get(b)
            for c, ta, per in slopes("decode", b):
                launches = f"{(lb_ - la_) / d:.0f}" if c == "triton" and la_ and lb_ else ""
                lines.append(f"| {name} | decode b={b} @ {ia['ctx']} | {c} | {per * 1e6:.0f} µs | "
                             f"{fl * 1e6:.0f} µs | {per / fl:.1f}x | {launches} | "
                             f"{(ta + per * (full - la)) * 1e3:.1f} ms ({full}L) |")
    return "\n".join(lines) + "\n" if lines else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="Flash only, prefill 1k, decode b=1,8, fewer reps")
    ap.add_argument("--geometry", default="flash,pro")
    ap.add_argument("--flash-layers", default="4", help="depth(s), comma-separated: two or more give the "
                    "per-layer slope table (issue 27), e.g. 4,12")
    ap.add_argument("--pro-layers", default="2", help="depth(s) of the Pro geometry, as --flash-layers")
    ap.add_argument("--backends", default="reference,triton,transformers")
    ap.add_argument("--prefill", default="1024,4096")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--profile", type=Path, default=None, help="write torch.profiler tables here")
    ap.add_argument("--profile-backends", default="reference,triton", help="backends --profile profiles")
    ap.add_argument("--no-graphs", action="store_true", help="triton decode eagerly (no CUDA graph)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="also the triton backend in the batch-invariant mode (column triton-bi; issue 25)")
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.quick:
        a.geometry, a.prefill, a.batches, a.reps = "flash", "1024", "1,8", 5
    if not torch.cuda.is_available():
        print("bench_model.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import subprocess

    import transformers
    import triton
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip() or os.environ.get("DSV4_COMMIT", "?")
    except OSError:
        commit = os.environ.get("DSV4_COMMIT", "?")
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, commit=os.environ.get("DSV4_COMMIT", commit),
                copy_GBps=copy_bandwidth(), gemm_TFLOPs=gemm_peak())
    print(meta, flush=True)
    prefills = [int(x) for x in a.prefill.split(",") if x]
    batches = [int(x) for x in a.batches.split(",") if x]
    backends = a.backends.split(",") + (["triton-bi"] if a.batch_invariant else [])
    results: dict = {}
    geometries: dict = {}
    runs = [(geo, n) for geo in a.geometry.split(",")
             for n in _depths(a.flash_layers if geo == "flash" else a.pro_layers)]
    for geo_name, n in runs:
        geo = f"{geo_name}-{n}L"
        full = ModelArgs.from_hf_config(CONFIGS[geo_name])
        args = full.with_layers(n)
        print(f"== {geo}: {n} layers, ratios {args.compress_ratios[:n]}", flush=True)
        info = dict(name=geo_name, layers=n, full_layers=full.n_layers, ctx=a.ctx, prefills=prefills,
                    batches=batches, prefill_flops={s: prefill_flops(args, s) for s in prefills})
        model = None
        for be in ("reference", "triton", "triton-bi"):
            if be not in backends:
                continue
            model = build(args, be)
            if be.startswith("triton") and not a.no_graphs:
                model.use_decode_graphs(a.ctx + 256)  # CUDA-graph decode (dsv4/graph.py)
            sub: dict = {}
            bench_dsv4(model, prefills, batches, a.ctx, a.warmup, a.reps, sub, be)
            for k, v in sub.items():
                if k[0] == "distinct":
                    info.setdefault("distinct", {})[k[1]] = v
                else:
                    results[(f"{geo}:{k[0]}",) + k[1:]] = v
            if be == "triton":
                for b in batches:
                    info.setdefault("launches", {})[b] = decode_launches(model, b, a.ctx)
            if a.profile is not None and be in a.profile_backends.split(","):
                profile(model, a.ctx, prefills[0], a.profile, f"{geo}_{be}")
            if be != "triton" or "transformers" not in backends:
                del model
                model = None
                gc.collect()
                torch.cuda.empty_cache()
        if model is None:
            model = build(args, "reference")
        info["decode_bytes"] = {b: decode_bytes(model, b, a.ctx, info.get("distinct", {}).get(
            b, [args.n_activated_experts] * n)) for b in batches}
        info.setdefault("distinct", {b: [0] * n for b in batches})
        hf_bytes = sum(p.numel() * (4 if p.dtype == torch.int8 else 2) for n_, p in model.state_dict().items()
                       if p.dtype in (torch.int8, torch.float8_e4m3fn))
        # build_hf holds the HF model (hf_bytes) on the GPU beside this quantized model (already allocated, so
        # not in the free memory), and the dequantized state dict (hf_bytes) in host memory
        gpu_free, host_free = torch.cuda.mem_get_info()[0], host_free_bytes()
        if "transformers" in backends and (1.15 * hf_bytes > gpu_free or 1.1 * hf_bytes > host_free):
            print(f"  transformers: skipped, bf16 weights {hf_bytes / 2**30:.0f} GiB (+15 % activations) do not fit "
                  f"in {gpu_free / 2**30:.0f} GiB free GPU memory, or their host copy in "
                  f"{host_free / 2**30:.0f} GiB free host memory", flush=True)
        elif "transformers" in backends:
            try:
                hf = build_hf(model)
                del model
                model = None
                gc.collect()
                torch.cuda.empty_cache()
                sub = {}
                bench_hf(hf, args, prefills, a.ctx, a.warmup, a.reps, sub)
                print(f"  transformers peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
                for k, v in sub.items():
                    results[(f"{geo}:{k[0]}",) + k[1:]] = v
                del hf
            except torch.OutOfMemoryError as e:
                print(f"  transformers: out of memory ({str(e)[:200]})", flush=True)
        model = None
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        geometries[geo] = info
    md = markdown(results, meta, geometries) + "\n" + slope_markdown(results, meta, geometries)
    print(md)
    if a.markdown:
        a.markdown.write_text(md)
    if a.json:
        a.json.write_text(json.dumps({"meta": meta, "geometries": geometries,
                                      "results": {"|".join(map(str, k)): v for k, v in results.items()}},
                                     indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
