"""Corrupt bytes fail closed: a checkpoint byte that decodes to NaN (ue8m0 scale 0xFF, e4m3fn code 0x7F / 0xFF,
a non-finite BF16 value) or a `tid2eid` expert id out of range makes every loader raise CheckpointError naming
the tensor, the shard file and the first bad index, in both weight modes and in the rank-local (split) reader.

Each case flips bytes of one tensor in a private copy of the tiny checkpoint at a fresh random position; the
negative control is the untouched checkpoint, which every loader accepts (and the same loaders without the check
would have returned NaN weights: `test_flip_reaches_the_weights` shows the flipped byte lands in the tensor).
"""

from __future__ import annotations

import json
import random
import re
import struct
from pathlib import Path

import pytest
import torch

from dsv4.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from dsv4.parallel import Comm, load_rank_state_dict
from tests.unit.test_resident_quant import aligned_ckpt  # noqa: F401  (fixture: 128-aligned splits at W=2)

MODES = {"dequantized": True, "quantized": False}


def _locate(ckpt: Path, name: str) -> tuple[Path, int, str, list[int]]:
    """(shard file, absolute byte offset of the tensor's data, dtype string, shape) from the safetensors header."""
    f = Checkpoint(ckpt).info(name)[2]
    with f.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        head = json.loads(fh.read(n))
    e = head[name]
    return f, 8 + n + e["data_offsets"][0], e["dtype"], e["shape"]


def _poke(ckpt: Path, name: str, index: tuple[int, ...], data: bytes) -> None:
    """Overwrite the element at `index` of tensor `name` with `data` (its raw little-endian bytes)."""
    f, off, dt, shape = _locate(ckpt, name)
    flat = 0
    for i, s in zip(index, shape):
        flat = flat * s + i
    with f.open("r+b") as fh:
        fh.seek(off + flat * len(data))
        fh.write(data)


def _random_index(shape: list[int], rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(s) for s in shape)


CASES = [  # (tensor, bytes written, what the message says)
    ("layers.1.ffn.experts.3.w2.scale", b"\xff", "ue8m0 scale byte 0xFF"),   # FP4 expert scale
    ("layers.0.attn.wq_b.scale", b"\xff", "ue8m0 scale byte 0xFF"),          # FP8 128x128 block scale
    ("layers.2.attn.wo_a.weight", b"\x7f", "e4m3 NaN code"),                 # +NaN e4m3fn code
    ("layers.0.attn.wq_a.weight", b"\xff", "e4m3 NaN code"),                 # -NaN e4m3fn code
    ("layers.3.attn_norm.weight", struct.pack("<H", 0x7FC0), "non-finite"),  # a BF16 NaN
    ("layers.0.ffn.gate.tid2eid", struct.pack("<q", 8), "expert id outside 0..7"),
]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name,data,what", CASES, ids=[c[0].split(".", 2)[-1] + f"={c[1].hex()}" for c in CASES])
def test_loader_fails_closed(tiny_ckpt, copy_ckpt, mode, name, data, what):
    ck = copy_ckpt(tiny_ckpt)
    rng = random.Random(f"{name}/{mode}/{random.random()}")
    shape = _locate(ck, name)[3]
    idx = _random_index(shape, rng)
    _poke(ck, name, idx, data)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ck, progress=False, dequantize=MODES[mode])
    msg = str(e.value)
    f = Checkpoint(ck).info(name)[2]
    assert f"{f}: tensor {name}: {what}" in msg and f"at index {list(idx)}" in msg and "1 bad" in msg, msg


@pytest.mark.parametrize("mode", list(MODES))
def test_untouched_checkpoint_loads(tiny_ckpt, mode):
    """Negative control: the same loaders accept the checkpoint as built (no false alarm on valid bytes, incl. the
    ue8m0 byte 0x00 = 2^-127 and the e4m3 codes 0x7E / 0xFE = +-448, which are not NaN)."""
    _, sd = load_checkpoint(tiny_ckpt, progress=False, dequantize=MODES[mode])
    floats = [v for v in sd.values() if v.dtype in (torch.float32, torch.bfloat16)]
    assert floats and all(bool(torch.isfinite(v).all()) for v in floats)


def test_edge_codes_are_not_nan(tiny_ckpt, copy_ckpt):
    """The largest finite codes sit next to NaN: 0x7E / 0xFE (e4m3 +-448) and 0xFE (ue8m0 2^127) must load."""
    ck = copy_ckpt(tiny_ckpt)
    _poke(ck, "layers.0.attn.wq_a.weight", (0, 0), b"\x7e")
    _poke(ck, "layers.0.attn.wq_a.weight", (0, 1), b"\xfe")
    _poke(ck, "layers.0.attn.wq_b.scale", (0, 0), b"\x00")
    _, sd = load_checkpoint(ck, progress=False, dequantize=False)
    w = sd["layers.0.attn.wq_a.weight"].float()
    assert w[0, 0] == 448.0 and w[0, 1] == -448.0
    assert sd["layers.0.attn.wq_b.scale"].view(torch.uint8)[0, 0] == 0


def test_flip_reaches_the_weights(tiny_ckpt, copy_ckpt):
    """The poke lands in the tensor the loader returns: read without the check, the weight holds the NaNs (32 for
    one FP4 scale byte: one scale covers 32 inputs), so the CheckpointError above is what stands between them and
    the model."""
    from safetensors import safe_open

    from dsv4 import quant

    ck = copy_ckpt(tiny_ckpt)
    name = "layers.1.ffn.experts.3.w2.scale"
    _poke(ck, name, (5, 1), b"\xff")
    f = Checkpoint(ck).info(name)[2]
    with safe_open(str(f), "pt") as h:
        w = quant.fp4_dequant(h.get_tensor(name.replace(".scale", ".weight")), h.get_tensor(name))
    assert int(torch.isnan(w).sum()) == 32 and bool(torch.isnan(w[5, 32:64]).all())


@pytest.mark.parametrize("mode", list(MODES))
def test_rank_local_reader_reports_the_full_tensor_index(tiny_ckpt, aligned_ckpt, copy_ckpt, mode):
    """World size 2: wq_b is split by rows; a NaN code in rank 1's half fails rank 1's load with the index in the
    full tensor, and rank 0, which never reads those bytes, loads. (quantized: the 128-aligned tiny checkpoint,
    since quantized splits keep 128x128 blocks whole.)"""
    ck = copy_ckpt(tiny_ckpt if mode == "dequantized" else aligned_ckpt)
    name = "layers.1.attn.wq_b.weight"
    out, inp = _locate(ck, name)[3]
    rng = random.Random()
    idx = (rng.randrange(out // 2, out), rng.randrange(inp))
    _poke(ck, name, idx, b"\x7f")
    load_rank_state_dict(ck, Comm(0, 2), weights=mode)
    with pytest.raises(CheckpointError, match=rf"tensor {name}: e4m3 NaN code \(0x7F / 0xFF\) at index "
                                              rf"\[{idx[0]}, {idx[1]}\]"):
        load_rank_state_dict(ck, Comm(1, 2), weights=mode)


# ------------------------------------------------------------------------- a user-built state dict
def _model_and_sd(ckpt: Path, dtype: torch.dtype, weights: str):
    from dsv4.model import Transformer

    args, sd = load_checkpoint(ckpt, n_layers=1, dtype=dtype, progress=False, dequantize=weights == "dequantized")
    return Transformer(args, dtype=dtype, weights=weights), sd


@pytest.mark.parametrize("name,weights,poke,what", [
    ("layers.0.attn.wq_a.weight", "dequantized", float("nan"), "non-finite value (NaN / inf)"),
    ("layers.0.hc_attn_fn", "dequantized", float("-inf"), "non-finite value (NaN / inf)"),
    ("norm.weight", "dequantized", float("nan"), "non-finite value (NaN / inf)"),
    ("layers.0.attn.wq_b.weight", "quantized", 0x7F, "e4m3 NaN code (0x7F / 0xFF)"),
    ("layers.0.ffn.experts.1.w1.scale", "quantized", 0xFF, "ue8m0 scale byte 0xFF (NaN)"),
    ("layers.0.ffn.gate.tid2eid", "dequantized", 8, "expert id outside 0..7"),
], ids=["nan_weight", "inf_f32", "nan_norm", "e4m3_code", "ue8m0_byte", "tid2eid"])
def test_load_weights_refuses_a_non_finite_state_dict(tiny_ckpt, name, weights, poke, what):
    """`Transformer.load_weights` with a state dict built by the caller (not read by the checked loader): a NaN /
    inf, a NaN code or byte, an out-of-range expert id is refused naming the tensor and the first bad index, and
    nothing is loaded. Negative control: the same state dict without the poke loads."""
    model, sd = _model_and_sd(tiny_ckpt, torch.float32, weights)
    model.load_weights(sd)  # negative control: the clean state dict loads
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = random.Random()
    t = sd[name].clone()
    index = _random_index(list(t.shape), rng)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        t.view(torch.uint8)[index] = poke
    else:
        t[index] = poke
    with pytest.raises(ValueError, match=rf"^load_weights: tensor {name} \({t.dtype}, shape \[.*\]\): "
                                         rf"{re.escape(what)} at index {re.escape(str(list(index)))} \(1 bad of "
                                         rf"{t.numel()}\); refusing to load it"):
        model.load_weights({**sd, name: t})
    after = model.state_dict()
    assert all(torch.equal(before[k].view(torch.uint8) if before[k].dtype.itemsize == 1 else before[k],
                           after[k].view(torch.uint8) if after[k].dtype.itemsize == 1 else after[k])
               for k in before)  # nothing was loaded


def test_load_weights_names_a_value_that_overflows_in_the_cast(tiny_ckpt):
    """A finite value beyond bf16's range (here float32 3.4e38, above bf16's largest 3.39e38) becomes inf in the
    cast to a bf16 parameter: refused, saying so. (A float64 tensor, the old way to reach this, is refused by its
    dtype before any cast: `Transformer.load_weights` takes the checkpoint's float32 / bfloat16 only.)"""
    model, sd = _model_and_sd(tiny_ckpt, torch.bfloat16, "dequantized")
    name = "layers.0.attn.wkv.weight"
    t = sd[name].float()
    index = _random_index(list(t.shape), random.Random())
    t[index] = 3.4e38
    with pytest.raises(ValueError, match=rf"tensor {name} \(torch.bfloat16, .*non-finite value \(NaN / inf\) at "
                                         rf"index {re.escape(str(list(index)))} .*the given torch.float32 value "
                                         r"3.4\d*e\+38 overflows torch.bfloat16"):
        model.load_weights({**sd, name: t})
    with pytest.raises(RuntimeError, match=rf"^{name}: dtype torch.float64 cannot load into the model's "
                                           r"torch.bfloat16 \(expected torch.bfloat16 or torch.float32"):
        model.load_weights({**sd, name: t.double()})


def test_load_weights_names_a_value_that_is_not_a_tensor(tiny_ckpt):
    """A numpy array (or list) in a user-built state dict died in `.to` with an AttributeError naming nothing."""
    model, sd = _model_and_sd(tiny_ckpt, torch.float32, "dequantized")
    with pytest.raises(TypeError, match=r"^load_weights: state_dict\['norm.weight'\] is a ndarray, expected a "
                                        r"torch.Tensor of shape \[64\]$"):
        model.load_weights({**sd, "norm.weight": sd["norm.weight"].numpy()})


@pytest.mark.parametrize("weights", ["dequantized", "quantized"])
def test_dequantization_overflow_is_refused_at_load(tiny_ckpt, copy_ckpt, weights):
    """Why the loaders check the values again after the readers' byte check: valid bytes can still decode to inf.
    The e4m3 code 0x7E (448) in a block whose ue8m0 scale is 0xFE (2^127) passes the byte check (neither byte is
    a NaN code; `test_edge_codes_are_not_nan`), but 448 * 2^127 overflows float32. Both weight modes and both
    loaders (`load_model` -> `load_weights`, and the rank loader `load_parallel_model`) refuse it by name.
    Negative control: the same poke with scale 0xF0 (2^113, product 2^121.8: finite) loads."""
    from dsv4.generate import load_model
    from dsv4.parallel import load_parallel_model

    name = "layers.0.attn.wq_a.weight"
    ck = copy_ckpt(tiny_ckpt)
    _poke(ck, name, (0, 0), b"\x7e")
    for scale_byte, bad in ((b"\xf0", False), (b"\xfe", True)):
        _poke(ck, "layers.0.attn.wq_a.scale", (0, 0), scale_byte)
        load_checkpoint(ck, progress=False, dequantize=weights == "dequantized")  # the byte check: no error
        want = rf"^load_weights: tensor {name} \(.*\): (non-finite value \(NaN / inf\)|dequantizes to inf) at " \
               r"index \[0, 0\]"
        for load in (lambda: load_model(ck, progress=False, dtype=torch.float32, weights=weights),
                     lambda: load_parallel_model(ck, Comm(), dtype=torch.float32, weights=weights)):
            if bad:
                with pytest.raises(ValueError, match=want):
                    load()
            else:
                load()
