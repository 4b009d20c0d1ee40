"""RoPE (spec §5): interleaved pairs, per-layer-type frequencies, no mscale, against hand computations.

* `apply_rope` against a float64 complex rotation of the interleaved pairs (x[2i] + i·x[2i+1])·e^(i·pos·f_i),
  the official `view_as_complex` convention; the inverse is the conjugate rotation.
* `rope_inv_freq` against the numbers the spec states for V4-Flash (rd 64, original_seq_len 65536, factor 16):
  ratio-0 layers f_i = 10000^(-2i/64) with no YaRN; ratio 4 / 128 layers θ = 160000 with the YaRN ramp between
  low = 15 and high = 25 (pairs 0..15 unchanged, 25..31 divided by 16, linear in between).
* every module of a tiny model (attention, compressor, indexer) carries the frequencies of its layer type.

Tolerances: fp32 outputs vs float64 rotation, fp32 table (rtol 1e-5, atol 1e-5; inputs O(1), positions up to
70000 whose angles are formed in float64 by both sides); frequencies rtol 1e-12 (float64 formulas).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4.config import ModelArgs
from dsv4.model import Transformer, apply_rope, rope_inv_freq
from dsv4.testing import assert_close
from dsv4.tiny import tiny_args

pytestmark = pytest.mark.hardstop  # RoPE per layer type (kills the RoPE mutants)

FLASH = Path(__file__).resolve().parents[2] / "fixtures" / "configs" / "deepseek_v4_flash.config.json"


def rope64(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """float64 complex rotation of interleaved pairs; x [..., s, (h,) rd], pos [s]."""
    z = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    ang = pos.double()[:, None] * inv_freq.double()[None, :]
    rot = torch.polar(torch.ones_like(ang), -ang if inverse else ang)
    if x.dim() == 4:
        rot = rot[:, None, :]
    return torch.view_as_real(z * rot).flatten(-2)


@pytest.mark.parametrize("heads", [False, True], ids=["bsd", "bshd"])
def test_apply_rope_rotates_interleaved_pairs(seed, heads):
    args = ModelArgs.from_hf_config(FLASH)
    pos = torch.tensor([0, 1, 2, 7, 127, 128, 4096, 70000])
    x = torch.randn(2, len(pos), *((3,) if heads else ()), args.rope_head_dim)
    for ratio in (0, 4):
        f = rope_inv_freq(args, ratio)
        y = apply_rope(x, pos, f)
        assert y.dtype == x.dtype
        assert_close(y, rope64(x, pos, f), f"rope ratio={ratio}")
        assert_close(apply_rope(x, pos, f, inverse=True), rope64(x, pos, f, inverse=True), f"inverse ratio={ratio}")
        assert_close(apply_rope(y, pos, f, inverse=True), x, "inverse(rope(x))")
        assert torch.equal(y[:, 0], x[:, 0]), "position 0 is the identity"
    # negative control: rotating (i, i + rd/2) halves is far from the interleaved rotation
    x0, x1 = x.double().chunk(2, -1)
    ang = pos.double()[:, None] * rope_inv_freq(args, 0)[None, :]
    cos, sin = (ang.cos(), ang.sin()) if not heads else (ang.cos()[:, None], ang.sin()[:, None])
    halves = torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1)
    with pytest.raises(AssertionError):
        assert_close(halves.float(), rope64(x, pos, rope_inv_freq(args, 0)), "half-split rotation")


def test_inv_freq_per_layer_type():
    args = ModelArgs.from_hf_config(FLASH)
    assert (args.rope_head_dim, args.original_seq_len, args.rope_factor) == (64, 65536, 16.0)
    i = torch.arange(32, dtype=torch.float64)
    plain = 10000.0 ** (-2 * i / 64)
    assert_close(rope_inv_freq(args, 0), plain, "ratio 0: theta 10000, no YaRN", rtol=1e-12, atol=0)
    base = 160000.0 ** (-2 * i / 64)
    ramp = ((i - 15) / 10).clamp(0, 1)  # low 15, high 25 (spec §5)
    want = base * (1 - ramp * 15 / 16)  # f (1 - ramp) + f / 16 ramp
    for ratio in (4, 128):
        got = rope_inv_freq(args, ratio)
        assert_close(got, want, f"ratio {ratio}: theta 160000 + YaRN", rtol=1e-12, atol=0)
        assert_close(got[:16], base[:16], "pairs 0..15 keep theta's frequency", rtol=1e-12, atol=0)
        assert_close(got[25:], base[25:] / 16, "pairs 25..31 divided by rope_factor", rtol=1e-12, atol=0)


def test_every_module_uses_its_layer_types_frequencies():
    args = tiny_args(vocab_size=512)
    model = Transformer(args)
    i = torch.arange(args.rope_head_dim // 2, dtype=torch.float64)
    for layer in model.layers:
        ratio = args.ratio(layer.layer_id)
        theta = args.rope_theta if ratio == 0 else args.compress_rope_theta
        plain = theta ** (-2 * i / args.rope_head_dim)
        attn = layer.attn
        mods = [("attn", attn)] + ([("compressor", attn.compressor)] if attn.compressor is not None else []) \
            + ([("indexer", attn.indexer), ("indexer.compressor", attn.indexer.compressor)]
               if attn.indexer is not None else [])
        for name, mod in mods:
            f = mod.inv_freq.double()
            if ratio == 0:
                assert_close(f, plain, f"layer {layer.layer_id} {name}", rtol=1e-12, atol=0)
            else:  # YaRN: the fastest pair keeps theta's frequency, the slowest is divided by rope_factor
                ends = torch.stack((f[0], f[-1]))
                want = torch.stack((plain[0], plain[-1] / args.rope_factor))
                assert_close(ends, want, f"layer {layer.layer_id} {name} YaRN ends", rtol=1e-12, atol=0)
        assert attn.scale == args.head_dim ** -0.5, f"layer {layer.layer_id}: softmax scale {attn.scale} (no mscale)"


def test_angles_are_formed_in_fp64_not_the_official_fp32_table(seed):
    """docs/differences.md M11. The official `precompute_freqs_cis` builds fp32 inverse frequencies and the angle
    table as an fp32 `outer(positions, freqs)`; dsv4 forms both in fp64 and rounds only cos / sin to fp32. At the
    Flash context's far end the fp32 table is off by up to ~|p f| 2^-24 rad (half an fp32 ulp of the angle, plus
    the fp32 frequency's own rounding times p): measured 6.0e-4 / 1.7e-3 rad at p = 65535 and 2.6e-2 / 2.4e-2 rad
    at p = 2^20 - 1 (the largest over the pairs, ratio-0 / ratio-4 layers; asserted > 3e-4 and > 1e-2). dsv4's
    rotation at those positions equals the fp64 one within the
    fp32 tolerance (rtol / atol 1e-5 on O(1) inputs); the official table's rotation is refused by it (control)."""
    args = ModelArgs.from_hf_config(FLASH)
    pos = torch.tensor([65535, 2**20 - 1, 777_777])
    for ratio in (0, 4):
        f64 = rope_inv_freq(args, ratio)
        f32 = f64.float()                                                    # the official fp32 frequencies
        official = torch.outer(pos.float(), f32).double()                     # the official fp32 angle table
        err = (official - pos.double()[:, None] * f64).abs()
        assert float(err[0].max()) > 3e-4 and float(err[1].max()) > 1e-2, err.max(-1).values
        x = torch.randn(1, 3, 4, args.rope_head_dim)
        want = rope64(x, pos, f64)
        assert_close(apply_rope(x, pos, f64), want.float(), f"apply_rope ratio {ratio}", rtol=1e-5, atol=1e-5)
        z = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
        fp32_rot = torch.view_as_real(z * torch.polar(torch.ones_like(official), official)[:, None, :]).flatten(-2)
        with pytest.raises(AssertionError):
            assert_close(fp32_rot.float(), want.float(), "control: the fp32 table", rtol=1e-5, atol=1e-5)
