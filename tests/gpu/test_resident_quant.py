"""Weights resident in their on-disk precision on CUDA: the same logits bit for bit as the dequantized model, and
the GPU memory each mode takes (printed; run with -s).

    pytest -q -s tests/gpu/test_resident_quant.py                          # 1 GPU: tiny; >= 2 GPUs: also W=2
    DSV4_CKPT=/path/to/DeepSeek-V4-Flash TEST_LAYERS=4 pytest -q -s tests/gpu/test_resident_quant.py -k real
                                                                           # every visible GPU, both modes
                                                                           # (no DSV4_CKPT: Flash geometry, 4 layers)

Criteria: quantized vs dequantized logits bitwise equal (same `dsv4.quant` dequantization to the compute dtype,
then the same matmul) in fp32 and bf16, prefill at every position + 3 greedy decode steps; at world size 2 also
ranks bitwise equal and world size 2 vs 1 within atol 2e-5 / rtol 1e-5 in fp32 (tests/unit/test_parallel.py).
Peak memory = `torch.cuda.max_memory_allocated` after loading and running, reset between modes.
This file is also the rank worker (`torchrun --nproc_per_node N THIS MODE OUT CKPT`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the torchrun worker runs this file as a script
    sys.path.insert(0, str(ROOT))

from dsv4.testing import assert_close, assert_equal, require_gpus, save_rank_result  # noqa: E402
from tests.unit.test_resident_quant import _ids, _run, aligned_ckpt  # noqa: E402,F401  (fixture re-used)

pytestmark = [pytest.mark.gpu, pytest.mark.flash_width]

ATOL, RTOL = 2e-5, 1e-5
MODES = ("dequantized", "quantized")
PROMPT = [0, 128803, 3085, 344, 270, 6102, 294, 8760, 33, 128804, 128821]



def _measure(load, ids: torch.Tensor, dev) -> tuple[list[torch.Tensor], int, int]:
    """(logits on CPU, bytes held after loading, peak bytes through load + run), with the peak reset first."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    m = load()
    held = torch.cuda.memory_allocated(dev) - base
    out = [t.cpu() for t in _run(m, ids.to(dev))]
    peak = torch.cuda.max_memory_allocated(dev) - base
    del m
    return out, held, peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantized_resident_equals_dequantized_on_cuda(tiny_ckpt, dtype):
    from dsv4.generate import load_model

    require_gpus(1)
    ids = _ids(129280)
    res = {w: _measure(lambda w=w: load_model(tiny_ckpt, device="cuda:0", dtype=dtype, progress=False,
                                             weights=w)[0], ids, "cuda:0") for w in MODES}
    assert res["dequantized"][0][0].abs().max() > 1.0
    for step, (a, b) in enumerate(zip(res["dequantized"][0], res["quantized"][0])):
        assert_equal(b, a, f"{dtype} CUDA quantized-resident logits step {step}")
    for w in MODES:
        print(f"\ntiny {dtype} {w}: held {res[w][1] / 2**20:.1f} MiB, peak {res[w][2] / 2**20:.1f} MiB")
    assert res["quantized"][1] < res["dequantized"][1]


def _worker(mode: str, out: str, ckpt: str) -> None:
    from dsv4.config import layers_from_env
    from dsv4.parallel import comm_from_env, load_parallel_model

    comm, dev = comm_from_env("cuda")
    if mode == "tiny":
        n, dtype, ids = None, torch.float32, _ids(512)
    else:
        from dsv4.checkpoint import open_source

        n, dtype, ids = layers_from_env(open_source(ckpt).args.n_layers), torch.bfloat16, torch.tensor([PROMPT])
    res = {}
    for w in MODES:
        logits, held, peak = _measure(lambda w=w: load_parallel_model(ckpt, comm, n_layers=n, dtype=dtype, device=dev,
                                                                      weights=w), ids, dev)
        res[w] = {"logits": logits, "held": held, "peak": peak}
    save_rank_result(res, out, comm.rank)


def _torchrun(n: int, *argv: str, timeout: int) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), __file__,
           *argv]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert p.returncode == 0, f"torchrun failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return [torch.load(f"{argv[1]}.{r}") for r in range(n)]


def _report(res: list[dict], unit: int, label: str) -> None:
    for r, w in enumerate(res):
        print("\n" + "  ".join(f"{label} rank {r} {m}: held {w[m]['held'] / unit:.2f}, peak {w[m]['peak'] / unit:.2f}"
                               for m in MODES) + (" GiB" if unit == 2**30 else " MiB"))


def test_world2_quantized_on_two_gpus(tmp_path, aligned_ckpt):
    from dsv4.generate import load_model

    require_gpus(2)
    res = _torchrun(2, "tiny", str(tmp_path / "res"), str(aligned_ckpt), timeout=600)
    _report(res, 2**20, "aligned tiny fp32")
    w1 = _run(load_model(aligned_ckpt, device="cuda:0", progress=False, weights="quantized")[0], _ids(512).cuda())
    for step, want in enumerate(w1):
        got = res[0]["quantized"]["logits"][step]
        assert_equal(got, res[0]["dequantized"]["logits"][step], f"W=2 quantized vs dequantized step {step}")
        assert_equal(res[1]["quantized"]["logits"][step], got, f"W=2 rank 1 vs rank 0 step {step}")
        assert_close(got, want.cpu(), f"W=2 vs W=1 logits step {step}", atol=ATOL, rtol=RTOL)


@pytest.mark.slow
def test_real_checkpoint_both_modes_on_all_gpus(tmp_path, request):
    """Real-width checkpoint (DSV4_CKPT, else the Flash-geometry one built for the session; bf16, TEST_LAYERS
    honoured) on every visible GPU: the quantized-resident model gives the dequantized model's logits bit for
    bit; per-rank held / peak memory of both modes printed."""
    from tests.gpu.real_width import require_gpu_memory

    require_gpus(1)
    n = torch.cuda.device_count()
    ckpt = str(request.getfixturevalue("real_ckpt"))
    require_gpu_memory(Path(ckpt), "dequantized", world_size=n)
    res = _torchrun(n, "real", str(tmp_path / "res"), ckpt, timeout=3600)
    _report(res, 2**30, "real bf16")
    for r, w in enumerate(res):
        for step, (a, b) in enumerate(zip(w["dequantized"]["logits"], w["quantized"]["logits"])):
            assert_equal(b, a, f"rank {r} real quantized-resident logits step {step}")
        assert w["quantized"]["held"] < w["dequantized"]["held"] / 2


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])
