"""FP8 linear and grouped FP4 MoE launchers vs their torch references at real Flash / Pro sizes (CUDA only).

Outputs are NaN-poisoned through `out=` (fp8_linear); moe_experts allocates its outputs with torch.empty and must
write every pair row (an unwritten row is garbage / NaN and fails). Inputs fresh per test, non-zero, weight scales
over several binades. Criterion: bf16 table (rtol 1.6e-2 atol 1e-2) relative to the output's max|ref| (reasons in
tests/unit/test_gemm_moe_kernels.py). The fp32 references run with TF32 off (asserted).
"""

from __future__ import annotations

import pytest
import torch

from dsv4 import quant
from dsv4.testing import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.hardstop,  # kernel / backend vs reference on CUDA (issue 22 item 4)
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]

# (name, in, out): Flash (D 4096) and Pro (D 7168) FP8 linears
SHAPES = [("wq_a", 4096, 1024), ("wq_b", 1024, 32768), ("wkv", 4096, 512), ("wo_b", 8192, 4096),
          ("shared_w1", 4096, 2048), ("shared_w2", 2048, 4096), ("pro_wq_a", 7168, 1536), ("pro_w2", 3072, 7168)]
MS = [1, 8, 9, 32, 64, 1024]  # 9 and 64: the first and last row counts of the decode tiles (`DECODE_TILES_MIN_M`)


@pytest.fixture(autouse=True)
def _fp32_reference():
    assert not torch.backends.cuda.matmul.allow_tf32, "TF32 matmul is on: the fp32 reference would be TF32"


def close_bf16(actual, expected, name):
    mag = float(expected.float().abs().max())
    assert mag > 0
    assert_close(actual.float() / mag, expected.float() / mag, name, dtype=torch.bfloat16)


def make_w8(N, K):
    w = torch.randn(N, K, device="cuda") * torch.logspace(-3, 1, K, device="cuda")[None, :]
    return quant.fp8_block_quant(w)


@pytest.mark.parametrize("M", MS, ids=[f"M{m}" for m in MS])
@pytest.mark.parametrize("name,K,N", SHAPES, ids=[s[0] for s in SHAPES])
def test_fp8_linear_gpu(seed, name, K, N, M):
    from kernels.gemm import PREFILL_METHODS, fp8_linear, fp8_linear_ref
    x = (torch.randn(M, K, device="cuda") * torch.logspace(-2, 2, K // 128, device="cuda").repeat_interleave(128)
         ).to(torch.bfloat16)
    w, s = make_w8(N, K)
    ref = fp8_linear_ref(x, w, s)
    for method in (PREFILL_METHODS if M > 64 else (None,)):
        for mma in ("fp8", "bf16"):
            if method in ("dequant", "scaled_mm") and mma == "bf16":
                continue  # no Triton dot on these paths
            out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
            close_bf16(fp8_linear(x, w, s, out=out, prefill=method, mma=mma), ref, f"y[{method}, {mma}]")


def make_experts(E, D, I, s_lo=118, s_hi=128):
    """Random on-disk codes (int8 bytes = two e2m1 nibbles) and ue8m0 scale bytes in [s_lo, s_hi) (by default
    2^-9..2^0)."""
    from kernels.moe import StackedExperts
    parts = {}
    for n, (o, i) in {"1": (I, D), "3": (I, D), "2": (D, I)}.items():
        parts["w" + n] = torch.randint(-128, 128, (E, o, i // 2), dtype=torch.int8, device="cuda")
        parts["s" + n] = torch.randint(s_lo, s_hi, (E, o, i // 32), dtype=torch.uint8,
                                       device="cuda").view(torch.float8_e8m0fnu)
    return StackedExperts(**parts)


GEOM = {"flash": (256, 4096, 2048), "pro": (384, 7168, 3072)}


MOE_T = [1, 8, 32, 1024]


@pytest.mark.parametrize("path", ["gemv", "tiles"])
@pytest.mark.parametrize("T", MOE_T, ids=[f"T{t}" for t in MOE_T])
@pytest.mark.parametrize("geom", ["flash", "pro"])
def test_moe_experts_gpu(seed, geom, T, path):
    """Both paths at every T (the default `moe_config` picks one of them; the other is forced with its default
    tiles), against `moe_grouped_ref`; two tokens share their six experts (an expert read by several pairs)."""
    from kernels.moe import MoeConfig, moe_config, moe_experts, moe_grouped_ref
    E, D, I = GEOM[geom]
    ex = make_experts(E, D, I)
    x = (torch.randn(T, D, device="cuda") * 0.3).to(torch.bfloat16)
    idx = torch.rand(T, E, device="cuda").topk(6, dim=-1).indices
    if T >= 8:
        idx[1] = idx[0]  # two tokens on the same six experts
    g = torch.rand(T, 6, device="cuda") + 0.1
    ref = moe_grouped_ref(x, g, idx, ex, 10.0)
    cfg = moe_config(6 * T, E)
    if cfg.path != path:
        cfg = moe_config(1, E) if path == "gemv" else moe_config(6 * 1024, E)  # the default tiles
    assert isinstance(cfg, MoeConfig) and cfg.path == path
    y = moe_experts(x, g, idx, ex, 10.0, config=cfg)
    close_bf16(y, ref, f"moe y [{path}]")


@pytest.mark.parametrize("T", [4, 128], ids=["T4-gemv", "T128-tiles"])
def test_moe_experts_sync_free_and_graph_replay(seed, T):
    """No host sync (sync debug mode "error") and a CUDA graph replayed with new routing equals eager, on both
    paths (the default config: gemv at 24 pairs, tiles at 768)."""
    from kernels.moe import moe_config, moe_experts
    assert moe_config(6 * 4, 256).path == "gemv" and moe_config(6 * 128, 256).path == "tiles"
    E, D, I = GEOM["flash"]
    ex = make_experts(E, D, I)
    x = (torch.randn(T, D, device="cuda") * 0.3).to(torch.bfloat16)
    idx = torch.rand(T, E, device="cuda").topk(6, dim=-1).indices
    g = torch.rand(T, 6, device="cuda") + 0.1
    moe_experts(x, g, idx, ex, 10.0)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_experts(x, g, idx, ex, 10.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe_experts(x, g, idx, ex, 10.0)
    x.copy_((torch.randn(T, D, device="cuda") * 0.3).to(torch.bfloat16))
    idx.copy_(torch.rand(T, E, device="cuda").topk(6, dim=-1).indices)
    g.copy_(torch.rand(T, 6, device="cuda") + 0.1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, moe_experts(x, g, idx, ex, 10.0)), "graph replay differs from eager"


# (G, K, N) of wo_a: Flash (64 heads x 512 / 8 groups, o_lora_rank 1024), Pro (128 x 512 / 16, 1024)
WO_A = [("flash", 8, 4096, 1024), ("pro", 16, 4096, 1024)]


@pytest.mark.parametrize("M", [1, 8, 64], ids=["M1", "M8", "M64"])
@pytest.mark.parametrize("name,G,K,N", WO_A, ids=[w[0] for w in WO_A])
def test_fp8_grouped_gemv_gpu(seed, name, G, K, N, M):
    """Decode wo_a (`fp8_grouped_gemv`: FP8 codes read directly, no activation quantization) against the
    reference maths of `kernels.gemm.grouped_linear_ref` (bf16 x and dequantized weight, fp32 products)."""
    from kernels.gemm import fp8_grouped_gemv
    x = (torch.randn(M, G * K, device="cuda") * torch.logspace(-2, 2, G * K // 128, device="cuda")
         .repeat_interleave(128)).to(torch.bfloat16)
    w, s = make_w8(G * N, K)
    wd = quant.fp8_block_dequant(w, s, out_dtype=torch.float32).view(G, N, K)
    ref = torch.einsum("mgk,gnk->mgn", x.float().view(M, G, K), wd).to(torch.bfloat16).reshape(M, G * N)
    for mma in ("fp8", "bf16"):
        close_bf16(fp8_grouped_gemv(x, w, s, G, mma=mma), ref, f"wo_a[{name}, M{M}, {mma}]")


def gemv_variants(M):
    """The decode launch knobs of `kernels.gemm.GemvConfig` (the `gemv_sweep` of benchmarks/bench_gemm.py)."""
    from kernels.gemm import GemvConfig as C
    dot = [C(bn=64, unroll=2), C(bn=32, unroll=4, per_sm=4), C(bn=128, unroll=2, num_warps=8),
           C(bn=32, unroll=2, prequant=True, num_stages=2)]
    core = [C(dot=False, bn=64, unroll=2, per_sm=8), C(dot=False, bn=128, unroll=4, num_warps=8),
            C(dot=False, bn=64, unroll=2, prequant=True)]
    return dot + (core if M <= 16 else [])


@pytest.mark.parametrize("M", [1, 8, 32], ids=["M1", "M8", "M32"])
@pytest.mark.parametrize("name,K,N", [("wkv", 4096, 512), ("wo_b", 8192, 4096), ("pro_wq_a", 7168, 1536)],
                         ids=["wkv", "wo_b", "pro_wq_a"])
def test_fp8_linear_gemv_variants_gpu(seed, name, K, N, M):
    """Every decode launch variant (tensor-core / CUDA-core rows, unrolled K blocks, splits, prequant) against the
    reference at real sizes, output NaN-poisoned."""
    from kernels.gemm import fp8_grouped_gemv, fp8_linear, fp8_linear_ref
    x = (torch.randn(M, K, device="cuda") * torch.logspace(-2, 2, K // 128, device="cuda").repeat_interleave(128)
         ).to(torch.bfloat16)
    w, s = make_w8(N, K)
    ref = fp8_linear_ref(x, w, s)
    G, KO, NO = WO_A[0][1:]
    xo = (torch.randn(M, G * KO, device="cuda")).to(torch.bfloat16)
    wo, so = make_w8(G * NO, KO)
    wd = quant.fp8_block_dequant(wo, so, out_dtype=torch.float32).view(G, NO, KO)
    ref_o = torch.einsum("mgk,gnk->mgn", xo.float().view(M, G, KO), wd).to(torch.bfloat16).reshape(M, G * NO)
    for cfg in gemv_variants(M):
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
        close_bf16(fp8_linear(x, w, s, out=out, gemv=cfg), ref, f"y[{cfg}]")
        if not cfg.prequant:
            close_bf16(fp8_grouped_gemv(xo, wo, so, G, gemv=cfg), ref_o, f"wo_a[{cfg}]")


# ------------------------------------------------------------------ launches only the GPU selects (issue 22 item 4)
def _tuned_ids():
    from kernels.gemm import GEMV_TUNED
    return list(GEMV_TUNED), [f"M{m}-N{n}-K{k}-G{g}" for m, n, k, g in GEMV_TUNED]


TUNED_KEYS, TUNED_IDS = _tuned_ids()


@pytest.mark.parametrize("key", TUNED_KEYS, ids=TUNED_IDS)
def test_every_tuned_gemv_entry_gpu(seed, key):
    """Every entry of `kernels.gemm.GEMV_TUNED` at its own shape (M = the bucket's row count, N, K, G) and both
    dot flavours against the reference: on sm_90 `gemv_config` must pick the entry (then the default launch
    runs it), elsewhere it is forced. fp8_linear output NaN-poisoned; the grouped wo_a for G > 1."""
    from kernels.gemm import GEMV_TUNED, fp8_grouped_gemv, fp8_linear, fp8_linear_ref, gemv_config
    M, N, K, G = key
    cfg = GEMV_TUNED[key]
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] == 9:
        assert gemv_config(M, N, K, G, dev) == cfg, "sm_90 must select the measured entry"
    x = (torch.randn(M, G * K, device="cuda") * torch.logspace(-2, 2, G * K // 128, device="cuda")
         .repeat_interleave(128)).to(torch.bfloat16)
    w, s = make_w8(G * N, K)
    for mma in ("fp8", "bf16"):
        if G == 1:
            ref = fp8_linear_ref(x, w, s)
            out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
            close_bf16(fp8_linear(x, w, s, out=out, mma=mma, gemv=cfg), ref, f"y[{key}, {mma}]")
        else:
            wd = quant.fp8_block_dequant(w, s, out_dtype=torch.float32).view(G, N, K)
            ref = torch.einsum("mgk,gnk->mgn", x.float().view(M, G, K), wd).to(torch.bfloat16).reshape(M, G * N)
            close_bf16(fp8_grouped_gemv(x, w, s, G, mma=mma, gemv=cfg), ref, f"wo_a[{key}, {mma}]")


@pytest.mark.parametrize("T", [4, 64, 1024, 2048, 4096],
                         ids=["T4-gemv", "T64-tiles-small", "T1024-tiles-32", "T2048-tiles-64", "T4096-tiles-128"])
def test_moe_every_default_config_gpu(seed, T):
    """Every launch `moe_config` picks (gemv up to GEMV_MAX_PAIRS pairs, 16 x 64 tiles up to
    TILES_SMALL_MAX_PAIRS, then the 32 / 64 / 128-row tiles of TILES_LARGE by pairs per expert: the bf16
    tensor-core dots), each at a T that selects it by default (6 experts per token, Flash widths), against
    `moe_grouped_ref`."""
    from kernels.moe import GEMV_MAX_PAIRS, TILES_LARGE, TILES_SMALL_MAX_PAIRS, moe_config, moe_experts, \
        moe_grouped_ref
    P = 6 * T
    want = "gemv" if P <= GEMV_MAX_PAIRS else "tiles"
    assert moe_config(P, 256).path == want and (T != 64 or GEMV_MAX_PAIRS < P <= TILES_SMALL_MAX_PAIRS)
    if T >= 1024:  # each of TILES_LARGE in turn
        assert moe_config(P, 256) == TILES_LARGE[{1024: 0, 2048: 1, 4096: 2}[T]][1]
    E, D, I = GEOM["flash"]
    ex = make_experts(E, D, I)
    x = (torch.randn(T, D, device="cuda") * 0.3).to(torch.bfloat16)
    idx = torch.rand(T, E, device="cuda").topk(6, dim=-1).indices
    g = torch.rand(T, 6, device="cuda") + 0.1
    close_bf16(moe_experts(x, g, idx, ex, 10.0), moe_grouped_ref(x, g, idx, ex, 10.0), f"moe y [T{T}]")
    if want == "tiles":
        close_bf16(moe_experts(x, g, idx, ex, 10.0, mma="bf16"), moe_grouped_ref(x, g, idx, ex, 10.0),
                   f"moe y [T{T}, mma bf16]")


@pytest.mark.parametrize("T", [64, 1024, 2048, 4096],
                         ids=["T64-tiles-small", "T1024-tiles-32", "T2048-tiles-64", "T4096-tiles-128"])
def test_moe_tiles_packed_decode_is_bitwise_the_bf16_decode_gpu(seed, T):
    """mma="bf16x2" (the FP4 nibbles decoded two per 32-bit op by inline PTX, `kernels.moe._e2m1_bf16x2`, the
    group scale as two exact bf16 factors) gives the same bf16 dot operands as mma="bf16" (`_e2m1` through fp16 /
    fp32), so the same outputs bit for bit, at every default tile shape (Flash widths). Scale bytes span 100..160:
    below and above 128, where the second factor 2^(s - 128) takes over (the first is capped at 2^127)."""
    from kernels.moe import moe_experts
    E, D, I = GEOM["flash"]
    ex = make_experts(E, D, I)
    x = (torch.randn(T, D, device="cuda") * 0.3).to(torch.bfloat16)
    idx = torch.rand(T, E, device="cuda").topk(6, dim=-1).indices
    g = torch.rand(T, 6, device="cuda") + 0.1
    a, b = moe_experts(x, g, idx, ex, 10.0, mma="bf16"), moe_experts(x, g, idx, ex, 10.0, mma="bf16x2")
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)), \
        f"T{T}: {(a != b).sum().item()} of {a.numel()} outputs differ between the bf16 and bf16x2 decodes"
    from kernels.moe import TILES_LARGE
    E2, D2 = 4, 256
    ex2 = make_experts(E2, D2, D2, 100, 161)
    x2 = (torch.randn(64, D2, device="cuda") * 2.0 ** -20).to(torch.bfloat16)
    idx2 = torch.rand(64, E2, device="cuda").topk(2, dim=-1).indices
    g2 = torch.rand(64, 2, device="cuda") + 0.1
    cfg = TILES_LARGE[0][1]  # the 32-row tiles (block_n divides 256)
    a2 = moe_experts(x2, g2, idx2, ex2, 0.0, mma="bf16", config=cfg)
    b2 = moe_experts(x2, g2, idx2, ex2, 0.0, mma="bf16x2", config=cfg)
    assert bool(torch.isfinite(a2.float()).all()) and float(a2.float().abs().max()) > 0
    assert torch.equal(a2.view(torch.int16), b2.view(torch.int16)), \
        f"scales 2^-27..2^33: {(a2 != b2).sum().item()} of {a2.numel()} outputs differ between the decodes"


@pytest.mark.parametrize("geom", ["flash", "pro"])
def test_moe_gemv_input_forms_and_decodes_are_bitwise_gpu(seed, geom, monkeypatch):
    """The decode path's three input forms (act_quant_sim values through the fp16 route; x quantized in the
    kernels; act_quant's e4m3 codes and scales, the default above GEMV_QUANT_MAX_T tokens) with the nibble
    decodes of the code-value route (the packed PTX in bf16 lanes, `_e2m1_bf16x2`, or fp16 lanes, `_e2m1_f16x2`
    with GEMV_PACKED_F16; element-wise, mma "bf16") give
    the same outputs bit for bit on the GPU at Flash / Pro width, T = 1 / 8 / 32; one token's x holds a NaN and
    another an inf (the GPU's e4m3 -> fp32 conversion keeps the NaN code, which the interpreter does not). The
    default launch's software-pipelined K loops (GEMV_SHAPES' 2 stages) give bitwise the same shapes' unpipelined
    outputs."""
    import kernels.moe as km
    E, D, I = GEOM[geom]
    ex = make_experts(E, D, I)
    for T in (1, 8, 32):
        x = (torch.randn(T, D, device="cuda") * torch.logspace(-3, 3, D // 128, device="cuda")
             .repeat_interleave(128)).to(torch.bfloat16)
        if T > 1:
            x[0, 7], x[1, 300] = float("nan"), float("inf")
        idx = torch.rand(T, E, device="cuda").topk(6, dim=-1).indices
        g = torch.rand(T, 6, device="cuda") + 0.1
        outs = {}
        for codes, mma, f16 in ((False, "bf16", False), (True, "bf16", False), (True, "bf16x2", False),
                                (True, "bf16x2", True)):
            monkeypatch.setattr(km, "GEMV_CODES", codes)
            monkeypatch.setattr(km, "GEMV_PACKED_F16", f16)
            outs[(codes, mma, f16)] = km.moe_experts(x, g, idx, ex, 10.0, mma=mma)
        ref = outs[(False, "bf16", False)]
        assert bool(ref[-1].isfinite().all()) and float(ref[-1].abs().max()) > 0
        if T > 1:
            assert bool(ref[0].isnan().any()), "the NaN token must stay NaN"
        for key, y in outs.items():
            same = torch.equal(ref.isnan(), y.isnan()) and torch.equal(ref.nan_to_num(), y.nan_to_num())
            assert same, f"{geom} T{T}: GEMV_CODES={key[0]} mma={key[1]} GEMV_PACKED_F16={key[2]} differs"
        # the default launch (K loops pipelined where GEMV_SHAPES says 2 stages) against the same shapes unpipelined:
        # pipelining moves loads, not sums - bitwise (the interpreter ignores the stages: only a GPU sees this)
        monkeypatch.setattr(km, "GEMV_CODES", True)
        monkeypatch.setattr(km, "GEMV_PACKED_F16", True)
        shapes = km.GEMV_SHAPES
        assert any(c.num_stages > 1 for pair in shapes for c in pair)
        piped = km.moe_experts(x, g, idx, ex, 10.0)
        monkeypatch.setattr(km, "GEMV_SHAPES", tuple(tuple(c._replace(num_stages=1) for c in pair) for pair in shapes))
        flat = km.moe_experts(x, g, idx, ex, 10.0)
        monkeypatch.setattr(km, "GEMV_SHAPES", shapes)
        same = torch.equal(piped.isnan(), flat.isnan()) and torch.equal(piped.nan_to_num(), flat.nan_to_num())
        assert same, f"{geom} T{T}: the pipelined gemv launch differs from the same shapes unpipelined"
