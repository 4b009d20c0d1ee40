"""Every Triton kernel builds for Blackwell (sm_100) on a CPU-only machine (issue 14, item 5).

`kernels.targets.compile_all(100)` compiles each kernel at DeepSeek-V4 shapes with Triton's bundled ptxas for
`GPUTarget("cuda", 100, 32)`; no GPU is needed, so CI proves that a change still builds for B200. It runs in a
subprocess because the unit run sets TRITON_INTERPRET=1, under which `@triton.jit` functions cannot compile.
The PTX feature list per kernel (and the sm_90 one) is recorded in benchmarks/RESULTS.md, "issue 14".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOT_KERNELS = ("moe._moe_up_tile_kernel", "moe._moe_down_tile_kernel", "gemm._fp8_gemm_kernel",
               "indexer._indexer_scores_kernel", "indexer._indexer_select_kernel", "mhc._hc_mix_kernel",
               "attention._sparse_attn_kernel", "mhc._hc_fused_kernel", "mhc._hc_post_pre_kernel",
               "attention._sparse_decode_kernel")


@pytest.fixture(scope="module")
def sm100():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "kernels.targets", "100"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"kernels.targets failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout)["100"]


def test_every_kernel_compiles_for_sm100(sm100):
    from kernels import targets
    names = [spec[0] for spec in targets._specs()]
    assert sorted(sm100) == sorted(names), "a kernel is missing from the compile report"
    failed = {k: v["error"] for k, v in sm100.items() if not v["ok"]}
    assert not failed, f"kernels that do not build for sm_100: {failed}"


def test_tensor_core_kernels_use_blackwell_or_warp_mma(sm100):
    """Every kernel with a tl.dot lowers to an MMA instruction on sm_100 (tcgen05 where Triton picks it, else
    the warp-level mma.sync); a kernel that silently lost its tensor-core path fails here."""
    for name in DOT_KERNELS:
        feats = sm100[name]["features"]
        assert "tcgen05" in feats or "mma.sync" in feats, f"{name}: no MMA instruction on sm_100 ({feats})"


def test_every_jit_kernel_has_a_target_spec():
    """Every `@triton.jit` launch kernel (`_*_kernel`) in kernels/ is in `kernels.targets._specs()`, so the sm_100
    build above covers it (a new kernel cannot skip the Blackwell check by not registering). Negative control:
    the scan finds the known kernels, and a name absent from the specs would be reported."""
    import re

    from kernels import targets
    found = set()
    for path in sorted((ROOT / "kernels").glob("*.py")):
        text = path.read_text()
        for name in re.findall(r"@triton\.jit[^\n]*\n[ \t]*def (_\w+_kernel)\(", text):
            found.add(f"{path.stem}.{name}")
    specs = {spec[0] for spec in targets._specs()}
    assert {"mhc._hc_post_kernel", "gemm._fp8_gemv_kernel", "norm._rms_norm_kernel", "attention._sparse_decode_kernel"} <= found
    missing = sorted(found - specs)
    assert not missing, f"kernels without a target spec in kernels/targets.py: {missing}"


def test_fp32_linear_paths_on_and_off_tensor_cores(sm100):
    """The fp32 linear's CUDA-core paths (M = 1, the row loop) lower to fp32 FMA, no MMA; its M > 1 path runs the
    three bf16 pieces of x on the tensor cores (wgmma / tcgen05 / mma.sync: exact products, kernels/fp32_linear.py),
    so a build that silently fell back to FMA (5.4 ms for the Flash head at M = 32, RESULTS.md) fails here."""
    mma = {"mma.sync", "wgmma", "tcgen05"}
    for name in ("fp32_linear._bf16w_gemv_kernel", "fp32_linear._bf16w_gemv_kernel[m1]"):
        assert sm100[name]["ok"] and not mma & set(sm100[name]["features"]), (name, sm100[name]["features"])
    assert mma & set(sm100["fp32_linear._bf16w_gemv_kernel[dot]"]["features"])


def test_moe_tiles_load_their_rows_in_vectors(sm100):
    """The MoE tile kernels (prefill) read the gathered rows of x / h in the halves layout (`kernels.quant.halves`)
    and the FP4 bytes as vectors copied by cp.async: their sm_100 builds hold no 2-byte global load. The stride-2
    gather of each chunk's even and odd inputs they used before 6613962 compiled to 64 (down) and 128 (up) 2-byte
    loads per kernel at the same specialization (RESULTS.md, eighth session of 2026-12-06). Negative control: the
    feature's pattern matches such a load and not a vector one."""
    import re

    from kernels import targets
    pat = targets.FEATURES["ld.global 2-byte"]
    assert re.search(pat, "ld.global.b16 %rs1, [%rd2];") and re.search(pat, "ld.global.nc.u16 %rs3, [%rd4+2];")
    assert not re.search(pat, "ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd2];")
    tiles = [n for n in sm100 if n.startswith(("moe._moe_up_tile_kernel", "moe._moe_down_tile_kernel"))]
    assert len(tiles) == 9, tiles
    for name in tiles:
        feats = sm100[name]["features"]
        assert "cp.async" in feats and "ld.global 2-byte" not in feats, f"{name}: {feats}"
