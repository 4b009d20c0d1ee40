"""Synthetic real-geometry checkpoints (dsv4.synth, `dsv4 make-checkpoint`) on CPU at a cost CI can afford.

Flash and Pro are checked by layout (dry run: the real index and every shard's real safetensors header, data left
as holes) against `expected_tensors`, through `dsv4.checkpoint.Checkpoint`, which reads every header and checks
file sizes; the full write runs at tiny geometry through the same streaming writer. Values: bitwise equality
(a deterministic generator), independent of --layers, shard layout, chunking and MTP.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsv4.checkpoint import INDEX_FILE, Checkpoint, expected_tensors, inventory_bytes, load_checkpoint, read_index
from dsv4.cli import main as cli_main
from dsv4.config import ModelArgs
from dsv4.synth import (CONFIG_DIR, geometry_args, geometry_config, make_checkpoint, plan_shards, synth_quantized,
                        synth_tensor)


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    weight_map, _ = read_index(d / INDEX_FILE)
    out = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(str(d / shard), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.element_size() == 1
                                                                     else a, b.view(torch.uint8)
                                                                     if b.element_size() == 1 else b)


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("synth") / "c", "tiny", seed=7, log=None).path


def test_values_depend_on_seed_and_name_only(tiny4, tmp_path):
    """--layers 2, no MTP, 200 kB shards (many more files) hold bit-identical tensors to the 4-layer build, and
    `synth_tensor` called directly (another args object, small chunks) reproduces them: a loader can synthesize
    a rank's tensors without the files."""
    small = make_checkpoint(tmp_path / "s", "tiny", 2, seed=7, include_mtp=False, max_shard_bytes=200_000,
                            log=None)
    a, b = _tensors(tiny4), _tensors(small.path)
    assert small.n_shards > 6 and set(b) < set(a) and "layers.1.ffn.experts.3.w2.scale" in b
    assert not any(k.startswith(("layers.2.", "layers.3.", "mtp.")) for k in b)
    for k in b:
        assert _same(a[k], b[k]), k
    args2 = geometry_args("tiny", 2)
    for k in ("layers.1.ffn.experts.3.w2.weight", "layers.0.attn.wq_b.scale", "layers.0.ffn.gate.tid2eid",
              "embed.weight", "layers.1.hc_ffn_fn"):
        assert _same(synth_tensor(args2, k, seed=7, chunk_elems=1000), a[k]), k
    other = make_checkpoint(tmp_path / "o", "tiny", 1, seed=8, include_mtp=False, log=None)
    assert not torch.equal(_tensors(other.path)["layers.0.attn.wq_a.weight"].view(torch.uint8),
                           a["layers.0.attn.wq_a.weight"].view(torch.uint8))


@pytest.mark.parametrize("chunk", [1, 128, 4096])
def test_chunking_never_changes_values(chunk):
    args = geometry_args("tiny")
    for name in ("layers.0.attn.wq_b.weight", "layers.3.ffn.experts.7.w1.weight"):
        w, s = synth_quantized(args, name, seed=3)
        w2, s2 = synth_quantized(args, name, seed=3, chunk_elems=chunk)
        assert _same(w, w2) and _same(s, s2), name


def test_tiny_geometry_loads_runs_and_is_realistic(tiny4):
    ck = Checkpoint(tiny4)
    ck.validate(expected_tensors(ck.args, include_mtp=True))
    args, sd = load_checkpoint(tiny4, progress=False)
    assert args == geometry_args("tiny")
    raw = _tensors(tiny4)
    k = raw["layers.1.ffn.experts.3.w2.scale"].view(torch.uint8).unique()
    assert len(k) >= 4, k  # FP4 scales of one expert span several binades
    fp8 = [n.removesuffix(".weight") + ".scale" for n, t in raw.items() if t.dtype == torch.float8_e4m3fn]
    k = torch.cat([raw[n].view(torch.uint8).reshape(-1) for n in fp8]).unique()
    assert len(fp8) > 20 and len(k) >= 4, k  # and the FP8 block scales too
    tid = raw["layers.0.ffn.gate.tid2eid"]
    srt = tid.sort(1).values
    assert bool((srt[:, 1:] != srt[:, :-1]).all()) and tid.min() >= 0 and tid.max() < args.n_routed_experts
    assert len(torch.unique(tid, dim=0)) == args.n_routed_experts * (args.n_routed_experts - 1)  # every ordered pair
    z = sd["embed.weight"]
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
    from dsv4.model import Transformer

    m = Transformer(args)
    m.load_weights(sd)
    logits = m(torch.tensor([[0, 128803, 3085, 344, 270, 128804]]), m.new_state(1))
    assert bool(torch.isfinite(logits).all()) and float(logits.std()) > 0.1


@pytest.mark.parametrize("geometry,layers", [("flash", 43), ("flash", 4), ("pro", 2)])
def test_dry_run_layout_matches_the_inventory(tmp_path, geometry, layers):
    """Index + real headers of every shard, data as holes: Checkpoint reads every header (sizes included) and the
    whole layout validates against the official inventory; at full Flash depth it is the released index
    (69,187 tensors, total_size 159,609,485,896)."""
    rep = make_checkpoint(tmp_path / "c", geometry, layers, dry_run=True, log=None)
    ck = Checkpoint(rep.path, allow_placeholder=True)  # layout only: the data are holes, refused as weights
    published = ModelArgs.from_hf_config(CONFIG_DIR / f"deepseek_v4_{geometry}.config.json")
    assert ck.args == published.with_layers(layers) == geometry_args(geometry, layers)
    inv = expected_tensors(ck.args, include_mtp=True)
    ck.validate(inv)
    assert len(ck) == len(inv)
    _, total = read_index(rep.path / INDEX_FILE)
    assert total == inventory_bytes(inv)
    if (geometry, layers) == ("flash", 43):
        assert (len(ck), total, rep.n_shards) == (69187, 159_609_485_896, 45)
    files = sorted(p.name for p in rep.path.glob("model-*.safetensors"))
    assert files == [f"model-{i:05d}-of-{rep.n_shards:05d}.safetensors" for i in range(1, rep.n_shards + 1)]
    assert ck.info("layers.0.attn.wq_a.weight")[2].name == files[1]      # layer 0 starts shard 2, as released
    shard_of = {n: ck.info(n)[2].name for n in ck.keys()}
    last_main = max(f for n, f in shard_of.items() if not n.startswith("mtp."))
    assert min(f for n, f in shard_of.items() if n.startswith("mtp.")) > last_main  # MTP last
    assert max(os.path.getsize(rep.path / f) for f in files) <= 4.0e9 + 2**20
    used = sum(os.stat(rep.path / f).st_blocks * 512 for f in files)
    assert used < 64 << 20, f"dry run used {used} bytes of disk"
    cfg = json.loads((rep.path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == layers and cfg["hidden_size"] == published.dim


def test_dry_run_headers_are_the_written_headers(tiny4, tmp_path):
    dry = make_checkpoint(tmp_path / "d", "tiny", seed=7, dry_run=True, log=None).path
    for p in plan_shards(geometry_args("tiny")):
        a, b = (tiny4 / p.file).read_bytes(), (dry / p.file).read_bytes()
        assert a[:len(p.header)] == b[:len(p.header)] == p.header and len(a) == len(b) == p.size
    real_index, dry_index = json.loads((tiny4 / INDEX_FILE).read_text()), json.loads((dry / INDEX_FILE).read_text())
    assert dry_index["metadata"].pop("dsv4_dry_run") is True  # the marker the reader refuses it by
    assert real_index == dry_index


def test_not_enough_disk_fails_before_writing(tmp_path, monkeypatch):
    import shutil

    import dsv4.synth as synth

    real = shutil.disk_usage
    monkeypatch.setattr(synth.shutil, "disk_usage", lambda p: real(p)._replace(free=10**9))
    with pytest.raises(OSError, match=r"not enough free disk: the checkpoint needs 20\.01 GB .* 1\.00 GB free"):
        make_checkpoint(tmp_path / "f", "flash", 4, log=None)
    assert not (tmp_path / "f").exists()


def test_geometry_errors():
    with pytest.raises(ValueError, match=r"layers=5: expected an integer in 1\.\.4"):
        geometry_config("tiny", 5)
    with pytest.raises(ValueError, match="geometry='v3'"):
        geometry_config("v3")


def test_cli_make_checkpoint(tmp_path, capsys):
    assert cli_main(["make-checkpoint", str(tmp_path / "c"), "--geometry", "tiny", "--layers", "2",
                     "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "tiny geometry, 2 main layers" in out and "GB/s written" in out and "free at" in out
    assert Checkpoint(tmp_path / "c").args.n_layers == 2
    assert cli_main(["make-checkpoint", str(tmp_path / "c"), "--geometry", "tiny"]) == 2
    assert "dsv4 make-checkpoint: error:" in capsys.readouterr().err and "not an empty directory"
    assert cli_main(["make-checkpoint", str(tmp_path / "e"), "--geometry", "pro", "--layers", "62"]) == 2
    assert "1..61" in capsys.readouterr().err


def test_progress_inside_a_long_shard(tmp_path):
    """A 3-minute Flash shard was silent: inside a shard `make_checkpoint`'s log gets a line every
    `PROGRESS_EVERY_S` seconds (bytes and tensors so far); here every tensor (interval 0)."""
    from dsv4.synth import _write_shard

    args = geometry_args("tiny", 1)
    plan = plan_shards(args, include_mtp=False)[1]  # layers.0
    lines: list[str] = []
    _write_shard(tmp_path / plan.file, plan, args, 0, "cpu", False, lines.append, "  [2/3] x", every_s=0.0)
    assert len(lines) == len(plan.names) - 1 and lines[0].startswith("  [2/3] x: ")
    assert lines[-1].endswith("s)") and f"{len(plan.names) - 1} of {len(plan.names)} tensors" in lines[-1]
    assert (tmp_path / plan.file).stat().st_size == plan.size


@pytest.mark.parametrize("seed", [-1, 2**64, True, 1.5])
def test_make_checkpoint_refuses_a_seed_the_cli_would_refuse(tmp_path, seed):
    """A seed outside 0..2^64-1 gave a checkpoint (or a `synth:` source) whose rebuild command is refused."""
    with pytest.raises(ValueError, match=r"seed=.*: expected an integer in 0\.\.18446744073709551615"):
        make_checkpoint(tmp_path / "c", "tiny", 1, seed=seed, dry_run=True, log=None)
    assert not (tmp_path / "c").exists()
