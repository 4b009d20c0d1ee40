"""dsv4 at real DeepSeek-V4 width on CUDA: the synthetic-checkpoint generator and `dsv4 diagnose` on the
real-width checkpoint (DSV4_CKPT, else a Flash-geometry checkpoint of 4 layers built for the session, see
tests/gpu/real_width.py), both backends, both weight modes, TEST_LAYERS honoured; world size 2 under torchrun
when two GPUs are visible.

    pytest -q tests/gpu/test_real_width.py                         # builds the Flash-geometry checkpoint (~20 GB)
    DSV4_CKPT=/ckpt/flash4 TEST_LAYERS=2 pytest -q tests/gpu -k real
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4.testing import require_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.flash_width, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("layers.0.attn.wkv.weight", "layers.0.attn.wkv.scale", "layers.2.ffn.experts.255.w2.weight",
         "layers.2.ffn.experts.255.w2.scale", "layers.0.ffn.gate.tid2eid", "layers.3.hc_ffn_fn",
         "layers.3.attn.compressor.ape", "layers.1.attn_norm.weight", "hc_head_scale")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def test_generator_same_bits_on_cpu_and_cuda():
    """Flash-geometry tensors generated on the GPU are bit-identical to the CPU ones (every family: FP8 codes and
    block scales, FP4 codes and scales, tid2eid, hc_*, ape, a norm)."""
    from dsv4.synth import geometry_args, synth_tensor

    args = geometry_args("flash", 4)
    for name in NAMES:
        a, b = synth_tensor(args, name, seed=5), synth_tensor(args, name, seed=5, device="cuda").cpu()
        assert a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b)), name


def test_real_ckpt_holds_the_generator_values(real_ckpt):
    """The files hold exactly `synth_tensor(args, name, seed)`: a loader can synthesize a rank's tensors instead."""
    from dsv4.checkpoint import open_source
    from dsv4.synth import PROVENANCE_FILE, geometry_args, synth_tensor

    from dsv4.synth import is_synth_source

    if is_synth_source(real_ckpt):
        pytest.skip(f"{real_ckpt} is a synthetic source: its tensors are the generator's by construction "
                    "(tests/unit/test_synth_source.py checks them against make-checkpoint's files)")
    prov = real_ckpt / PROVENANCE_FILE
    if not prov.is_file():
        pytest.skip(f"{real_ckpt} has no {PROVENANCE_FILE}: not a synthetic checkpoint (released weights)")
    meta = json.loads(prov.read_text())
    ck = open_source(real_ckpt)
    args = geometry_args(meta["geometry"], meta["layers"])
    for name in NAMES:
        if name in ck:
            got = ck.get(name, dequantize=False)
            assert torch.equal(_bytes(got), _bytes(synth_tensor(args, name, meta["seed"], "cuda").cpu())), name


@pytest.mark.parametrize("weights", ["dequantized", "quantized"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_diagnose_real_width(real_ckpt, tmp_path, backend, weights):
    """`dsv4 diagnose --ckpt REAL --device cuda` passes both decisive tests at real width (exit 0), and reports the
    TEST_LAYERS in effect."""
    from dsv4.checkpoint import open_source
    from dsv4.config import layers_from_env
    from tests.gpu.real_width import require_gpu_memory

    require_gpu_memory(real_ckpt, weights, streamed=False)
    n_all = open_source(real_ckpt).args.n_layers
    n = layers_from_env(n_all)
    cmd = [sys.executable, "-m", "dsv4.cli"]
    out = tmp_path / "stdout"
    p = subprocess.run([*cmd, "diagnose", "--ckpt", str(real_ckpt), "--device", "cuda", "--backend", backend,
                        "--weights", weights], capture_output=True, text=True, timeout=1800, cwd=ROOT)
    out.write_text(p.stdout)
    print(p.stdout[-3000:])
    assert p.returncode == 0 and "RESULT: PASS" in p.stdout, f"rc {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    assert f"TEST_LAYERS in effect: {n} of {n_all} main layers" in p.stdout
    assert f"backend {backend} | weights {weights}" in p.stdout


def test_diagnose_real_width_world2(real_ckpt, tmp_path):
    """World size 2 (torchrun, NCCL, rank-local reads), weights quantized: diagnose passes at real width."""
    from tests.gpu.real_width import require_gpu_memory

    require_gpus(2, nccl=True)
    require_gpu_memory(real_ckpt, "quantized", world_size=2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "dsv4.cli",
           "diagnose", "--ckpt", str(real_ckpt), "--device", "cuda", "--weights", "quantized"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    print(p.stdout[-3000:])
    assert p.returncode == 0 and "RESULT: PASS" in p.stdout, f"rc {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    assert "world size 2" in p.stdout
