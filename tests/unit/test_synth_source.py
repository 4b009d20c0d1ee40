"""The synthetic checkpoint source `synth:GEOMETRY[:LAYERS[:SEED]]` (dsv4.checkpoint.SynthCheckpoint, opened by
`open_source`; issue 16 item 1):
full depth without the files. The real loaders accept it in place of a directory; every tensor, and every rank's
part of a split tensor, is generated where it is read and must be bitwise what `dsv4 make-checkpoint` writes for
the same seed. Checked on CPU at the tiny geometry (its 4 layers: every tensor kind, hash and score routing, CSA /
HCA, FP8 + FP4): state dicts at world size 1 (both weight modes) and of each rank at world size 2, the rank parts
of split quantized tensors, and the logits of world size 1 and 2 (torchrun, gloo) from the files and from the
source (bitwise equal: same weights, same maths). Bad specs fail with the value named; the fail-closed value
checks run on generated tensors as on read ones.

This file is also the rank worker: `torchrun --nproc_per_node 2 tests/unit/test_synth_source.py OUT CKPT SPEC`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from dsv4.checkpoint import Checkpoint, CheckpointError, SynthCheckpoint, load_checkpoint, open_source
from dsv4.parallel import Comm, load_rank_state_dict, read_plan
from dsv4.synth import SEED_MAX, geometry_args, make_checkpoint, parse_source, synth_part, synth_tensor

pytestmark = pytest.mark.hardstop  # a synthetic full-depth run must run the weights a world-size-1 run checks

SEED = 7
SPEC = f"synth:tiny:4:{SEED}"
PROMPT = [0, 128803, 3085, 344, 270, 6102, 294, 8760, 33, 128804, 128821]
ROOT = Path(__file__).resolve().parents[2]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _assert_same_sd(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: names differ: {sorted(set(a) ^ set(b))[:5]}"
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (what, k, a[k].dtype, b[k].dtype)
        assert torch.equal(_bits(a[k]), _bits(b[k])), f"{what}: {k} differs"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """What `dsv4 make-checkpoint DIR --geometry tiny --seed 7` writes."""
    return make_checkpoint(tmp_path_factory.mktemp("synth_src") / "c", "tiny", seed=SEED, log=None).path


def test_spec_opens_a_synthetic_checkpoint_with_the_files_inventory(files):
    ck, disk = open_source(SPEC), open_source(files)
    assert type(ck) is SynthCheckpoint and type(disk) is Checkpoint
    assert ck.args == disk.args and ck.keys() == disk.keys()
    assert all(ck.info(n)[:2] == disk.info(n)[:2] for n in disk.keys())
    assert str(parse_source("synth:flash")) == "synth:flash:43:0" and parse_source("synth:pro:61").layers == 61
    assert open_source("synth:flash:3").args == geometry_args("flash", 3)
    with pytest.raises(ValueError, match="open_source"):  # the directory reader never turns into another class
        Checkpoint(SPEC)


@pytest.mark.parametrize("dequantize", [True, False])
def test_world1_state_dict_equals_the_files(files, dequantize):
    a1, disk = load_checkpoint(files, dequantize=dequantize, progress=False)
    a2, gen = load_checkpoint(SPEC, dequantize=dequantize, progress=False)
    assert a1 == a2
    _assert_same_sd(disk, gen, f"world size 1, dequantize={dequantize}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_world2_rank_state_dicts_equal_the_files(files, dtype):
    """Each rank's parts (split rows / columns, its experts) generated alone equal the parts read from the
    files; F32 parameters (attn_sink, split across ranks) stay float32 under a bf16 load, as at world size 1."""
    for rank in range(2):
        comm = Comm(rank, 2)
        _, disk = load_rank_state_dict(files, comm, dtype=dtype, n_layers=3)
        _, gen = load_rank_state_dict(SPEC, comm, dtype=dtype, n_layers=3)
        _assert_same_sd(disk, gen, f"rank {rank} of 2, {dtype}")
        assert not any(".experts.%d." % e in k for k in gen for e in range(8) if e // 4 != rank)
        _, other = load_rank_state_dict(f"synth:tiny:4:{SEED + 1}", comm, dtype=dtype, n_layers=1)
        assert not torch.equal(other["layers.0.attn.wq_b.weight"], gen["layers.0.attn.wq_b.weight"])  # control
        sink = gen["layers.1.attn.attn_sink"]
        assert sink.dtype == torch.float32
        assert torch.equal(sink, synth_tensor(geometry_args("tiny"), "layers.1.attn.attn_sink", SEED)[rank * 2:][:2])


def test_split_quantized_parts_equal_the_files(files):
    """weights="quantized" at W=2 keeps whole 128-blocks (wq_b: 256 rows = 2 blocks): the rank's codes and scale
    rows, generated alone, are the bytes of the files' slices (the tiny wo_a is not block-aligned at W=2, so the
    full quantized rank load is refused there; this checks the part path it takes at Flash / Pro width)."""
    disk, gen = open_source(files), open_source(SPEC)
    args = disk.args
    for rank in range(2):
        plan = read_plan(args, Comm(rank, 2), ["layers.1.attn.wq_b.weight", "layers.1.attn.wq_b.scale",
                                                 "layers.1.attn.wo_b.weight"])
        for name, part in plan.items():
            for raw in (True, False) if name.endswith(".weight") else (True,):  # a .scale is read raw only
                a = disk.load(name, part, dtype=torch.float32, device="cpu", raw=raw)
                b = gen.load(name, part, dtype=torch.float32, device="cpu", raw=raw)
                assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), (rank, name, raw)


def test_synth_part_is_the_narrow_of_the_whole():
    """Rows (dim 0, FP8 blocks straddled) and columns (dim 1, chunked) of quantized, scale, BF16 and F32 tensors."""
    args = geometry_args("tiny")
    cases = [("layers.1.attn.wo_a.weight", 0, 32, 32), ("layers.1.attn.wo_a.scale", 1, 0, 1),
             ("layers.1.attn.wq_b.weight", 0, 100, 60), ("layers.1.attn.wo_b.weight", 1, 33, 20),
             ("layers.1.attn.wo_b.scale", 0, 0, 1), ("embed.weight", 0, 129279, 1),
             ("layers.0.ffn.experts.5.w2.weight", 1, 3, 5), ("layers.0.ffn.experts.5.w2.scale", 0, 17, 30),
             ("layers.1.attn.attn_sink", 0, 1, 2), ("layers.0.ffn.gate.tid2eid", 0, 5, 3)]
    for name, dim, start, n in cases:
        whole = synth_tensor(args, name, SEED)
        for chunk in (None, 500):
            got = synth_part(args, name, SEED, dim, start, n, chunk_elems=chunk)
            assert got.dtype == whole.dtype and torch.equal(_bits(got), _bits(whole.narrow(dim, start, n))), name
    # negative control: quantizing a part from its own first row (not from the start of its 128-row FP8 block)
    # gives other codes: the block's scale depends on all its rows
    from dsv4.synth import _quant_rows

    q, _ = _quant_rows(SEED, "layers.1.attn.wq_b.weight", "F8_E4M3", 256, 32, 100, 160, "cpu")
    whole = synth_tensor(args, "layers.1.attn.wq_b.weight", SEED)
    assert not torch.equal(_bits(q), _bits(whole[100:160]))
    with pytest.raises(ValueError, match=r"part 60\.\.60\+10 of dim 1"):
        synth_part(args, "layers.1.attn.wo_b.weight", SEED, 1, 60, 10)


@pytest.mark.parametrize("spec, needle", [
    ("synth:foo", "unknown geometry 'foo'"), ("synth:flash:44", "LAYERS=44 is outside 1..43"),
    ("synth:pro:0", "LAYERS=0 is outside 1..61"), ("synth:pro:x", "LAYERS='x' is not a non-negative integer"),
    ("synth:tiny:2:-1", "SEED='-1' is not a non-negative integer"), ("synth:tiny:1:2:3", "4 fields"),
    ("synth:", "unknown geometry ''"),
    (f"synth:tiny:2:{SEED_MAX + 1}", f"SEED={SEED_MAX + 1} is above {SEED_MAX}")])
def test_bad_spec_names_the_value(spec, needle, capsys):
    with pytest.raises(ValueError, match="synthetic source") as e:
        open_source(spec)
    assert needle in str(e.value) and repr(spec) in str(e.value)
    from dsv4.cli import main
    assert main(["diagnose", "--ckpt", spec]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4 diagnose: error: --ckpt: synthetic source") and needle in err


def test_generated_nan_bytes_fail_closed(monkeypatch):
    """A generated tensor or part holding a NaN code is refused like a read one, naming the source."""
    import dsv4.synth as synth

    ck = open_source("synth:tiny:2:1")
    bad = torch.full((64,), float("nan"), dtype=torch.bfloat16)
    monkeypatch.setattr(synth, "synth_tensor", lambda *a, **k: bad)
    with pytest.raises(CheckpointError, match=r"synth:tiny:2:1: tensor norm.weight: non-finite value .* index \[0\]"):
        ck.get("norm.weight")
    codes = torch.zeros(32, 64, dtype=torch.uint8)
    codes[3, 5] = 0x7F
    monkeypatch.setattr(synth, "synth_part", lambda *a, **k: codes.view(torch.float8_e4m3fn))
    with pytest.raises(CheckpointError, match=r"tensor layers.1.attn.wo_a.weight: e4m3 NaN code .* index \[35, 5\]"):
        ck.raw_part("layers.1.attn.wo_a.weight", 0, 32, 32)


def test_diagnose_and_generate_say_the_weights_are_synthetic(tmp_path, capsys, monkeypatch):
    from dsv4.cli import main

    monkeypatch.setenv("TEST_LAYERS", "2")
    assert main(["diagnose", "--ckpt", "synth:tiny:2:3", "--dtype", "fp32", "--decode-steps", "1",
                 "--continue-tokens", "1", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "source: SYNTHETIC weights generated on load (tiny geometry, 2 layers, seed 3" in out
    assert "dsv4 make-checkpoint DIR --geometry tiny --layers 2 --seed 3" in out
    rep = json.loads((tmp_path / "r.json").read_text())["checkpoint"]
    assert rep["path"] == "synth:tiny:2:3" and rep["synthetic"]["source"] == "synthesized on load"
    assert main(["generate", "--ckpt", "synth:tiny:2:3", "--prompt", "Hi", "--max-tokens", "1"]) == 0
    assert "weights: SYNTHETIC (synth:tiny:2:3" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ world size 2 (gloo)
def _worker(out: str, ckpt: str, spec: str) -> None:
    """One rank: greedy logits of the model loaded from the files and from the source, saved to OUT.<rank>."""
    from dsv4.parallel import comm_from_env, load_parallel_model
    from dsv4.testing import greedy_logits, save_rank_result

    torch.set_num_threads(1)
    comm, _ = comm_from_env("cpu")
    ids = torch.tensor([PROMPT])
    res = {src: greedy_logits(load_parallel_model(src, comm, n_layers=4), ids, 2) for src in (ckpt, spec)}
    save_rank_result({"files": res[ckpt], "source": res[spec]}, out, comm.rank)


@pytest.mark.slow
def test_logits_from_the_source_equal_the_files_at_world_sizes_1_and_2(files, tmp_path):
    from dsv4.generate import load_model
    from dsv4.testing import greedy_logits, torchrun_workers

    ids = torch.tensor([PROMPT])
    w1 = {k: greedy_logits(load_model(src, progress=False)[0], ids, 2) for k, src in (("files", files),
                                                                                          ("source", SPEC))}
    w2 = torchrun_workers(__file__, tmp_path, files, SPEC, cwd=ROOT)
    for k, runs in (("world 1", [w1]), ("world 2", w2)):
        for r, run in enumerate(runs):
            for step, (a, b) in enumerate(zip(run["files"], run["source"])):
                assert a.abs().max() > 1.0, "degenerate logits would make the comparison meaningless"
                assert torch.equal(a, b), f"{k} rank {r} step {step}: logits from the source differ from the files'"
    assert torch.equal(w2[0]["source"][-1], w2[1]["source"][-1])


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
