"""Probe run on the H200 for issue 13 (output quoted in benchmarks/RESULTS.md, "Model-level benchmark"): is a cuBLAS
bf16 GEMM of act-quantized x and exactly dequantized FP8 weights equal to the reference fp32 product rounded to
bf16 (fraction of differing outputs at M = 1 / 8 / 1024), does torch._grouped_mm work on sm_90, and how fast are
the torch dequantizers. Run: `PYTHONPATH=. python benchmarks/probe_gemm_exactness.py` (CUDA).
"""
import statistics

import torch

from dsv4 import quant
torch.manual_seed(0)
dev = "cuda"
def tm(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize(); ts=[]
    for _ in range(n):
        e0=torch.cuda.Event(enable_timing=True); e1=torch.cuda.Event(enable_timing=True)
        e0.record(); fn(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    return statistics.median(ts)*1e3
print("flags reduced-prec", torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
# exactness
for M in (1, 8, 1024):
    x = torch.randn(M, 4096, device=dev).bfloat16()
    xq = quant.act_quant_sim(x, 128)
    w = (torch.randn(2048, 4096, device=dev) * 32).to(torch.float8_e4m3fn)
    s = torch.randint(110, 125, (16, 32), device=dev, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    W32 = quant.fp8_block_dequant(w, s, torch.float32); Wb = W32.bfloat16()
    assert torch.equal(Wb.float(), W32)
    ref = (xq.float() @ W32.T)
    for flag in (True, False):
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = flag
        fast = xq @ Wb.T
        d = (fast.float() - ref.bfloat16().float()).abs(); rel = ((fast.float()-ref).abs()/ref.abs().clamp_min(1e-30))
        print(f"M={M} reduced={flag}: bf16-out differs from ref-rounded in {(d>0).float().mean():.4f} of elements, max rel err vs fp32 {rel.max():.2e}")
    try:
        f32 = torch.mm(xq, Wb.T, out_dtype=torch.float32)
        print("  mm out_dtype fp32 max abs diff vs fp32 ref", (f32-ref).abs().max().item(), "rel", ((f32-ref).abs()/ref.abs().clamp_min(1e-3)).max().item())
    except Exception as e: print("  mm out_dtype:", repr(e)[:200])
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
# grouped mm
G, K, N = 256, 4096, 2048
T = 6144
Wg = torch.randn(G, N, K, device=dev).bfloat16()
A = torch.randn(T, K, device=dev).bfloat16()
counts = torch.bincount(torch.randint(0, G, (T,), device=dev), minlength=G)
offs = counts.cumsum(0).to(torch.int32)
try:
    out = torch._grouped_mm(A, Wg.transpose(-2, -1), offs=offs)
    ref = torch.cat([A[a:b] @ Wg[g].T for g,(a,b) in enumerate(zip([0]+offs[:-1].tolist(), offs.tolist()))])
    print("grouped_mm ok, max diff", (out.float()-ref.float()).abs().max().item(), "time us", tm(lambda: torch._grouped_mm(A, Wg.transpose(-2,-1), offs=offs)))
    # empty groups
    offs2 = torch.tensor([0]*10 + [T]*(G-10), device=dev, dtype=torch.int32)
    o2 = torch._grouped_mm(A, Wg.transpose(-2,-1), offs=offs2); print("empty groups ok", o2.isfinite().all().item())
    # small
    A1 = A[:6]; offs1 = torch.tensor([1,2,3,4,5,6]+[6]*(G-6), device=dev, dtype=torch.int32)
    print("6-row grouped us", tm(lambda: torch._grouped_mm(A1, Wg.transpose(-2,-1), offs=offs1)))
except Exception as e:
    print("grouped_mm failed:", repr(e)[:300])
# dequant speeds
w8 = (torch.randn(8192, 4096, device=dev)*32).to(torch.float8_e4m3fn); s8 = torch.full((64, 32), 120, device=dev, dtype=torch.uint8).view(torch.float8_e8m0fnu)
def fast8(w, s):
    o, i = w.shape
    sb = quant.e8m0_to_float(s).to(torch.bfloat16)
    return (w.view(o // 128, 128, i // 128, 128).to(torch.bfloat16) * sb[:, None, :, None]).view(o, i)
assert torch.equal(fast8(w8, s8), quant.fp8_block_dequant(w8, s8, torch.bfloat16))
print("fp8 dequant ref us", tm(lambda: quant.fp8_block_dequant(w8, s8, torch.bfloat16)), "fast us", tm(lambda: fast8(w8, s8)))
print("e4m3->bf16 cast only us", tm(lambda: w8.to(torch.bfloat16)))
w4 = torch.randint(-128, 128, (2048, 2048), device=dev, dtype=torch.int8); s4 = torch.randint(115,125,(2048,128),device=dev,dtype=torch.uint8).view(torch.float8_e8m0fnu)
vals = torch.tensor(quant.E2M1_VALUES + tuple(-v for v in quant.E2M1_VALUES))
b = torch.arange(256)
lut = torch.stack((vals[b & 15], vals[b >> 4]), -1).to(torch.bfloat16).to(dev)
def fast4(w, s):
    o, h = w.shape
    x = lut[w.view(torch.uint8).long()].view(o, h * 2 // 32, 32)
    return (x * quant.e8m0_to_float(s).to(torch.bfloat16)[..., None]).view(o, h * 2)
assert torch.equal(fast4(w4, s4), quant.fp4_dequant(w4, s4, torch.bfloat16))
print("fp4 dequant ref us", tm(lambda: quant.fp4_dequant(w4, s4, torch.bfloat16)), "fast us", tm(lambda: fast4(w4, s4)))
try:
    f4 = w4.view(torch.float4_e2m1fn_x2)
    print("float4 cast", f4.dtype)
except Exception as e: print("float4:", repr(e)[:200])
print("bf16 mm 1x4096x2048 us", tm(lambda: x[:1] @ Wb.T), "8192^2 x4096 bf16 dequant+mm")
