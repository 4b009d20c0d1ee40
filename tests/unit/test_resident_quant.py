"""Weights resident in their on-disk precision (`Transformer(weights="quantized")`, dsv4/resident.py) on CPU.

Criteria: quantized-resident logits EQUAL the dequantized model's bit for bit (same `dsv4.quant` dequantization,
same fp32 matmul; prefill at every position and 3 greedy decode steps, fp32 and bf16); the bytes held per family
(F8_E4M3 codes, I8 FP4 codes, F8_E8M0 scales) equal the checkpoint's, and a bf16 model's bytes per dtype equal
`memory_plan.rank_memory(..., "quantized")` (`_plan_bytes`; wo_a held FP8 as on disk); world size 2 (gloo)
quantized equals world size 2 dequantized bitwise and world size 1 to atol 2e-5 / rtol 1e-5 (the tolerance of
tests/unit/test_parallel.py: only the summation order of the reductions differs).

The tiny checkpoint's split FP8 tensors are not 128-aligned at world size 2 (wo_a 32 rows per rank), so that
case is the clear error; the parity run uses `_aligned_args` (o_lora_rank 128, index_head_dim 64: every split
part is 128 rows / columns). This file is also the rank worker: `torchrun --nproc_per_node 2 THIS OUT CKPT`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from dsv4.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from dsv4.generate import load_model
from dsv4.memory_plan import rank_memory
from dsv4.model import Linear, Transformer, _Sim
from dsv4.parallel import (Comm, ParallelTransformer, check_quantized_split, comm_from_env, load_parallel_model,
                           load_rank_state_dict)
from dsv4.resident import held_bytes
from dsv4.testing import greedy_logits, torchrun_workers, assert_close, assert_equal, save_rank_result
from dsv4.tiny import quantize_state_dict, random_state_dict, tiny_args

pytestmark = pytest.mark.hardstop  # quantized-resident weights compute the same logits

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = ("F8_E4M3", "F8_E8M0", "I8")
ATOL, RTOL = 2e-5, 1e-5  # world size 2 vs 1, see module docstring
SEED, PROMPT_LEN, DECODE = 5, 40, 3  # 40 tokens: 10 CSA entries > index_topk 4, window 8 wrapped


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(SEED))


def _run(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Prefill logits at every position, then DECODE greedy steps' logits."""
    return greedy_logits(model, ids, DECODE)


def _aligned_args():
    return tiny_args(vocab_size=512, o_lora_rank=128, index_head_dim=64)


@pytest.fixture(scope="module")
def aligned_ckpt(tmp_path_factory) -> Path:
    """A single-file fp8 checkpoint of `_aligned_args` (no MTP), quantized from seeded random weights."""
    from safetensors.torch import save_file

    args, d = _aligned_args(), tmp_path_factory.mktemp("aligned")
    sd = quantize_state_dict(args, random_state_dict(args, seed=SEED, include_mtp=False), include_mtp=False)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(args.to_hf_config()))
    return d


def _bytes(sd: dict[str, torch.Tensor]) -> dict[str, int]:
    names = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8"}
    out = dict.fromkeys(FAMILIES, 0)
    for t in sd.values():
        if t.dtype in names:
            out[names[t.dtype]] += t.numel()
    return out


def _plan_bytes(args, world: int, rank: int) -> dict[str, int]:
    """`rank_memory(..., "quantized").by_dtype`: the plan, which holds every FP8/FP4 tensor as on disk."""
    return dict(sorted(rank_memory(args, world, rank, "quantized").by_dtype.items()))


# ------------------------------------------------------------------------------------------- world size 1
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantized_resident_logits_equal_dequantized_bitwise(tiny_ckpt, dtype):
    ids = _ids(129280)
    deq, _ = load_model(tiny_ckpt, dtype=dtype, progress=False)
    qnt, _ = load_model(tiny_ckpt, dtype=dtype, progress=False, weights="quantized")
    a, b = _run(deq, ids), _run(qnt, ids)
    assert a[0].abs().max() > 1.0, "degenerate logits would make the comparison meaningless"
    for step, (x, y) in enumerate(zip(a, b)):
        assert_equal(y, x, f"{dtype} quantized-resident logits step {step}")
    wo_a = qnt.layers[1].attn.wo_a
    assert wo_a.fmt == "fp8" and wo_a.codes.dtype == torch.float8_e4m3fn and wo_a.dequantized_weight().dtype == dtype
    assert qnt.layers[1].ffn.experts[0].w2.codes.dtype == torch.int8
    # held bf16 as on disk, computed in fp32 (docs/differences.md): head, router, compressor wkv / wgate
    assert qnt.head.fmt == "bf16" and qnt.head.codes.dtype == torch.bfloat16
    assert qnt.head.dequantized_weight().dtype == torch.float32
    assert qnt.layers[1].ffn.gate.weight.dtype == torch.bfloat16
    assert qnt.layers[1].attn.compressor.wgate.fmt == "bf16"
    assert deq.head.fmt is None and deq.head.codes.dtype == deq.layers[1].ffn.gate.weight.dtype == torch.float32


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (CPU)")
def test_triton_quantized_resident_equals_reference_dequantized(aligned_ckpt, monkeypatch):
    """Triton backend, fp32 mode, weights held as on disk (head / router / compressors bf16 through
    `kernels.fp32_linear`, both its paths: prefill all-positions head at 9 rows, decode at 1) against the
    reference backend's dequantized fp32 model: logits within atol 1e-4 (tests/unit/test_backend.py: only fp32
    summation order differs) and the same greedy tokens. The spy proves the kernel ran. The first 9 prompt tokens
    (was 40; the triton prefill's time is proportional to its tokens under the interpreter, ~1.3 s each): the
    window (8) wrapped, 2 CSA entries, 1 < 9 rows <= GEMV_MAX_M (the same fp32_linear branch as 40 rows; both
    launch one program per N block and K split, BM 16 vs 64). The triton indexer's top-k below the entry count
    (index_topk 4 < 5 entries) at model level: tests/unit/test_backend.py (21 tokens)."""
    import kernels.fp32_linear as kf
    calls = []
    real = kf._bf16w_gemv_kernel
    monkeypatch.setattr(kf, "_bf16w_gemv_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: (lambda *a, **k: calls.append(grid) or real[grid](*a, **k))})())
    ids = _ids(512)[:, :9]
    ref, _ = load_model(aligned_ckpt, progress=False)
    tri, _ = load_model(aligned_ckpt, progress=False, backend="triton", weights="quantized")
    assert tri.head.fmt == "bf16" and tri.layers[0].ffn.gate.weight.dtype == torch.bfloat16
    want, got = _run(ref, ids), _run(tri, ids)
    assert want[0].abs().max() > 1.0, "degenerate logits would make the comparison meaningless"
    for step, (a, b) in enumerate(zip(want, got)):
        assert_close(b, a, f"triton quantized vs reference dequantized step {step}", atol=1e-4, rtol=0)
        assert torch.equal(a[..., -1, :].argmax(-1) if a.dim() == 3 else a.argmax(-1),
                           b[..., -1, :].argmax(-1) if b.dim() == 3 else b.argmax(-1)), f"greedy token step {step}"
    assert len(calls) > 0


def test_negative_a_wrong_scale_is_seen(tiny_ckpt):
    """The bitwise comparison can fail: one ue8m0 scale byte off by one (x2) in layer 0's wq_a changes logits."""
    ids = _ids(129280)[:, :8]
    deq, _ = load_model(tiny_ckpt, progress=False)
    qnt, _ = load_model(tiny_ckpt, progress=False, weights="quantized")
    s = qnt.layers[0].attn.wq_a.scale
    s.view(torch.uint8)[0, 0] += 1
    with pytest.raises(AssertionError):
        assert_equal(qnt(ids, qnt.new_state(1)), deq(ids, deq.new_state(1)), "logits with a wrong scale")


def test_held_bytes_equal_checkpoint_and_memory_plan(tiny_ckpt):
    qnt, _ = load_model(tiny_ckpt, progress=False, weights="quantized")
    deq, _ = load_model(tiny_ckpt, progress=False)
    ck = Checkpoint(tiny_ckpt)
    on_disk = dict.fromkeys(FAMILIES, 0)
    for name in ck.keys():
        shape, dt, _ = ck.info(name)
        if dt in FAMILIES and not name.startswith("mtp."):
            on_disk[dt] += torch.Size(shape).numel()
    held = {k: held_bytes(qnt).get(k, 0) for k in FAMILIES}
    assert held == on_disk and min(held.values()) > 0
    assert held_bytes(Transformer(ck.args, dtype=torch.bfloat16, weights="quantized")) == _plan_bytes(ck.args, 1, 0)
    assert not set(FAMILIES) & set(held_bytes(deq))
    lin = [n for n, m in qnt.named_modules() if isinstance(m, Linear) and m.fmt is not None]
    fp32 = sum(deq.get_submodule(n).weight.numel() * 4 for n in lin)  # the same linears held dequantized (fp32)
    assert fp32 > 3 * sum(held.values())  # FP8 is 4x smaller than fp32, FP4 8x, scales add < 1/30


def test_linear_dequantizes_per_use():
    from dsv4 import quant

    sim = _Sim(False)
    sim.resident = "quantized"
    lin = Linear(256, 130, sim, quantized=True)
    assert lin.weight.is_meta
    lin.hold("fp8", "cpu")
    q, s = quant.fp8_block_quant(torch.randn(130, 256, generator=torch.Generator().manual_seed(1)))
    lin.load_state_dict({"weight": q, "scale": s})
    assert lin.state_dict()["weight"].dtype == torch.float8_e4m3fn and tuple(lin.scale.shape) == (2, 2)
    assert lin.codes is lin.weight and lin.codes.dtype == torch.float8_e4m3fn
    assert_equal(lin.dequantized_weight(), quant.fp8_block_dequant(q, s), "Linear.dequantized_weight()")
    x = torch.randn(3, 256)
    assert_equal(lin(x), x @ quant.fp8_block_dequant(q, s).T, "Linear fp8 forward")
    with pytest.raises(ValueError, match="already holds"):
        lin.hold("fp8", "cpu")
    with pytest.raises(ValueError, match="not divisible by 32"):
        Linear(48, 8, sim, quantized=True).hold("fp4", "cpu")


def test_fp32_linear_held_bf16_computes_the_fp32_product():
    """fmt "bf16" (head / compressor wkv, wgate under weights="quantized"): the on-disk bf16 tensor loads without a
    rename, `dequantized_weight()` is its exact fp32 upcast and the forward is the fp32 product, bitwise."""
    sim = _Sim(True)
    sim.resident = "quantized"
    lin = Linear(64, 40, sim, quantized=False, fp32=True)
    lin.hold("bf16", "cpu")
    w = torch.randn(40, 64).to(torch.bfloat16)
    lin.load_state_dict({"weight": w})
    assert lin.codes.dtype == torch.bfloat16 and lin.state_dict()["weight"].dtype == torch.bfloat16
    assert_equal(lin.dequantized_weight(), w.float(), "bf16 upcast")
    x = torch.randn(3, 64).to(torch.bfloat16)
    y = lin(x)
    assert y.dtype == torch.float32
    assert_equal(y, x.float() @ w.float().T, "fp32 linear held bf16")
    with pytest.raises(ValueError, match=r"only an fp32-compute linear \(fp32=True\)"):
        Linear(64, 40, sim, quantized=True).hold("bf16", "cpu")


def test_bf16_held_weight_refuses_a_value_it_would_round(tiny_ckpt):
    """No quiet cast: a head / router value that bf16 cannot hold exactly is an error naming tensor and index; the
    same values rounded to bf16 first (what the checkpoint holds) load. Both loaders."""
    _, raw = load_checkpoint(tiny_ckpt, progress=False, dequantize=False, dtype=torch.float32)
    assert raw["head.weight"].dtype == torch.float32  # the BF16 tensor read in fp32: exact, loads
    m = Transformer(load_checkpoint(tiny_ckpt, progress=False, dequantize=False)[0], weights="quantized")
    m.load_weights(raw)
    assert_equal(m.head.codes.float(), raw["head.weight"], "head held bf16")
    for name in ("head.weight", "layers.1.ffn.gate.weight", "layers.2.attn.compressor.wgate.weight"):
        bad = dict(raw)
        bad[name] = raw[name].clone()
        bad[name][1, 2] += bad[name][1, 2].abs() * 2 ** -12  # between two bf16 values
        with pytest.raises(RuntimeError, match=rf"{name}: torch.float32 value .* at index \[1, 2\] \(1 values in all\) "
                                               "is not exactly representable in bf16"):
            m.load_weights(bad)


def test_errors(tiny_ckpt, tiny_ckpt_bf16):
    with pytest.raises(ValueError, match=r"weights='bogus'"):
        Transformer(tiny_args(vocab_size=512), weights="bogus")
    with pytest.raises(ValueError, match=r"dtype='bf16', expert_dtype='bf16' hold no FP8/FP4"):
        Transformer(tiny_args(vocab_size=512, dtype="bf16", scale_fmt=None, expert_dtype="bf16"), weights="quantized")
    with pytest.raises(CheckpointError, match=rf"{tiny_ckpt_bf16}.*no FP8/FP4 weight"):
        load_model(tiny_ckpt_bf16, progress=False, weights="quantized")
    with pytest.raises(CheckpointError, match=rf"{tiny_ckpt_bf16}.*no FP8/FP4 weight"):
        load_parallel_model(tiny_ckpt_bf16, Comm(), weights="quantized")
    args, sd = load_checkpoint(tiny_ckpt, progress=False)
    m = Transformer(args, weights="quantized")
    with pytest.raises(RuntimeError, match=r"missing=\['layers.0.attn.wkv.scale'"):
        m.load_weights(sd)  # dequantized weights cannot fill a quantized model
    _, raw = load_checkpoint(tiny_ckpt, progress=False, dequantize=False)
    raw["layers.0.attn.wq_a.weight"] = raw["layers.0.attn.wq_a.weight"].float()
    with pytest.raises(RuntimeError, match=r"layers.0.attn.wq_a.weight: dtype torch.float32 cannot load"):
        m.load_weights(raw)


# ------------------------------------------------------------------------------------------- world size 2
def test_misaligned_split_is_a_clear_error(tiny_ckpt):
    msg = r"layers.0.attn.wo_a.weight: weights='quantized' keeps FP8 128x128 blocks whole, but world_size=2"
    with pytest.raises(ValueError, match=msg):
        ParallelTransformer(tiny_args(vocab_size=512), Comm(0, 2), weights="quantized")
    with pytest.raises(ValueError, match=msg):
        load_rank_state_dict(tiny_ckpt, Comm(1, 2), weights="quantized")


@pytest.mark.parametrize("config", ["deepseek_v4_flash", "deepseek_v4_pro"])
def test_published_shapes_are_block_aligned(config):
    from dsv4.config import ModelArgs
    from dsv4.parallel import read_plan

    args = ModelArgs.from_hf_config(ROOT / f"fixtures/configs/{config}.config.json").with_layers(3)
    for w in (1, 2, 4, 8):
        check_quantized_split(args, w)
    plan = read_plan(args, Comm(7, 8), ["layers.2.attn.wo_b.scale", "layers.2.attn.wq_b.scale"])
    hd, g = args.n_heads * args.head_dim, args.o_groups * args.o_lora_rank
    assert plan == {"layers.2.attn.wo_b.scale": (1, 7 * g // 8 // 128, g // 8 // 128),
                    "layers.2.attn.wq_b.scale": (0, 7 * hd // 8 // 128, hd // 8 // 128)}


def test_rank_bytes_equal_rank_reads_and_memory_plan(aligned_ckpt):
    args = _aligned_args()
    total = dict.fromkeys(FAMILIES, 0)
    for r in range(2):
        m = ParallelTransformer(args, Comm(r, 2), dtype=torch.bfloat16, weights="quantized")
        assert held_bytes(m) == _plan_bytes(args, 2, r)  # every dtype: the plan is the bf16 model
        held = {k: held_bytes(m).get(k, 0) for k in FAMILIES}
        assert held == _bytes(load_rank_state_dict(aligned_ckpt, Comm(r, 2), weights="quantized")[1])
        total = {k: total[k] + held[k] for k in FAMILIES}
    whole = {k: held_bytes(Transformer(args, dtype=torch.bfloat16, weights="quantized")).get(k, 0) for k in FAMILIES}
    assert total["I8"] == whole["I8"]  # routed experts: each on exactly one rank
    assert all(whole[k] < total[k] < 2 * whole[k] for k in ("F8_E4M3", "F8_E8M0"))  # replicated + split halves


def _worker(out: str, ckpt: str) -> None:
    torch.set_num_threads(1)
    comm, _ = comm_from_env("cpu")
    ids = _ids(512)
    res = {w: _run(load_parallel_model(ckpt, comm, weights=w), ids) for w in ("dequantized", "quantized")}
    save_rank_result(res, out, comm.rank)


@pytest.fixture(scope="module")
def world2(tmp_path_factory, aligned_ckpt):
    return torchrun_workers(__file__, tmp_path_factory.mktemp("rq"), aligned_ckpt, cwd=ROOT)


def test_world2_quantized_equals_world2_dequantized_and_world1(world2, aligned_ckpt):
    ref, _ = load_model(aligned_ckpt, progress=False, weights="quantized")
    w1 = _run(ref, _ids(512))
    for step, want in enumerate(w1):
        got = world2[0]["quantized"][step]
        assert_equal(got, world2[0]["dequantized"][step], f"W=2 quantized vs dequantized step {step}")
        assert_equal(world2[1]["quantized"][step], got, f"W=2 rank 1 vs rank 0 step {step}")
        assert_close(got, want, f"W=2 vs W=1 quantized logits step {step}", atol=ATOL, rtol=RTOL)
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"greedy token differs at step {step}"


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
