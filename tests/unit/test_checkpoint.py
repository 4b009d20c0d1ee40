"""The official inventory (spec §11) and the fail-closed loader: every corruption names tensor, file, expectation.

Each corruption test edits a private copy of the tiny fp8 checkpoint (keeping the index and total_size
consistent, so only the intended fault is present) and matches the error message.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4.checkpoint import (INDEX_FILE, Checkpoint, CheckpointError, expected_tensors, inventory_bytes,
                             load_checkpoint)
from dsv4.config import ModelArgs
from dsv4.tiny import tiny_args

CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"


@pytest.fixture(scope="module")
def flash() -> ModelArgs:
    return ModelArgs.from_hf_config(CONFIGS / "deepseek_v4_flash.config.json")


def test_flash_inventory_matches_published_index(flash):
    inv = expected_tensors(flash, include_mtp=True)
    assert len(inv) == 69_187
    assert inventory_bytes(inv) == 159_609_485_896
    assert sum(k.startswith("mtp.0.") for k in inv) == 1_575
    assert Counter(dt for _, dt in inv.values()) == {"F8_E8M0": 34_167, "I8": 33_792, "BF16": 433, "F32": 417,
                                                     "F8_E4M3": 375, "I64": 3}
    per_layer = Counter(k.split(".")[1] for k in inv if k.startswith("layers."))
    assert (per_layer["0"], per_layer["3"], per_layer["2"]) == (1_565, 1_569, 1_576)  # SWA, HCA, CSA
    assert inv["layers.0.attn.wq_a.scale"] == ((8, 32), "F8_E8M0")
    assert inv["layers.5.attn.wo_a.weight"] == ((8192, 4096), "F8_E4M3")
    assert inv["layers.7.ffn.experts.255.w1.weight"] == ((2048, 2048), "I8")
    assert inv["layers.7.ffn.experts.0.w2.scale"] == ((4096, 64), "F8_E8M0")
    assert inv["layers.2.ffn.gate.tid2eid"] == ((129280, 6), "I64") and "layers.3.ffn.gate.tid2eid" not in inv
    assert inv["layers.4.attn.compressor.ape"] == ((4, 1024), "F32")
    assert inv["layers.3.attn.compressor.ape"] == ((128, 512), "F32")
    assert inv["mtp.0.ffn.gate.bias"] == ((256,), "F32") and "mtp.0.attn.compressor.ape" not in inv


def test_pro_inventory_and_subsets(flash):
    pro = ModelArgs.from_hf_config(CONFIGS / "deepseek_v4_pro.config.json")
    inv = expected_tensors(pro, include_mtp=True)
    assert len(inv) == 145_116
    assert inv["layers.0.attn.wq_a.weight"] == ((1536, 7168), "F8_E4M3")
    assert inv["layers.0.ffn.experts.383.w1.scale"] == ((3072, 224), "F8_E8M0")
    two = expected_tensors(flash, 2)
    assert {k.split(".")[1] for k in two if k.startswith("layers.")} == {"0", "1"}
    assert not any(k.startswith("mtp.") for k in two) and "hc_head_fn" in two and "head.weight" in two
    for bad in (0, 44, -1, 2.0):
        with pytest.raises(ValueError, match=f"n_layers={bad!r}: expected an integer in 1..43"):
            expected_tensors(flash, bad)


def test_bf16_inventory_has_no_scales():
    a = tiny_args(dtype="bf16", scale_fmt=None, expert_dtype="bf16")
    inv = expected_tensors(a, include_mtp=True)
    assert not any(k.endswith(".scale") for k in inv)
    assert {dt for _, dt in inv.values()} == {"BF16", "F32", "I64"}
    assert inv["layers.0.ffn.experts.7.w1.weight"] == ((32, 64), "BF16")


# ------------------------------------------------------------------------------------------- good paths
def test_load_subset_and_dtypes(tiny_ckpt):
    args, sd = load_checkpoint(tiny_ckpt, n_layers=2, progress=False)
    want = {k for k in expected_tensors(args.with_layers(2), 2) if not k.endswith(".scale")}
    assert set(sd) == want and args.n_layers == 2 and args.compress_ratios == (0, 4, 0)
    assert sd["layers.1.attn.wq_b.weight"].dtype == torch.float32
    assert sd["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    _, sd16 = load_checkpoint(tiny_ckpt, n_layers=1, include_mtp=True, dtype=torch.bfloat16, progress=True)
    # F32 on disk is never narrowed (test_f32_never_narrowed.py); BF16 and dequantized weights take `dtype`
    assert sd16["layers.0.hc_attn_fn"].dtype == torch.float32 and "mtp.0.e_proj.weight" in sd16
    assert sd16["layers.0.attn_norm.weight"].dtype == torch.bfloat16
    assert sd16["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert sd16["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert not any(k.startswith("layers.1.") for k in sd16)
    with pytest.raises(ValueError, match="n_layers=5: expected an integer in 1..4"):
        load_checkpoint(tiny_ckpt, n_layers=5, progress=False)


def test_get_raw_and_quantized_untouched(tiny_ckpt):
    ck = Checkpoint(tiny_ckpt)
    assert len(ck) == len(expected_tensors(ck.args, include_mtp=True))
    shard = ck.info("layers.1.ffn.experts.2.w3.weight")[2]
    raw = load_file(shard)
    w, s = ck.get_quantized("layers.1.ffn.experts.2.w3.weight")
    assert w.dtype == torch.int8 and torch.equal(w, raw["layers.1.ffn.experts.2.w3.weight"])
    assert s.dtype == torch.float8_e8m0fnu
    assert torch.equal(s.view(torch.uint8), raw["layers.1.ffn.experts.2.w3.scale"].view(torch.uint8))
    assert ck.get("layers.1.attn.attn_sink", dequantize=False).dtype == torch.float32
    scale = ck.get("layers.1.attn.wq_b.scale")
    assert torch.equal(torch.log2(scale), ck.get("layers.1.attn.wq_b.scale", dequantize=False)
                       .view(torch.uint8).float() - 127)
    with pytest.raises(KeyError, match="no tensor named 'layers.9.attn.wq_a.weight'"):
        ck.get("layers.9.attn.wq_a.weight")
    with pytest.raises(CheckpointError, match="embed.weight.*has no embed.scale"):
        ck.get_quantized("embed.weight")


def test_single_file_checkpoint(tiny_ckpt, tmp_path):
    d = tmp_path / "single"
    d.mkdir()
    (d / "config.json").write_text((tiny_ckpt / "config.json").read_text())
    merged = {}
    for f in sorted(tiny_ckpt.glob("model-*.safetensors")):
        merged.update(load_file(f))
    save_file(merged, str(d / "model.safetensors"))
    _, a = load_checkpoint(d, include_mtp=True, progress=False)
    _, b = load_checkpoint(tiny_ckpt, include_mtp=True, progress=False)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------- corruptions
def _edit(ckpt: Path, name: str, tensor: torch.Tensor | None, shard: str | None = None) -> Path:
    """Replace (tensor) or delete (None) `name` in its shard (or add it to `shard`), keeping the index valid."""
    index = json.loads((ckpt / INDEX_FILE).read_text())
    wm = index["weight_map"]
    fname = wm.get(name, shard)
    tensors = load_file(ckpt / fname)
    if tensor is None:
        del tensors[name], wm[name]
    else:
        tensors[name], wm[name] = tensor, fname
    save_file(tensors, str(ckpt / fname), metadata={"format": "pt"})
    total = 0
    for f in set(wm.values()):
        total += sum(t.numel() * t.element_size() for t in load_file(ckpt / f).values())
    index["metadata"]["total_size"] = total
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    return ckpt / fname


def _load(ckpt):
    return load_checkpoint(ckpt, include_mtp=True, progress=False)


def test_missing_tensor(tiny_ckpt, copy_ckpt):
    d = copy_ckpt(tiny_ckpt)
    _edit(d, "layers.1.attn.wq_a.scale", None)
    with pytest.raises(CheckpointError, match=r"missing tensor layers\.1\.attn\.wq_a\.scale \(expected shape "
                                              r"\[1, 1\] F8_E8M0"):
        _load(d)
    _, sd = load_checkpoint(d, n_layers=1, progress=False)  # layer 1 not requested: loads
    assert "layers.0.attn.wq_a.weight" in sd


def test_unexpected_tensor(tiny_ckpt, copy_ckpt):
    d = copy_ckpt(tiny_ckpt)
    f = _edit(d, "layers.0.attn.wq_a.weight_scale_inv", torch.ones(1, 1), shard="model-00002-of-00004.safetensors")
    with pytest.raises(CheckpointError, match=f"{f}: unexpected tensor layers.0.attn.wq_a.weight_scale_inv"):
        _load(d)


def test_shape_mismatch(tiny_ckpt, copy_ckpt):
    d = copy_ckpt(tiny_ckpt)
    f = _edit(d, "layers.2.attn.attn_sink", torch.randn(5))
    with pytest.raises(CheckpointError, match=rf"{f}: tensor layers.2.attn.attn_sink has shape \[5\], "
                                              r"expected \[4\]"):
        _load(d)


def test_dtype_mismatch(tiny_ckpt, copy_ckpt):
    d = copy_ckpt(tiny_ckpt)
    f = _edit(d, "layers.0.attn_norm.weight", torch.randn(64))
    with pytest.raises(CheckpointError, match=f"{f}: tensor layers.0.attn_norm.weight has dtype F32, "
                                              "expected BF16"):
        _load(d)


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_wrong_tensor_named_even_when_total_size_is_stale(tiny_ckpt, copy_ckpt, bad):
    """A shard rewritten with one wrong tensor and the index left as it was: the total_size mismatch used to be
    the only error (no tensor named); the tensor, its file and the expectation come first."""
    d = copy_ckpt(tiny_ckpt)
    index_text = (d / INDEX_FILE).read_text()
    t = torch.randn(65).bfloat16() if bad == "shape" else torch.randn(64)
    f = _edit(d, "layers.0.ffn_norm.weight", t)
    (d / INDEX_FILE).write_text(index_text)  # the original total_size, now stale
    want = "has shape \\[65\\], expected \\[64\\]" if bad == "shape" else "has dtype F32, expected BF16"
    with pytest.raises(CheckpointError, match=f"^{f}: tensor layers.0.ffn_norm.weight {want}$"):
        Checkpoint(d)


@pytest.mark.parametrize("bad", ["decoded_f32", "bytes_u8"])
def test_scale_of_wrong_dtype(tiny_ckpt, copy_ckpt, bad):
    d = copy_ckpt(tiny_ckpt)
    name = "layers.1.ffn.experts.0.w2.scale"
    good = Checkpoint(tiny_ckpt).get(name, dequantize=False)
    t = good.float() if bad == "decoded_f32" else good.view(torch.uint8)
    f = _edit(d, name, t)
    dt = "F32" if bad == "decoded_f32" else "U8"
    with pytest.raises(CheckpointError, match=f"{f}: tensor {name} has dtype {dt}, expected F8_E8M0 "
                                              r"\(ue8m0 exponent bytes"):
        _load(d)
    with pytest.raises(CheckpointError, match=f"{f}: tensor {name} has dtype {dt}, expected F8_E8M0"):
        Checkpoint(d).get("layers.1.ffn.experts.0.w2.weight")  # the accessor checks too


def test_index_names_missing_shard(tiny_ckpt, copy_ckpt):
    d = copy_ckpt(tiny_ckpt)
    (d / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: weight_map maps \d+ tensors "
                                              r"\(e.g. layers.2.\S+\) to shard model-00003-of-00004.safetensors, "
                                              r"but .*model-00003-of-00004.safetensors does not exist"):
        Checkpoint(d)


@pytest.mark.parametrize("cut", [1, 5000, 10**9], ids=["last_byte", "tail", "header"])
def test_truncated_shard(tiny_ckpt, copy_ckpt, cut):
    d = copy_ckpt(tiny_ckpt)
    f = d / "model-00002-of-00004.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:max(len(data) - cut, 20)])
    with pytest.raises(CheckpointError, match=f"{f}: truncated: "):
        _load(d)


def test_index_and_shard_disagree(tiny_ckpt, copy_ckpt):
    d = copy_ckpt(tiny_ckpt)
    index = json.loads((d / INDEX_FILE).read_text())
    index["weight_map"]["layers.0.attn.ghost"] = "model-00002-of-00004.safetensors"
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="maps tensor layers.0.attn.ghost to model-00002-of-00004.safetensors,"
                                              " but .* does not hold it"):
        Checkpoint(d)
    del index["weight_map"]["layers.0.attn.ghost"]
    del index["weight_map"]["norm.weight"]
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00001-of-00004.safetensors: holds 1 tensors that "
                                              r"model.safetensors.index.json does not map .*\(e.g. norm.weight\)"):
        Checkpoint(d)


def test_total_size_and_missing_files(tiny_ckpt, copy_ckpt):
    d = copy_ckpt(tiny_ckpt)
    index = json.loads((d / INDEX_FILE).read_text())
    index["metadata"]["total_size"] += 2
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"metadata.total_size=\d+, but the shards' tensors hold \d+ bytes"):
        Checkpoint(d)
    (d / INDEX_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors.index.json nor model.safetensors"):
        Checkpoint(d)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Checkpoint(d)


def test_missing_tensor_named_before_a_stale_total_size(tiny_ckpt, copy_ckpt):
    """A tensor deleted from its shard and the weight_map, metadata.total_size left as it was: the error names
    the missing tensor (not only the byte count); a deleted whole MTP block is not required there, and a stale
    total_size with every tensor present is still the byte-count error."""
    d = copy_ckpt(tiny_ckpt)
    stale = json.loads((d / INDEX_FILE).read_text())["metadata"]["total_size"]
    _edit(d, "layers.1.attn.wq_a.scale", None)
    index = json.loads((d / INDEX_FILE).read_text())
    index["metadata"]["total_size"] = stale
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(d))}: missing tensor layers\.1\.attn\.wq_a\.scale "
                                              r"\(expected shape \[1, 1\] F8_E8M0; 1 missing in all\)$"):
        Checkpoint(d)
    _edit(d, "layers.1.attn.wq_a.scale", torch.ones(1, 1).to(torch.float8_e8m0fnu),
          shard=index["weight_map"]["layers.1.attn.wq_a.weight"])
    index = json.loads((d / INDEX_FILE).read_text())
    assert Checkpoint(d).info("layers.1.attn.wq_a.scale")[0] == (1, 1)  # positive control: restored, it opens
    index["metadata"]["total_size"] += 2  # every tensor present: the byte count is the error
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"metadata.total_size=\d+, but the shards' tensors hold \d+ bytes"):
        Checkpoint(d)


def test_ambiguous_layout_is_refused(tiny_ckpt, copy_ckpt):
    """An index beside model.safetensors, a .safetensors file the index does not name, and (without an index)
    shards beside model.safetensors: each an error naming the file(s), where one of them was ignored silently.
    Files that are not .safetensors (README, *.py, tokenizer files) do not matter."""
    d = copy_ckpt(tiny_ckpt)
    (d / "README.md").write_text("hi")
    (d / "modeling_deepseek.py").write_text("")
    (d / "model-00005-of-00005.safetensors.tmp").write_text("")
    assert len(Checkpoint(d).shards) == 4  # positive control: other files are not looked at
    stray = d / "model-00005-of-00005.safetensors"
    shutil.copy(d / "model-00001-of-00004.safetensors", stray)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(d))}: 1 \.safetensors file\(s\) not named in "
                                              r"model\.safetensors\.index\.json: model-00005-of-00005\.safetensors; "):
        Checkpoint(d)
    stray.rename(d / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(d))}: holds both model\.safetensors\.index\.json "
                                              r"and model\.safetensors; expected one layout"):
        Checkpoint(d)
    (d / INDEX_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"holds model\.safetensors and other \.safetensors file\(s\) "
                                              r"\(model-00001-of-00004\.safetensors, .*model-00004-of-00004"
                                              r"\.safetensors\) without model\.safetensors\.index\.json"):
        Checkpoint(d)


# ------------------------------------------------------------------------------------------- hostile input
def _write_index(d: Path, doc) -> Path:
    (d / INDEX_FILE).write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return d / INDEX_FILE


@pytest.mark.parametrize("doc,message", [
    ([], r"top level is a JSON list, expected an object with a 'weight_map' object"),
    ("{", r"not valid JSON \(.*\); expected"),
    ({"weight_map": []}, r"'weight_map' is a list, expected a 'weight_map' object"),
    ({"metadata": {}}, r"no 'weight_map' key"),
    ({"weight_map": {"embed.weight": 3}}, r"weight_map\['embed.weight'\]=3, expected a shard file name"),
    ({"weight_map": {}, "metadata": {"total_size": "12"}}, r"metadata.total_size='12', expected a non-negative"),
    ({"weight_map": {}, "weight_mapp": {"embed.weight": "x.safetensors"}},
     r"unknown top-level key\(s\) 'weight_mapp'; expected only 'metadata' and 'weight_map'$"),
], ids=["list", "broken_json", "map_list", "no_map", "shard_int", "total_str", "unknown_key"])
def test_malformed_index_names_the_file(tiny_ckpt, copy_ckpt, doc, message):
    d = copy_ckpt(tiny_ckpt)
    index = _write_index(d, doc)
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(index))}: {message}"):
        Checkpoint(d)


def test_index_names_missing_shard_before_reading_headers(tiny_ckpt, copy_ckpt):
    d = copy_ckpt(tiny_ckpt)
    index = json.loads((d / INDEX_FILE).read_text())
    index["weight_map"]["embed.weight"] = "model-00009-of-00004.safetensors"  # shard 00001 still holds it
    _write_index(d, index)
    with pytest.raises(CheckpointError, match=r"index.json: weight_map maps 1 tensors \(e.g. embed.weight\) to "
                                              r"shard model-00009-of-00004.safetensors, but .* does not exist"):
        Checkpoint(d)


@pytest.mark.parametrize("where", ["parent", "absolute", "subdir"])
def test_shard_outside_the_directory_is_refused(tiny_ckpt, copy_ckpt, where):
    d = copy_ckpt(tiny_ckpt)
    good = "model-00004-of-00004.safetensors"
    evil = {"parent": d.parent / "evil.safetensors", "absolute": d.parent / "abs" / "evil.safetensors",
            "subdir": d / "sub" / "evil.safetensors"}[where]
    evil.parent.mkdir(exist_ok=True)
    (d / good).rename(evil)  # a real, valid shard: only the name in the index is wrong
    name = {"parent": "../evil.safetensors", "absolute": str(evil), "subdir": "sub/evil.safetensors"}[where]
    index = json.loads((d / INDEX_FILE).read_text())
    index["weight_map"] = {k: name if v == good else v for k, v in index["weight_map"].items()}
    _write_index(d, index)
    with pytest.raises(CheckpointError, match=rf"weight_map\['mtp.0.\S+'\]='{re.escape(name)}': expected a "
                                              r"plain file name inside the checkpoint directory"):
        Checkpoint(d)


def _rewrite_header(f: Path, edit) -> None:
    """Apply `edit(header dict)` to a shard's JSON header, keeping the data bytes."""
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


@pytest.mark.parametrize("shift,message", [(-1, "overlap tensor {a}"), (1, "leave a 1-byte gap after tensor {a}")],
                         ids=["overlap", "gap"])
def test_shard_offsets_back_to_back(tiny_ckpt, copy_ckpt, shift, message):
    d = copy_ckpt(tiny_ckpt)
    f = d / "model-00001-of-00004.safetensors"
    names = []

    def edit(h):
        a, b = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"])[:2]
        h[b]["data_offsets"] = [o + shift for o in h[b]["data_offsets"]]
        names.extend([a, b])

    _rewrite_header(f, edit)
    a, b = names
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(f))}: tensor {b}: data_offsets \d+..\d+ "
                                              rf"{message.format(a=a)} \(data bytes ..\d+\); expected the tensors "
                                              r"back to back"):
        Checkpoint(d)


# ---------------------------------------------------------------------------------------------- trailing bytes
@pytest.mark.parametrize("extra", [1, 4096], ids=["one_byte", "a_block"])
def test_bytes_after_the_last_tensor_are_named(tiny_ckpt, copy_ckpt, extra):
    """Bytes after the last tensor's data_offsets (a shard appended to, or written twice) are an error naming the
    file, the last tensor, where the header's data ends and the file's size; never ignored."""
    d = copy_ckpt(tiny_ckpt)
    f = d / "model-00002-of-00004.safetensors"
    size = f.stat().st_size
    with f.open("ab") as fh:
        fh.write(b"\x01" * extra)
    (n,) = struct.unpack("<Q", f.read_bytes()[:8])
    data = size - 8 - n
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(f))}: {extra} unexpected trailing bytes after the "
                                              rf"last tensor: the last tensor \S+ ends at data byte {data}, but the "
                                              rf"file holds {data + extra} data bytes \({size + extra} bytes in all: "
                                              rf"8 \+ {n} header \+ {data + extra}\); expected the file to end at "
                                              rf"byte {size}$"):
        Checkpoint(d)


# ---------------------------------------------------------------------------------------------- placeholder data
def _dry(tmp_path, name="dry"):
    from dsv4.synth import make_checkpoint

    return make_checkpoint(tmp_path / name, "tiny", 2, dry_run=True, log=None).path


def _densify(d: Path) -> None:
    """Rewrite every shard with its holes as stored zero bytes (what `rsync` without -S or a download does)."""
    for f in d.glob("*.safetensors"):
        f.write_bytes(f.read_bytes())


def _strip_markers(d: Path, index: bool = True, provenance: bool = True) -> None:
    if index:
        doc = json.loads((d / INDEX_FILE).read_text())
        del doc["metadata"]["dsv4_dry_run"]
        (d / INDEX_FILE).write_text(json.dumps(doc))
    if provenance:
        (d / "dsv4_synth.json").unlink()


def test_dry_run_output_is_refused_as_weights(tmp_path):
    """`make-checkpoint --dry-run` leaves the data as holes (zeros): it loaded, and diagnose passed both decisive
    tests on all-zero logits. The reader now refuses it by name, listing the evidence; a layout-only use opts in."""
    from dsv4.checkpoint import PlaceholderCheckpointError

    d = _dry(tmp_path)
    msg = (rf"^{re.escape(str(d))}: placeholder checkpoint, not weights: this is the layout written by `dsv4 "
           r"make-checkpoint --dry-run` \(tensor data left as holes, which read as zeros")
    with pytest.raises(PlaceholderCheckpointError, match=msg) as e:
        Checkpoint(d)
    assert e.value.evidence[:2] == [f"{INDEX_FILE} has metadata.dsv4_dry_run = true", "dsv4_synth.json has dry_run = true"]
    assert "allow_placeholder=True" in str(e.value)
    with pytest.raises(PlaceholderCheckpointError, match=msg):
        load_checkpoint(d, progress=False)
    ck = Checkpoint(d, allow_placeholder=True)  # the layout itself is complete and valid
    ck.validate(expected_tensors(ck.args, include_mtp=True))
    assert ck.placeholder == e.value.evidence


def test_load_model_names_a_placeholder_before_the_memory_plan(tmp_path, monkeypatch):
    """A dry-run checkpoint given to `load_model` first met the memory plan (whose advice, TEST_LAYERS or
    weights="quantized", cannot help), and only a second try said it holds no weights. The placeholder is named
    first now (control: the memory plan is never consulted)."""
    import dsv4.generate as g
    from dsv4.checkpoint import PlaceholderCheckpointError

    d = _dry(tmp_path)
    monkeypatch.setattr(g, "check_fits", lambda *a, **k: pytest.fail("the memory plan ran first"))
    with pytest.raises(PlaceholderCheckpointError, match="placeholder checkpoint, not weights"):
        g.load_model(d)


@pytest.mark.parametrize("keep", ["index_marker", "provenance", "holes"])
def test_each_placeholder_sign_alone_is_enough(tmp_path, keep):
    """Any one of the three signs is enough: the index marker (markers survive a dense copy), dsv4_synth.json's
    dry_run (an older dry run had no index marker), and the data itself being a hole (markers removed)."""
    from dsv4.checkpoint import PlaceholderCheckpointError

    d = _dry(tmp_path)
    _strip_markers(d, index=keep != "index_marker", provenance=keep != "provenance")
    if keep != "holes":
        _densify(d)
    with pytest.raises(PlaceholderCheckpointError) as e:
        Checkpoint(d)
    sign = {"index_marker": "metadata.dsv4_dry_run = true", "provenance": "dsv4_synth.json has dry_run = true",
            "holes": "is a hole (nothing stored, reads as zeros"}[keep]
    assert len(e.value.evidence) == 1 and sign in e.value.evidence[0], e.value.evidence


def test_real_data_is_not_a_placeholder(tiny_ckpt, copy_ckpt, tmp_path):
    """Negative controls: the tiny checkpoint, a written make-checkpoint (dry_run false) and a dense copy of a dry
    run with both markers removed (all-zero bytes stored: nothing tells it apart without reading every byte)
    open; a marker that is not a JSON boolean is an error naming the file."""
    from dsv4.checkpoint import placeholder_evidence
    from dsv4.synth import make_checkpoint

    assert Checkpoint(tiny_ckpt).placeholder == [] and placeholder_evidence(tiny_ckpt) == []
    real = make_checkpoint(tmp_path / "real", "tiny", 1, log=None).path
    assert json.loads((real / "dsv4_synth.json").read_text())["dry_run"] is False
    assert "dsv4_dry_run" not in json.loads((real / INDEX_FILE).read_text())["metadata"]
    assert Checkpoint(real).placeholder == []
    d = _dry(tmp_path)
    _strip_markers(d)
    _densify(d)
    assert Checkpoint(d).placeholder == []
    d = copy_ckpt(tiny_ckpt)
    doc = json.loads((d / INDEX_FILE).read_text())
    doc["metadata"]["dsv4_dry_run"] = 1
    (d / INDEX_FILE).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=rf"{INDEX_FILE}: metadata.dsv4_dry_run=1 has type int, expected "
                                              r"true or false"):
        Checkpoint(d)


def test_commands_refuse_a_dry_run_and_diagnose_names_it(tmp_path, capsys):
    """`dsv4 diagnose` / `dsv4 generate` on dry-run output: exit 2, the error names it; the report's source line
    (checkpoint identity) says placeholder data, not "random weights"."""
    from dsv4.cli import main
    from dsv4.diagnose import _checkpoint_identity

    d = _dry(tmp_path)
    for argv in (["diagnose", "--ckpt", str(d)], ["generate", "--ckpt", str(d), "--prompt", "x"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"dsv4 {argv[0]}: error: {d}: placeholder checkpoint, not weights"), err
    source = _checkpoint_identity(d, False)["source"]
    assert source.startswith("PLACEHOLDER data, not weights") and "random weights" not in source, source


# ------------------------------------------------------------------ symlink loops (issue 28)
def test_symlink_loops_are_named_as_loops(tiny_ckpt, copy_ckpt, tmp_path):
    """A link cycle for the directory, the index or a shard was reported as a missing file."""
    from dsv4.checkpoint import SymlinkLoopError

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(SymlinkLoopError, match=rf"^{re.escape(str(loop))}: symbolic link loop"):
        Checkpoint(loop)
    d = copy_ckpt(tiny_ckpt)
    shard = sorted(d.glob("*.safetensors"))[1]
    shard.unlink()
    shard.symlink_to(shard)
    with pytest.raises(CheckpointError, match=rf"but {re.escape(str(shard))} is a symbolic link loop"):
        Checkpoint(d)
    (d / INDEX_FILE).rename(d / "index.bak")
    (d / INDEX_FILE).symlink_to(d / INDEX_FILE)
    with pytest.raises(SymlinkLoopError, match=rf"{INDEX_FILE}: symbolic link loop"):
        Checkpoint(d)


def test_unknown_dtype_and_a_directory_shard_say_what_was_expected(tiny_ckpt, copy_ckpt):
    """A tensor stored as F8_E5M2 (not a format of the official checkpoint) named its dtype but not what was
    expected; a shard path that is a directory was "does not exist". Both now say what they are and expect."""
    d = copy_ckpt(tiny_ckpt)
    f = d / "model-00001-of-00004.safetensors"
    names = []

    def edit(h):
        name = next(k for k in h if k != "__metadata__")  # the dtype is checked before the sizes
        h[name]["dtype"] = "F8_E5M2"
        names.append(name)

    _rewrite_header(f, edit)
    with pytest.raises(CheckpointError, match=rf"{f}: tensor {names[0]}: unknown safetensors dtype 'F8_E5M2'; "
                                              r"expected one of .*BF16.*F8_E4M3.*F8_E8M0"):
        Checkpoint(d)
    f.unlink()  # the copy's other shards are intact: make it whole again from the original
    shutil.copyfile(tiny_ckpt / f.name, f)
    Checkpoint(d)  # control: the repaired copy loads
    d2 = d
    shard = d2 / "model-00003-of-00004.safetensors"
    shard.unlink()
    shard.mkdir()
    with pytest.raises(CheckpointError, match=r"to shard model-00003-of-00004.safetensors, but .* is a directory, "
                                              "not a file"):
        Checkpoint(d2)


def test_an_expert_tensor_mismatch_points_at_expert_dtype(tiny_ckpt, copy_ckpt):
    """config.json's expert_dtype "fp8" over FP4 experts failed on a scale's shape with nothing pointing at the
    config key; a routed expert's mismatch now names expert_dtype (control: a non-expert mismatch does not)."""
    d = copy_ckpt(tiny_ckpt)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg.get("expert_dtype", "fp4") == "fp4"
    cfg["expert_dtype"] = "fp8"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tensor layers\.\d+\.ffn\.experts\.\d+\.w\d\.\w+ has (shape|dtype) .*"
                                              r"; routed experts as config\.json's expert_dtype 'fp8' says$"):
        load_checkpoint(d, progress=False)
    cfg["expert_dtype"] = "fp4"
    (d / "config.json").write_text(json.dumps(cfg))
    _edit(d, "layers.0.attn_norm.weight", torch.randn(64))
    with pytest.raises(CheckpointError, match=r"has dtype F32, expected BF16$"):
        load_checkpoint(d, progress=False)
