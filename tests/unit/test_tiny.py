"""Tiny checkpoints: official layout, real dtypes, realistic weights, deterministic, and the loader round trip.

Round-trip bounds (round to nearest): FP8 e4m3 |err| <= max(2^-4 |w|, 2^-10 s) with s the 128x128 block
scale; FP4 e2m1 |err| <= max(s/4, |w|/4) with s the 1x32 scale; BF16 is compared bit-exactly with
`w.to(bfloat16)`; F32 exactly; I64 exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections import Counter
from pathlib import Path

import pytest
import torch

from dsv4 import quant
from dsv4.checkpoint import INDEX_FILE, Checkpoint, expected_tensors, load_checkpoint
from dsv4.cli import main as cli_main
from dsv4.config import ModelArgs
from dsv4.tiny import make_tiny, random_state_dict, tiny_args


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return random_state_dict(tiny_args(), seed=0)


def test_tiny_args_contract():
    a = tiny_args()
    assert (a.vocab_size, a.dim, a.n_layers, a.compress_ratios, a.n_hash_layers) == (129280, 64, 4,
                                                                                    (0, 4, 128, 4, 0), 1)
    assert (a.n_heads, a.head_dim, a.rope_head_dim, a.q_lora_rank, a.o_groups, a.o_lora_rank) == (4, 64, 16, 32,
                                                                                                   2, 32)
    assert (a.window_size, a.index_n_heads, a.index_head_dim, a.index_topk) == (8, 4, 32, 4)
    assert (a.n_routed_experts, a.n_activated_experts, a.n_shared_experts, a.moe_inter_dim) == (8, 2, 1, 32)
    assert (a.route_scale, a.swiglu_limit, a.hc_mult, a.hc_sinkhorn_iters) == (1.5, 10.0, 4, 20)
    assert (a.rope_theta, a.compress_rope_theta, a.rope_factor, a.original_seq_len) == (1e4, 1.6e5, 16.0, 64)
    assert (a.dtype, a.expert_dtype, a.n_mtp_layers) == ("fp8", "fp4", 1)
    # the indexer must select: below 4*topk = 16 tokens everything causal is taken (spec §14.11)
    assert a.index_topk < 32 // a.compress_ratios[1]
    assert tiny_args(index_topk=2).index_topk == 2


@pytest.mark.parametrize("variant", ["fp8", "bf16"])
def test_layout_and_config(variant, tiny_ckpt, tiny_ckpt_bf16):
    d = tiny_ckpt if variant == "fp8" else tiny_ckpt_bf16
    names = {p.name for p in d.iterdir()}
    shards = sorted(n for n in names if n.startswith("model-"))
    assert shards == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    assert {"config.json", "generation_config.json", INDEX_FILE, "tokenizer.json", "tokenizer_config.json"} <= names
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v4" and cfg["compress_ratios"] == [0, 4, 128, 4, 0]
    if variant == "fp8":
        assert cfg["expert_dtype"] == "fp4" and cfg["quantization_config"]["scale_fmt"] == "ue8m0"
        assert ModelArgs.from_hf_config(d) == tiny_args()
    else:
        assert cfg["expert_dtype"] == "bf16" and "quantization_config" not in cfg
    index = json.loads((d / INDEX_FILE).read_text())
    wm = index["weight_map"]
    assert wm["embed.weight"] == shards[0] and wm["layers.0.attn.wq_a.weight"] == shards[1]
    assert wm["layers.3.attn.wq_a.weight"] == shards[2] and wm["mtp.0.e_proj.weight"] == shards[3]
    assert index["metadata"]["total_size"] == sum(f.stat().st_size for f in d.glob("model-*")) - sum(
        8 + int.from_bytes(f.read_bytes()[:8], "little") for f in d.glob("model-*"))
    ck = Checkpoint(d)
    hist = Counter(ck.info(n)[1] for n in ck.keys())
    want = {"BF16", "F32", "I64"} | ({"F8_E4M3", "F8_E8M0", "I8"} if variant == "fp8" else set())
    assert set(hist) == want
    assert sum(f.stat().st_size for f in d.iterdir()) < 64 * 2**20
    tok = json.loads((d / "tokenizer.json").read_text())
    assert max(t["id"] for t in tok["added_tokens"]) == ck.args.vocab_size - 1


def test_fp8_roundtrip_every_tensor(tiny_ckpt, weights):
    args, sd = load_checkpoint(tiny_ckpt, include_mtp=True, progress=False)
    assert set(sd) == set(weights)  # every tensor accounted for, no .scale leaked
    ck = Checkpoint(tiny_ckpt)
    lossy = 0
    for name, w in weights.items():
        got = sd[name]
        shape, dt, _ = ck.info(name)
        if dt in ("F8_E4M3", "I8"):
            scale = quant.e8m0_to_float(ck.get(name.removesuffix(".weight") + ".scale", dequantize=False))
            if dt == "F8_E4M3":
                s = scale.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
                bound = torch.maximum(w.abs() * 2.0 ** -4, s * 2.0 ** -10)
            else:
                s = scale.repeat_interleave(32, 1)
                bound = torch.maximum(s / 4, w.abs() / 4)
            err = (got - w).abs()
            assert bool((err <= bound).all()), f"{name}: max err/bound {float((err / bound).max()):.3f}"
            lossy += bool(err.max() > 0)
        elif dt == "BF16":
            assert torch.equal(got, w.to(torch.bfloat16).float()), name
        else:
            assert got.dtype == w.dtype and torch.equal(got, w), name
    assert lossy > 100  # quantization really happened on the FP8/FP4 tensors


def test_bf16_variant_holds_same_weights(tiny_ckpt_bf16, weights):
    _, sd = load_checkpoint(tiny_ckpt_bf16, include_mtp=True, dtype=torch.bfloat16, progress=False)
    assert set(sd) == set(weights)
    f32 = {n for n, (_, dt) in expected_tensors(tiny_args(), include_mtp=True).items() if dt == "F32"}
    for name, w in weights.items():  # F32 tensors are never narrowed to bf16 on load (the official fp32 params)
        want = w if w.dtype == torch.int64 else w.float() if name in f32 else w.to(torch.bfloat16)
        assert sd[name].dtype == want.dtype and torch.equal(sd[name], want), name


def test_scales_span_many_binades(tiny_ckpt):
    ck = Checkpoint(tiny_ckpt)
    fp8 = {int(b) for n in ck.keys() if n.endswith(".scale") and ck.info(n.replace(".scale", ".weight"))[1]
           == "F8_E4M3" for b in ck.get(n, dequantize=False).view(torch.uint8).unique()}
    fp4 = {int(b) for n in ck.keys() if ".experts." in n and n.endswith(".scale")
           for b in ck.get(n, dequantize=False).view(torch.uint8).unique()}
    assert len(fp8) >= 5 and len(fp4) >= 6, (sorted(fp8), sorted(fp4))


def test_weights_are_realistic(weights):
    a = tiny_args()
    for name in ("layers.0.attn.attn_sink", "layers.3.attn.compressor.ape", "layers.1.attn.indexer.compressor.ape",
                 "layers.2.ffn.gate.bias", "mtp.0.ffn.gate.bias"):
        assert bool((weights[name] != 0).all()) and weights[name].std() > 0.02, name
    for site in ("attn", "ffn"):
        base, scale = weights[f"layers.1.hc_{site}_base"], weights[f"layers.1.hc_{site}_scale"]
        assert len(base.unique()) == base.numel() and len(scale.unique()) == 3 and bool((scale > 0).all())
    fn = weights["layers.1.hc_attn_fn"]
    x = torch.randn(100, fn.shape[1])
    m = (x @ fn.T) * x.pow(2).mean(-1, keepdim=True).rsqrt()
    assert 0.3 < float(m.std()) < 3  # mHC mixing logits O(1): Sinkhorn, pre and post non-trivial
    tid = weights["layers.0.ffn.gate.tid2eid"]
    assert tid.shape == (a.vocab_size, a.n_activated_experts) and tid.dtype == torch.int64
    assert int(tid.min()) == 0 and int(tid.max()) == a.n_routed_experts - 1
    assert bool((tid[:, 0] != tid[:, 1]).all())  # distinct experts per row (spec §8.7)
    assert "layers.1.ffn.gate.tid2eid" not in weights and "layers.0.ffn.gate.bias" not in weights
    for name in ("layers.0.attn.wq_a.weight", "layers.2.ffn.experts.5.w2.weight", "head.weight"):
        assert 0.02 < float(weights[name].std()) < 1.0, name


def test_deterministic_and_seeded(tmp_path, tiny_ckpt):
    def digest(d: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}

    again = make_tiny(tmp_path / "again", "fp8", seed=0)
    assert digest(again) == digest(tiny_ckpt)
    name = "layers.0.attn.wq_a.weight"
    assert not torch.equal(random_state_dict(tiny_args(), seed=1)[name], random_state_dict(tiny_args())[name])
    with pytest.raises(FileExistsError, match="not an empty directory"):
        make_tiny(again)
    with pytest.raises(ValueError, match="variant='fp4': expected one of"):
        make_tiny(tmp_path / "x", "fp4")


def test_file_modes_follow_umask(tmp_path):
    """Shards get the same mode as config.json & co (safetensors' save_file alone would make them 0600)."""
    old = os.umask(0o027)
    try:
        d = make_tiny(tmp_path / "m", "bf16")
    finally:
        os.umask(old)
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in d.iterdir()}
    assert len(modes) == 9 and modes == dict.fromkeys(modes, oct(0o640)), modes


def test_cli_make_tiny(tmp_path, capsys):
    assert cli_main(["make-tiny", str(tmp_path / "c"), "--variant", "bf16"]) == 0
    assert "bf16" in capsys.readouterr().out
    _, sd = load_checkpoint(tmp_path / "c", n_layers=1, progress=False)
    assert len(sd) == len([k for k in expected_tensors(tiny_args(dtype="bf16", scale_fmt=None,
                                                                 expert_dtype="bf16"), 1)])
    with pytest.raises(SystemExit):  # a stray TEST_LAYERS=... argument is an error, never swallowed
        cli_main(["make-tiny", str(tmp_path / "d"), "TEST_LAYERS=2"])
