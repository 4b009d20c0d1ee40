"""The DeepSeek-V4 checkpoint on disk: the tensor inventory, a validating memory-mapped reader, and the loader.

Layout (reference spec §11): a directory holding `config.json`, `model.safetensors.index.json`
(`{"metadata": {"total_size": N}, "weight_map": {name: shard}}`) and the shards it names, or one
`model.safetensors`. Tensor names are the official ones (`embed.weight`, `layers.N.attn.wq_a.weight`,
`layers.N.attn.wq_a.scale`, `mtp.0.e_proj.weight`, ...): no `model.` prefix, `.scale` (never
`weight_scale_inv`). safetensors dtype strings: F8_E4M3, F8_E8M0, I8, BF16, F32, I64.

Quantized weights (spec §2, decoded by `dsv4.quant`):
    FP8   `X.weight` F8_E4M3 [out, in]    + `X.scale` F8_E8M0 [ceil(out/128), ceil(in/128)]
    FP4   `X.weight` I8      [out, in/2]  + `X.scale` F8_E8M0 [out, in/32]   (routed experts only)

Everything here fails closed: a missing or unexpected tensor, a wrong shape or dtype, an index naming a
missing shard, a truncated shard, a scale that is not F8_E8M0 -> `CheckpointError` naming the tensor, the
file and what was expected. Nothing is renamed, cast or skipped silently. Every tensor read is checked for bytes
that decode to NaN (`check_values`: ue8m0 0xFF, e4m3 0x7F/0xFF, non-finite BF16/F32) and `tid2eid` for expert
ids outside 0..n_routed_experts-1, on the device it is loaded to; the error names tensor, file and first index.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from dsv4.config import ModelArgs, loads_json
from dsv4 import quant

__all__ = ["CheckpointError", "PlaceholderCheckpointError", "placeholder_evidence", "PLACEHOLDER_KEY", "Checkpoint", "expected_tensors", "load_checkpoint", "DTYPE_BYTES",
           "INDEX_FILE", "SINGLE_FILE", "TORCH_DTYPES", "inventory_bytes", "read_index", "check_values",
           "find_bad_values",
           "cast_unquantized"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPE_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4,
               "I64": 8, "F64": 8, "BOOL": 1, "I16": 2, "U16": 2, "U32": 4, "U64": 8}
TORCH_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8,
                "BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64}

Inventory = dict[str, tuple[tuple[int, ...], str]]


class CheckpointError(ValueError):
    """A checkpoint that does not match the official layout; the message names tensor, file, expectation."""


# ---------------------------------------------------------------------------------------------- inventory
def _linear(inv: Inventory, name: str, out: int, inp: int, fmt: str) -> None:
    """Add `name.weight` (and `name.scale`) for a [out, inp] linear stored as `fmt` (fp8 | fp4 | bf16)."""
    if fmt == "fp8":
        inv[f"{name}.weight"] = ((out, inp), "F8_E4M3")
        inv[f"{name}.scale"] = ((math.ceil(out / 128), math.ceil(inp / 128)), "F8_E8M0")
    elif fmt == "fp4":
        if inp % 32:
            raise ValueError(f"{name}: FP4 needs in_features divisible by 32, got {inp}")
        inv[f"{name}.weight"] = ((out, inp // 2), "I8")
        inv[f"{name}.scale"] = ((out, inp // 32), "F8_E8M0")
    elif fmt == "bf16":
        inv[f"{name}.weight"] = ((out, inp), "BF16")
    else:  # ModelArgs validates dtype/expert_dtype; this is unreachable for a valid config
        raise ValueError(f"{name}: unknown weight format {fmt!r}")


def _block(inv: Inventory, a: ModelArgs, p: str, ratio: int, hash_layer: bool) -> None:
    """Tensors of one transformer block with prefix `p` (`layers.N.` or `mtp.K.`); spec §11 block table."""
    d, hc, q, wfmt = a.dim, a.hc_mult, a.q_lora_rank, a.dtype
    mix = (2 + hc) * hc
    for n in ("attn_norm", "ffn_norm"):
        inv[f"{p}{n}.weight"] = ((d,), "BF16")
    for site in ("attn", "ffn"):
        inv[f"{p}hc_{site}_fn"] = ((mix, hc * d), "F32")
        inv[f"{p}hc_{site}_base"] = ((mix,), "F32")
        inv[f"{p}hc_{site}_scale"] = ((3,), "F32")
    inv[f"{p}attn.attn_sink"] = ((a.n_heads,), "F32")
    _linear(inv, f"{p}attn.wq_a", q, d, wfmt)
    inv[f"{p}attn.q_norm.weight"] = ((q,), "BF16")
    _linear(inv, f"{p}attn.wq_b", a.n_heads * a.head_dim, q, wfmt)
    _linear(inv, f"{p}attn.wkv", a.head_dim, d, wfmt)
    inv[f"{p}attn.kv_norm.weight"] = ((a.head_dim,), "BF16")
    _linear(inv, f"{p}attn.wo_a", a.o_groups * a.o_lora_rank, a.n_heads * a.head_dim // a.o_groups, wfmt)
    _linear(inv, f"{p}attn.wo_b", d, a.o_groups * a.o_lora_rank, wfmt)
    if ratio:
        c = 2 if ratio == 4 else 1  # CSA (ratio 4) compresses two overlapping series
        for w in ("wkv", "wgate"):
            inv[f"{p}attn.compressor.{w}.weight"] = ((c * a.head_dim, d), "BF16")
        inv[f"{p}attn.compressor.norm.weight"] = ((a.head_dim,), "BF16")
        inv[f"{p}attn.compressor.ape"] = ((ratio, c * a.head_dim), "F32")
    if ratio == 4:
        _linear(inv, f"{p}attn.indexer.wq_b", a.index_n_heads * a.index_head_dim, q, wfmt)
        inv[f"{p}attn.indexer.weights_proj.weight"] = ((a.index_n_heads, d), "BF16")
        for w in ("wkv", "wgate"):
            inv[f"{p}attn.indexer.compressor.{w}.weight"] = ((2 * a.index_head_dim, d), "BF16")
        inv[f"{p}attn.indexer.compressor.norm.weight"] = ((a.index_head_dim,), "BF16")
        inv[f"{p}attn.indexer.compressor.ape"] = ((4, 2 * a.index_head_dim), "F32")
    inv[f"{p}ffn.gate.weight"] = ((a.n_routed_experts, d), "BF16")
    if hash_layer:
        inv[f"{p}ffn.gate.tid2eid"] = ((a.vocab_size, a.n_activated_experts), "I64")
    else:
        inv[f"{p}ffn.gate.bias"] = ((a.n_routed_experts,), "F32")
    if a.n_shared_experts:
        inter = a.n_shared_experts * a.moe_inter_dim
        _linear(inv, f"{p}ffn.shared_experts.w1", inter, d, wfmt)
        _linear(inv, f"{p}ffn.shared_experts.w2", d, inter, wfmt)
        _linear(inv, f"{p}ffn.shared_experts.w3", inter, d, wfmt)
    for e in range(a.n_routed_experts):
        _linear(inv, f"{p}ffn.experts.{e}.w1", a.moe_inter_dim, d, a.expert_dtype)
        _linear(inv, f"{p}ffn.experts.{e}.w2", d, a.moe_inter_dim, a.expert_dtype)
        _linear(inv, f"{p}ffn.experts.{e}.w3", a.moe_inter_dim, d, a.expert_dtype)


def _hc_head(inv: Inventory, a: ModelArgs, p: str) -> None:
    inv[f"{p}hc_head_fn"] = ((a.hc_mult, a.hc_mult * a.dim), "F32")
    inv[f"{p}hc_head_base"] = ((a.hc_mult,), "F32")
    inv[f"{p}hc_head_scale"] = ((1,), "F32")


def expected_tensors(args: ModelArgs, n_layers: int | None = None, include_mtp: bool = False) -> Inventory:
    """The official tensor inventory: name -> (shape, safetensors dtype string); spec §11.

    Globals (`embed`, `head`, `norm`, `hc_head_*`) always; main blocks `layers.0 .. layers.{n_layers-1}`
    (default all `args.n_layers`); MTP blocks `mtp.K.*` (ratio `compress_ratios[args.n_layers + K]`) only with
    `include_mtp`. FP8 weights (`args.dtype == "fp8"`) come with an F8_E8M0 `.scale`; a bf16 checkpoint has BF16
    weights and no `.scale`; routed experts follow `args.expert_dtype` (fp4: I8 [out, in/2] + scale [out, in/32]).
    Hash layers (`N < n_hash_layers`, main blocks only) hold `ffn.gate.tid2eid` I64 [V, k] instead of
    `ffn.gate.bias`. For the Flash config with MTP this is 69,187 tensors and 159,609,485,896 bytes.

    Raises:
        ValueError: `n_layers` not in 1..args.n_layers; `include_mtp` with `n_mtp_layers` blocks but fewer
            than `n_layers + n_mtp_layers` entries in `compress_ratios`; FP4 with in_features % 32 != 0.
    """
    n = args.n_layers if n_layers is None else n_layers
    if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= args.n_layers):
        raise ValueError(f"n_layers={n_layers!r}: expected an integer in 1..{args.n_layers}")
    inv: Inventory = {"embed.weight": ((args.vocab_size, args.dim), "BF16")}
    for i in range(n):
        _block(inv, args, f"layers.{i}.", args.compress_ratios[i], i < args.n_hash_layers)
    inv["norm.weight"] = ((args.dim,), "BF16")
    inv["head.weight"] = ((args.vocab_size, args.dim), "BF16")
    _hc_head(inv, args, "")
    if include_mtp:
        for k in range(args.n_mtp_layers):
            j = args.n_layers + k
            if j >= len(args.compress_ratios):
                raise ValueError(f"ModelArgs.compress_ratios has {len(args.compress_ratios)} entries: expected "
                                 f"an entry at index {j} for MTP block mtp.{k}")
            p = f"mtp.{k}."
            _block(inv, args, p, args.compress_ratios[j], False)
            for w in ("e_proj", "h_proj"):
                _linear(inv, f"{p}{w}", args.dim, args.dim, args.dtype)
            for nm in ("enorm", "hnorm", "norm"):
                inv[f"{p}{nm}.weight"] = ((args.dim,), "BF16")
            _hc_head(inv, args, p)
    return inv


def inventory_bytes(inv: Inventory) -> int:
    """Total data bytes of an inventory (what `model.safetensors.index.json` calls `total_size`)."""
    return sum(math.prod(shape) * DTYPE_BYTES[dt] for shape, dt in inv.values())


# ---------------------------------------------------------------------------------------------- values
_BAD_VALUE = {"F8_E8M0": "ue8m0 scale byte 0xFF (NaN)", "F8_E4M3": "e4m3 NaN code (0x7F / 0xFF)",
              "BF16": "non-finite value (NaN / inf)", "F32": "non-finite value (NaN / inf)"}


def check_values(t: torch.Tensor, dt: str, name: str, file: str | Path, offset: tuple[int, ...] = (),
                 n_experts: int | None = None) -> None:
    """Fail closed on bytes that decode to NaN (reference spec §2): a ue8m0 scale byte 0xFF, an e4m3fn code with
    all exponent and mantissa bits set (0x7F / 0xFF), a non-finite BF16 / F32 value. FP4 e2m1 (I8) and I64 have
    no NaN encoding and are not checked here.

    Runs where `t` lives (the target device while loading): one or two reductions per tensor (max of the bytes;
    a float32 sum for BF16 / F32), the exact mask only when they flag something; cost measured at real size by
    benchmarks/measure_real_width.py. `offset` is added to the reported index when
    `t` is a slice (rows / columns of a tensor split across ranks). With `n_experts`, an I64 tensor (`tid2eid`)
    must hold expert ids in 0..n_experts-1 (a wrong id would route tokens to another expert, or index out of range).

    Args: t: the on-disk tensor (float8_e8m0fnu / float8_e4m3fn / bfloat16 / float32), any shape; dt: its
        safetensors dtype string; name, file: for the message.
    Raises CheckpointError naming the file, the tensor, the first bad index (in the full tensor) and how many
    elements are bad.
    """
    found = find_bad_values(t, dt, n_experts)
    if found is None:
        return
    what, idx, n_bad = found
    idx = [i + o for i, o in zip(idx, offset)] + idx[len(offset):]
    raise CheckpointError(f"{file}: tensor {name}: {what} at index {idx} ({n_bad} bad of "
                          f"{t.numel()}{' in the part read' if any(offset) else ''}); the checkpoint is corrupt, "
                          "refusing to load it")


def find_bad_values(t: torch.Tensor, dt: str, n_experts: int | None = None) -> tuple[str, list[int], int] | None:
    """The value check of `check_values` without the message: None when `t` (safetensors dtype string `dt`) holds
    no value that decodes to NaN / inf (and, with `n_experts`, an I64 tensor no id outside 0..n_experts-1); else
    (what is wrong, the first bad index in `t`, the number of bad elements). One or two reductions where `t`
    lives; the exact mask only when they flag something."""
    what = _BAD_VALUE.get(dt)
    if dt == "I64" and n_experts is not None:
        what = f"expert id outside 0..{n_experts - 1}"
    if what is None or t.numel() == 0:
        return None
    # fast screen (one or two reductions), then the exact mask only when something is suspect
    if dt == "I64":
        suspect = int(t.min()) < 0 or int(t.max()) >= n_experts
    elif dt == "F8_E8M0":
        suspect = int(t.view(torch.uint8).max()) == 0xFF
    elif dt == "F8_E4M3":  # 0xFF is the largest byte, 0x7F the largest int8
        suspect = int(t.view(torch.uint8).max()) == 0xFF or int(t.view(torch.int8).max()) == 0x7F
    else:  # NaN / inf propagate into the sum (an overflowing sum of finite values is cleared below)
        suspect = not bool(torch.isfinite(t.sum(dtype=torch.float32)))
    if not suspect:
        return None
    if dt == "I64":
        bad = (t < 0) | (t >= n_experts)
    elif dt == "F8_E8M0":
        bad = t.view(torch.uint8) == 0xFF
    elif dt == "F8_E4M3":
        bad = (t.view(torch.uint8) & 0x7F) == 0x7F
    else:
        bad = ~torch.isfinite(t)
    if not bool(bad.any()):
        return None
    flat = int(torch.nonzero(bad.reshape(-1))[0])
    idx = []
    for size in reversed(t.shape):
        idx.append(flat % size)
        flat //= size
    return what, idx[::-1], int(bad.sum())


# ---------------------------------------------------------------------------------------------- reading
def cast_unquantized(t: torch.Tensor, dt: str, dtype: torch.dtype) -> torch.Tensor:
    """A BF16 / F32 on-disk tensor `t` (safetensors dtype `dt`) in the floating `dtype` asked for, except that F32
    is never narrowed below float32: the official model keeps its F32 tensors (hc_*, attn_sink, ape, gate.bias)
    as fp32 parameters in every mode, so rounding them to bf16 would change the bf16 model's numerics."""
    if dt == "F32" and torch.finfo(dtype).bits < 32:
        return t.to(torch.float32)
    return t.to(dtype)


def _read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Parse and check one safetensors header: name -> (dtype string, shape).

    Raises CheckpointError naming the file for: a file shorter than its header, invalid JSON, a tensor named
    twice in the header (JSON would keep the last entry silently), an unknown dtype,
    a tensor whose byte range does not match its shape, data that ends before the header says (truncated),
    trailing bytes after it, and byte ranges that overlap or leave a gap (safetensors stores the tensors
    back to back from data byte 0; the message names both tensors).
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated: {size} bytes, expected at least an 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(f"{path}: truncated: header declares {n} header bytes, file holds {size - 8}")
        try:
            header = loads_json(f.read(n), f"{path}: safetensors header")
        except ValueError as e:  # invalid JSON, or a tensor named twice (json would keep the last entry)
            raise CheckpointError(str(e)) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        try:
            dt, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            ints = [*shape, begin, end]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name}: malformed header entry {info!r} (expected dtype, "
                                  "shape and data_offsets [begin, end])") from None
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
            raise CheckpointError(f"{path}: tensor {name}: malformed header entry {info!r} (shape and "
                                  "data_offsets must be non-negative integers)")
        if dt not in DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name}: unknown safetensors dtype {dt!r}")
        shape = tuple(shape)
        if end - begin != math.prod(shape) * DTYPE_BYTES[dt]:
            raise CheckpointError(f"{path}: tensor {name}: data_offsets {begin}..{end} do not hold shape "
                                  f"{list(shape)} of {dt} ({math.prod(shape) * DTYPE_BYTES[dt]} bytes)")
        spans.append((begin, end, name))
        out[name] = (dt, shape)
    spans.sort()
    pos, prev = 0, None
    for begin, end, name in spans:
        if begin != pos:
            after = f"tensor {prev} (data bytes ..{pos})" if prev else "the start of the data section"
            what = f"overlap {after}" if begin < pos else f"leave a {begin - pos}-byte gap after {after}"
            raise CheckpointError(f"{path}: tensor {name}: data_offsets {begin}..{end} {what}; expected the "
                                  f"tensors back to back, this one starting at data byte {pos}")
        pos, prev = end, name
    if pos > data_len:
        raise CheckpointError(f"{path}: truncated: tensor {prev} ends at data byte {pos}, but the file holds "
                              f"only {data_len} data bytes ({size} bytes in all)")
    if pos < data_len:  # bytes no tensor owns: a shard written twice, appended to, or a header that lost tensors
        last = f"the last tensor {prev} ends at data byte {pos}" if prev else "the header lists no tensor"
        raise CheckpointError(f"{path}: {data_len - pos} unexpected trailing bytes after the last tensor: {last}, "
                              f"but the file holds {data_len} data bytes ({size} bytes in all: 8 + {n} header + "
                              f"{data_len}); expected the file to end at byte {8 + n + pos}")
    return out


def _shard_name_ok(shard: object) -> bool:
    """A plain file name (no directory part, not absolute, not `.`/`..`), so the shard lies in the directory."""
    return (isinstance(shard, str) and shard not in ("", ".", "..") and "/" not in shard and "\\" not in shard
            and "\0" not in shard and Path(shard).name == shard and not Path(shard).is_absolute())


def read_index(index: str | Path) -> tuple[dict[str, str], int | None]:
    """Parse and check `model.safetensors.index.json`: (weight_map {tensor name: shard file name}, total_size).

    `total_size` (bytes, `metadata.total_size`) is None when the index has no metadata. Shard names are not
    checked for existence here (`Checkpoint` does that), only for form.

    Raises:
        CheckpointError (naming the index file): not UTF-8 JSON; a key twice in one object (a tensor mapped
            twice: JSON would keep the last shard silently); the top level is not an object; no
            `weight_map` object; a tensor name or shard that is not a string; a shard that is not a plain file
            name inside the checkpoint directory (`../x.safetensors`, `/abs/x.safetensors`, `sub/x`: the path
            escape is refused, naming the tensor); `metadata` not an object; `total_size` not a
            non-negative integer.
    """
    index = Path(index)
    try:
        doc = loads_json(index.read_bytes(), str(index))
    except ValueError as e:  # invalid JSON, or a tensor mapped twice (json would keep the last shard)
        raise CheckpointError(f"{e}; expected {{\"metadata\": {{\"total_size\": N}}, "
                              f"\"weight_map\": {{tensor: shard}}}}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{index}: top level is a JSON {type(doc).__name__}, expected an object with a "
                              "'weight_map' object")
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict):
        got = "no 'weight_map' key" if weight_map is None else f"'weight_map' is a {type(weight_map).__name__}"
        raise CheckpointError(f"{index}: {got}, expected a 'weight_map' object {{tensor name: shard file}}")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{index}: weight_map[{name!r}]={shard!r}, expected a shard file name (string)")
        if not _shard_name_ok(shard):
            raise CheckpointError(f"{index}: weight_map[{name!r}]={shard!r}: expected a plain file name inside "
                                  f"the checkpoint directory {index.parent} (no directory part, not absolute)")
    meta = doc.get("metadata", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise CheckpointError(f"{index}: 'metadata'={meta!r}, expected an object with 'total_size'")
    total = meta.get("total_size")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
        raise CheckpointError(f"{index}: metadata.total_size={total!r}, expected a non-negative integer (bytes)")
    return weight_map, total


PLACEHOLDER_KEY = "dsv4_dry_run"  # index metadata key written by `dsv4 make-checkpoint --dry-run` (true)
PROVENANCE_FILE = "dsv4_synth.json"  # = dsv4.synth.PROVENANCE_FILE (`"dry_run": true` for a dry run)


class PlaceholderCheckpointError(CheckpointError):
    """The checkpoint holds placeholder data, not weights: the output of `dsv4 make-checkpoint --dry-run` (tensor
    data left as holes, which read as zeros). `evidence` lists what showed it."""

    def __init__(self, path: Path, evidence: list[str]) -> None:
        self.path, self.evidence = path, evidence
        super().__init__(f"{path}: placeholder checkpoint, not weights: this is the layout written by `dsv4 "
                         f"make-checkpoint --dry-run` (tensor data left as holes, which read as zeros; a model on it "
                         f"computes nothing). Evidence: {'; '.join(evidence)}. Write the data with `dsv4 "
                         "make-checkpoint` without --dry-run; a layout-only use can open it with "
                         "Checkpoint(path, allow_placeholder=True)")


def _data_is_holes(f: Path) -> bool:
    """True when the data section of safetensors file `f` (after its header) is non-empty and nothing of it is
    stored beyond the file-system block it shares with the header (SEEK_DATA / SEEK_HOLE: the rest is a hole,
    which reads as zeros), and the stored part of that block is zeros. Nothing is read from a dense file (a real
    shard: one extent from the header to the end). False where the file system cannot tell (no SEEK_DATA)."""
    import errno
    import os

    st = f.stat()
    size = st.st_size
    with f.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return False
        start = 8 + struct.unpack("<Q", head)[0]
        if start >= size or not hasattr(os, "SEEK_DATA"):
            return False
        blk = max(getattr(st, "st_blksize", 4096) or 4096, 4096)
        shared_end = min(-(-start // blk) * blk, size)  # the end of the header's last block
        fd = fh.fileno()
        try:
            data = os.lseek(fd, start, os.SEEK_DATA)
        except OSError as e:
            return e.errno == errno.ENXIO  # ENXIO: a hole from the data's start to the end; else cannot tell
        if data >= shared_end:
            return data >= size
        end = os.lseek(fd, data, os.SEEK_HOLE)
        if end > shared_end:  # data stored past the header's block: a real data section
            return False
        fh.seek(data)
        if fh.read(end - data).strip(b"\0"):
            return False
        try:
            return os.lseek(fd, end, os.SEEK_DATA) >= size
        except OSError as e:
            return e.errno == errno.ENXIO


def placeholder_evidence(path: str | Path, shards: list[Path] | None = None) -> list[str]:
    """What shows that checkpoint directory `path` holds placeholder data (`dsv4 make-checkpoint --dry-run`), as
    sentences; [] for a checkpoint with data. Looked at: the index's `metadata.dsv4_dry_run` (written by the dry
    run), `dsv4_synth.json`'s `"dry_run"`, and the data itself: a shard whose data section is entirely a hole
    (`_data_is_holes`; this catches a dry run of an older dsv4 that wrote no marker, or one with its markers
    removed). `shards` (default: every `*.safetensors` in `path`) are the files checked for holes.

    Raises CheckpointError naming the file for a marker that is not a JSON boolean.
    """
    path = Path(path)
    found: list[str] = []
    index = path / INDEX_FILE
    if index.is_file():
        try:
            meta = loads_json(index.read_bytes(), str(index)).get("metadata")
        except (ValueError, AttributeError):
            meta = None  # read_index names a malformed index
        if isinstance(meta, dict) and PLACEHOLDER_KEY in meta:
            v = meta[PLACEHOLDER_KEY]
            if not isinstance(v, bool):
                raise CheckpointError(f"{index}: metadata.{PLACEHOLDER_KEY}={v!r} has type {type(v).__name__}, "
                                      "expected true or false (a JSON boolean)")
            if v:
                found.append(f"{index.name} has metadata.{PLACEHOLDER_KEY} = true")
    prov = path / PROVENANCE_FILE
    if prov.is_file():
        try:
            doc = loads_json(prov.read_bytes(), str(prov))
        except ValueError:
            doc = None
        if isinstance(doc, dict) and doc.get("dry_run") is not False and "dry_run" in doc:
            found.append(f"{PROVENANCE_FILE} has dry_run = {json.dumps(doc['dry_run'])}")
    files = sorted(path.glob("*.safetensors")) if shards is None else shards
    holes = [f for f in files if _data_is_holes(f)]
    if holes:
        found.append(f"the tensor data of {len(holes)} of {len(files)} shard(s) is a hole (nothing stored, reads "
                     f"as zeros; e.g. {holes[0].name})")
    return found


class Checkpoint:
    """A DeepSeek-V4 checkpoint directory, memory-mapped through `safetensors.safe_open`.

    Opening reads `config.json` (`.args`), the index (or the single `model.safetensors`) and every shard's
    header, and checks that they agree; tensor data is read only by `get` / `get_quantized`.
    `Checkpoint("synth:GEOMETRY[:LAYERS[:SEED]]")` returns a `dsv4.synth.SynthCheckpoint` instead: the same
    reader over tensors generated where they are read (bitwise what `dsv4 make-checkpoint` writes; no file).

    Raises (from the constructor):
        FileNotFoundError: no config.json, or neither an index nor `model.safetensors`.
        CheckpointError: a malformed index (see `read_index`; a shard name that is not a plain file name in
            the directory is refused, never read); the index names a shard that does not exist (checked for
            every shard before any header is read); the index and a shard disagree about a tensor (missing
            from its shard, or a shard holding a tensor the index does not list); a truncated or malformed
            shard, or one whose tensors' byte ranges overlap or leave gaps; `total_size` different from the
            sum of the tensors' bytes (when a tensor has the wrong shape or dtype, or is not in the official
            inventory, the error names that tensor instead, as `validate` does).
        PlaceholderCheckpointError (a CheckpointError): placeholder data, not weights (`dsv4 make-checkpoint
            --dry-run` output: `placeholder_evidence`), unless `allow_placeholder=True`.
    """

    def __new__(cls, path: str | Path, **kwargs):
        # `Checkpoint("synth:GEOMETRY[:LAYERS[:SEED]]")` is a `dsv4.synth.SynthCheckpoint`: the same reader over
        # tensors synthesized where they are read (docs/multi_gpu.md "Full depth without the files")
        if cls is Checkpoint and str(path).startswith("synth:"):
            from dsv4.synth import SynthCheckpoint

            cls = SynthCheckpoint
        return super().__new__(cls)

    def __init__(self, path: str | Path, *, allow_placeholder: bool = False):
        """`allow_placeholder=True`: open a placeholder checkpoint (`dsv4 make-checkpoint --dry-run` output: data
        left as holes, i.e. zeros) for its layout only (headers, index, inventory); refused by default
        (`PlaceholderCheckpointError`). `self.placeholder` lists the evidence found (empty for real data)."""
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: not a checkpoint directory")
        self.args: ModelArgs = ModelArgs.from_hf_config(self.path)
        self._meta: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
        self._handles: dict[Path, object] = {}
        index = self.path / INDEX_FILE
        if index.is_file():
            self._open_index(index)
        elif (self.path / SINGLE_FILE).is_file():
            f = self.path / SINGLE_FILE
            self.shards = [f]
            for name, (dt, shape) in _read_header(f).items():
                self._meta[name] = (f, dt, shape)
        else:
            raise FileNotFoundError(f"{self.path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        self.placeholder = placeholder_evidence(self.path, self.shards)
        if self.placeholder and not allow_placeholder:
            raise PlaceholderCheckpointError(self.path, self.placeholder)

    def _open_index(self, index: Path) -> None:
        weight_map, total = read_index(index)
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        for shard, names in sorted(by_shard.items()):  # every named shard exists before any header is read
            f = self.path / shard
            if not f.is_file():
                raise CheckpointError(f"{index}: weight_map maps {len(names)} tensors (e.g. {names[0]}) to shard "
                                      f"{shard}, but {f} does not exist")
        self.shards = []
        for shard, names in sorted(by_shard.items()):
            f = self.path / shard
            self.shards.append(f)
            header = _read_header(f)
            for name in names:
                if name not in header:
                    raise CheckpointError(f"{index}: maps tensor {name} to {shard}, but {f} does not hold it")
                self._meta[name] = (f, *header[name])
            stray = sorted(set(header) - set(names))
            if stray:
                elsewhere = f"; the index maps it to {weight_map[stray[0]]}" if stray[0] in weight_map else ""
                raise CheckpointError(f"{f}: holds {len(stray)} tensors that {INDEX_FILE} does not map to this "
                                      f"shard (e.g. {stray[0]}{elsewhere})")
        actual = sum(math.prod(s) * DTYPE_BYTES[dt] for _, dt, s in self._meta.values())
        if total is not None and total != actual:
            self._name_wrong_tensor()  # a tensor of the wrong shape or dtype is the usual cause: name it
            raise CheckpointError(f"{index}: metadata.total_size={total}, but the shards' tensors hold {actual} bytes")

    def _name_wrong_tensor(self) -> None:
        """Raise `validate`'s CheckpointError (naming the tensor, its file, the expected shape / dtype) if a present
        tensor is not in the official inventory or has the wrong shape or dtype; return otherwise."""
        try:
            full = expected_tensors(self.args, include_mtp=True)
        except ValueError:  # no inventory for this config: the caller's own message stands
            return
        self.validate(full, required=set())

    # ------------------------------------------------------------------ metadata
    def keys(self) -> list[str]:
        """All tensor names in the checkpoint, sorted."""
        return sorted(self._meta)

    def __contains__(self, name: str) -> bool:
        return name in self._meta

    def __len__(self) -> int:
        return len(self._meta)

    def info(self, name: str) -> tuple[tuple[int, ...], str, Path]:
        """(shape, safetensors dtype string, shard file) of `name`, from the headers. KeyError if absent."""
        if name not in self._meta:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        f, dt, shape = self._meta[name]
        return shape, dt, f

    def validate(self, full: Inventory, required: set[str] | None = None) -> None:
        """Check the headers against an inventory: no tensor outside `full`, every present tensor of `full` has
        its shape and dtype, every name in `required` (default: all of `full`) is present.

        Raises CheckpointError naming the tensor, its file (or the checkpoint) and the expected shape/dtype.
        """
        stray = sorted(set(self._meta) - set(full))
        if stray:
            f = self._meta[stray[0]][0]
            raise CheckpointError(f"{f}: unexpected tensor {stray[0]} (not in the official inventory for this "
                                  f"config.json; {len(stray)} unexpected in all)")
        for name, (f, dt, shape) in self._meta.items():
            want_shape, want_dt = full[name]
            if dt != want_dt:
                hint = " (ue8m0 exponent bytes; reading them as numbers corrupts every weight)" \
                    if name.endswith(".scale") else ""
                raise CheckpointError(f"{f}: tensor {name} has dtype {dt}, expected {want_dt}{hint}")
            if shape != want_shape:
                raise CheckpointError(f"{f}: tensor {name} has shape {list(shape)}, expected {list(want_shape)}")
        missing = sorted((set(full) if required is None else required) - set(self._meta))
        if missing:
            raise CheckpointError(f"{self.path}: missing tensor {missing[0]} (expected shape "
                                  f"{list(full[missing[0]][0])} {full[missing[0]][1]}; {len(missing)} missing in all)")

    # ------------------------------------------------------------------ data
    def _raw(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        f = self.info(name)[2]
        if f not in self._handles:
            from safetensors import safe_open
            self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
        t = self._handles[f].get_tensor(name).to(device)
        check_values(t, self._meta[name][1], name, f,
                     n_experts=self.args.n_routed_experts if name.endswith("tid2eid") else None)
        return t

    def _raw_part(self, name: str, dim: int, start: int, n: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) start..start+n of `name` as stored, reading only those bytes (a
        safetensors slice), on `device`, checked by `check_values` (indices reported in the full tensor)."""
        f = self.info(name)[2]
        if f not in self._handles:
            from safetensors import safe_open
            self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
        sl = self._handles[f].get_slice(name)
        t = (sl[start:start + n] if dim == 0 else sl[:, start:start + n]).to(device)
        check_values(t, self._meta[name][1], name, f, offset=(start, 0) if dim == 0 else (0, start),
                     n_experts=self.args.n_routed_experts if name.endswith("tid2eid") else None)
        return t

    def _scale_of(self, name: str) -> str:
        scale = name.removesuffix(".weight") + ".scale"
        shape, dt, f = self.info(name)
        if not name.endswith(".weight") or scale not in self._meta:
            raise CheckpointError(f"{f}: quantized tensor {name} ({dt} {list(shape)}) has no {scale} "
                                  f"(expected an F8_E8M0 scale beside it)")
        sdt, sf = self._meta[scale][1], self._meta[scale][0]
        if sdt != "F8_E8M0":
            raise CheckpointError(f"{sf}: tensor {scale} has dtype {sdt}, expected F8_E8M0 (ue8m0 exponent "
                                  f"bytes; reading them as numbers corrupts every weight)")
        return scale

    def get_quantized(self, name: str, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """The on-disk (weight, scale) of a quantized weight, untouched, for kernels.

        FP8: (float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/128), ceil(in/128)]);
        FP4: (int8 [out, in/2] two e2m1 codes per byte, low nibble first, float8_e8m0fnu [out, in/32]).
        Raises KeyError (absent) / CheckpointError (no `.scale`, or a scale that is not F8_E8M0; a NaN code or
        scale byte, see `check_values`).
        """
        scale = self._scale_of(name)
        return self._raw(name, device), self._raw(scale, device)

    def get(self, name: str, *, dtype: torch.dtype = torch.float32, dequantize: bool = True,
            device: str | torch.device = "cpu") -> torch.Tensor:
        """One tensor by official name.

        `dequantize=False`: the raw on-disk tensor. Otherwise: FP8 (F8_E4M3 + `.scale`) and FP4 (I8 + `.scale`)
        weights dequantized exactly (spec §2) then cast to `dtype`; a `.scale` itself decoded to 2^(e-127);
        BF16 cast to `dtype`; F32 cast to `dtype` only when that is at least as wide (a narrower `dtype` gives
        float32: F32 tensors are fp32 parameters in the official model, never rounded); I64 (`tid2eid`) returned as int64 whatever `dtype` is. Dequantization runs
        on `device`.

        Raises KeyError (absent), CheckpointError (missing/mis-typed/mis-shaped scale, unsupported dtype, bytes
        that decode to NaN or an out-of-range expert id: `check_values`, checked on `device` before dequantizing).
        """
        shape, dt, f = self.info(name)
        if not dequantize:
            return self._raw(name, device)
        if not dtype.is_floating_point:
            raise ValueError(f"dtype={dtype}: expected a floating dtype for dequantized weights")
        try:
            if dt in ("F8_E4M3", "I8"):
                w, s = self.get_quantized(name, device)
                deq = quant.fp8_block_dequant if dt == "F8_E4M3" else quant.fp4_dequant
                return deq(w, s, out_dtype=dtype)
            if dt == "F8_E8M0":
                return quant.e8m0_to_float(self._raw(name, device)).to(dtype)
        except (TypeError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{f}: tensor {name}: {e}") from None
        if dt in ("BF16", "F32"):
            return cast_unquantized(self._raw(name, device), dt, dtype)
        if dt == "I64":
            return self._raw(name, device)
        raise CheckpointError(f"{f}: tensor {name} has dtype {dt}, expected one of F8_E4M3, I8, F8_E8M0, BF16, "
                              f"F32, I64")


def load_checkpoint(path: str | Path, *, n_layers: int | None = None, include_mtp: bool = False,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    progress: bool = True, dequantize: bool = True) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Open, validate and load a checkpoint as an official-name state dict.

    Validation covers the whole checkpoint's headers against `expected_tensors(args, include_mtp=True)` (no
    unexpected tensor, every shape and dtype right) and requires every tensor that is loaded. Loaded: the
    globals (`embed`, `head`, `norm`, `hc_head_*`), main layers `< n_layers` (default all; callers pass
    `dsv4.config.layers_from_env(...)`), and `mtp.*` only with `include_mtp`. Every floating non-quantized
    tensor is returned as `dtype`, except that F32 tensors (the fp32 parameters hc_*, attn_sink, ape, gate.bias)
    are never narrowed: with a bf16 `dtype` they stay float32, as in the official model; `tid2eid` stays int64.

    `dequantize=True`: FP8/FP4 weights come dequantized to `dtype` (spec §2), no `.scale` entries.
    `dequantize=False` (for `Transformer(weights="quantized")`): FP8 / FP4 weights come as stored (float8_e4m3fn
    [out, in] / int8 [out, in/2]) together with their `.scale` (float8_e8m0fnu), untouched; the rest as above.

    Returns: (`args.with_layers(n_layers)` if n_layers is given else `args`, {name: tensor on `device`}).
    Raises: ValueError (n_layers outside 1..args.n_layers), FileNotFoundError, CheckpointError (see
        `Checkpoint`, `Checkpoint.validate`, `Checkpoint.get`; every loaded tensor is checked by `check_values`
        in both modes; with `dequantize=False` also a checkpoint that
        holds no FP8/FP4 weight: a bf16 checkpoint has nothing to keep quantized).
    """
    ck = Checkpoint(path)
    args = ck.args
    out_args = args if n_layers is None else args.with_layers(n_layers)
    want = expected_tensors(args, n_layers, include_mtp)
    ck.validate(expected_tensors(args, include_mtp=True), required=set(want))
    raw = ("F8_E4M3", "I8", "F8_E8M0")
    if not dequantize and not any(ck.info(n)[1] in raw for n in want):
        raise CheckpointError(f"{ck.path}: dequantize=False (--weights quantized), but the checkpoint holds no "
                              f"FP8/FP4 weight (config.json dtype={args.dtype!r}, expert_dtype={args.expert_dtype!r}): "
                              "a bf16 checkpoint has nothing to keep quantized (use --weights dequantized)")
    names = sorted((n for n in want if not (dequantize and n.endswith(".scale"))),
                   key=lambda n: (str(ck.info(n)[2]), n))
    if progress and len({ck.info(n)[2] for n in names}) > 1:
        from rich.console import Console
        from rich.progress import track
        names_iter = track(names, description=f"loading {len(names)} tensors from {ck.path.name}",
                           console=Console(stderr=True))  # stderr: stdout carries the report / completion
    else:
        names_iter = names

    def one(n: str) -> torch.Tensor:
        if not dequantize and ck.info(n)[1] in raw:
            if not n.endswith(".scale"):
                ck._scale_of(n)  # the F8_E8M0 .scale beside it (headers only)
            return ck.get(n, dequantize=False, device=device)
        return ck.get(n, dtype=dtype, device=device)

    sd = {n: one(n) for n in names_iter}
    return out_args, dict(sorted(sd.items()))
