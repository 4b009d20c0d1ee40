"""The loader: two checkpoint sources behind one read interface, and the one load path.

    `Source`          the read interface: `args` (ModelArgs), `path`, `keys` / `info` / `validate` (headers against
                      the inventory), `raw` / `raw_part` (on-disk bytes, checked by `dsv4.formats.check_values`
                      where they are read), `get` / `get_quantized`, and `load(name, part, ...)`: the one routine
                      reading a tensor (whole, or the rows / columns a rank owns) dequantized or as stored.
    `Checkpoint`      a checkpoint directory (config.json + index + safetensors shards, memory-mapped); the headers
                      are parsed and checked here (`read_index`, `_read_header`, `placeholder_evidence`).
    `SynthCheckpoint` `synth:GEOMETRY[:LAYERS[:SEED]]`: the same tensors generated where they are read
                      (`dsv4.synth`), bitwise what `dsv4 make-checkpoint` writes; no file.
    `open_source(spec)` -> the right `Source` for a directory or a `synth:` spec.
    `open_for_load` / `load_checkpoint`  the load path of every world size: open, validate, list what is read;
                      `dsv4.parallel` adds the rank's read plan and streams `Source.load` into the model.

The format tables and every value check live in `dsv4.formats` (re-exported here for existing callers). Everything
fails closed: a missing or unexpected tensor, a wrong shape or dtype, an index naming a missing shard, a truncated
shard, a scale that is not F8_E8M0 -> `CheckpointError` naming the tensor, the file and what was expected.

Imports: `dsv4.config`, `dsv4.formats`, `dsv4.quant`, `dsv4.synth` (the generator); nothing imports back.
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track
from safetensors import safe_open

from dsv4 import quant, synth
from dsv4.config import ModelArgs, SymlinkLoopError, check_has_mtp, check_not_loop, loads_json, symlink_loop
from dsv4.formats import (CODE_DTYPES, DTYPE_BYTES, INDEX_FILE, PLACEHOLDER_KEY, PROVENANCE_FILE,
                          QUANTIZED_DTYPES, SINGLE_FILE, TORCH_DTYPES, CheckpointError, Inventory,
                          PlaceholderCheckpointError, cast_unquantized, check_values, expected_tensors,
                          find_bad_values, inventory_bytes)
from dsv4.state import check_device
from dsv4.synth import SynthSpec, geometry_args, is_synth_source, parse_source, source_provenance, synth_inventory

__all__ = ["Source", "Checkpoint", "SynthCheckpoint", "open_source", "open_for_load", "load_checkpoint",
           "read_index", "placeholder_evidence", "SymlinkLoopError",
           # the format tables and value checks, defined in dsv4.formats
           "CheckpointError", "PlaceholderCheckpointError", "PLACEHOLDER_KEY", "PROVENANCE_FILE", "expected_tensors",
           "DTYPE_BYTES", "INDEX_FILE", "SINGLE_FILE", "TORCH_DTYPES", "inventory_bytes", "check_values",
           "find_bad_values", "cast_unquantized"]


# ---------------------------------------------------------------------------------------------- headers
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
            raise CheckpointError(f"{path}: tensor {name}: unknown safetensors dtype {dt!r}; expected one of "
                                  f"{', '.join(sorted(DTYPE_BYTES))} (the formats of the official checkpoint)")
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


INDEX_KEYS = ("metadata", "weight_map")  # the top-level keys of model.safetensors.index.json


def read_index(index: str | Path) -> tuple[dict[str, str], int | None]:
    """Parse and check `model.safetensors.index.json`: (weight_map {tensor name: shard file name}, total_size).

    `total_size` (bytes, `metadata.total_size`) is None when the index has no metadata. Shard names are not
    checked for existence here (`Checkpoint` does that), only for form.

    Raises:
        CheckpointError (naming the index file): not UTF-8 JSON; a key twice in one object (a tensor mapped
            twice: JSON would keep the last shard silently); the top level is not an object, or has a key other
            than `metadata` / `weight_map` (a misspelled `weight_mapp` would be ignored); no `weight_map` object; a tensor name or shard that is not a string; a shard that is not a plain file
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
    unknown = [k for k in doc if k not in INDEX_KEYS]
    if unknown:  # a misspelled `weight_mapp` / `metdata` would be ignored silently
        raise CheckpointError(f"{index}: unknown top-level key(s) {', '.join(map(repr, unknown))}; expected only "
                              f"{' and '.join(map(repr, INDEX_KEYS))}")
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


def _data_is_holes(f: Path) -> bool:
    """True when the data section of safetensors file `f` (after its header) is non-empty and nothing of it is
    stored beyond the file-system block it shares with the header (SEEK_DATA / SEEK_HOLE: the rest is a hole,
    which reads as zeros), and the stored part of that block is zeros. Nothing is read from a dense file (a real
    shard: one extent from the header to the end). False where the file system cannot tell (no SEEK_DATA)."""
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



# ---------------------------------------------------------------------------------------------- the read interface
class Source:
    """What every checkpoint source gives a loader (a directory: `Checkpoint`; a `synth:` spec: `SynthCheckpoint`).

    Attributes: `path` (the directory, or the canonical spec as a Path: the "file" in every error message), `args`
    (`ModelArgs` of the whole checkpoint), `placeholder` (evidence of placeholder data; [] for weights),
    `provenance` (what `dsv4_synth.json` says for a synthesized source, else None), `synthetic` (tensors generated
    on read). A source implements `_fetch` / `_fetch_part` (the on-disk tensor or part, unchecked); everything
    else, checks included, is here once.
    """

    path: Path
    args: ModelArgs
    placeholder: list[str]
    provenance: dict | None = None
    synthetic = False
    _meta: dict[str, tuple[Path, str, tuple[int, ...]]]

    def _fetch(self, name: str, device) -> torch.Tensor:
        raise NotImplementedError

    def _fetch_part(self, name: str, dim: int, start: int, n: int, device) -> torch.Tensor:
        raise NotImplementedError

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
        args = getattr(self, "args", None)
        for name, (f, dt, shape) in self._meta.items():
            want_shape, want_dt = full[name]
            # a routed expert's format follows config.json's expert_dtype: say so, it is the likelier culprit
            cfg = (f"; routed experts as config.json's expert_dtype {args.expert_dtype!r} says"
                   if args is not None and ".ffn.experts." in name else "")
            if dt != want_dt:
                hint = " (ue8m0 exponent bytes; reading them as numbers corrupts every weight)" \
                    if name.endswith(".scale") else ""
                raise CheckpointError(f"{f}: tensor {name} has dtype {dt}, expected {want_dt}{hint}{cfg}")
            if shape != want_shape:
                raise CheckpointError(f"{f}: tensor {name} has shape {list(shape)}, expected {list(want_shape)}"
                                      f"{cfg}")
        missing = sorted((set(full) if required is None else required) - set(self._meta))
        if missing:
            raise CheckpointError(f"{self.path}: missing tensor {missing[0]} (expected shape "
                                  f"{list(full[missing[0]][0])} {full[missing[0]][1]}; {len(missing)} missing in all)")

    # ------------------------------------------------------------------ data
    def _n_experts(self, name: str) -> int | None:
        return self.args.n_routed_experts if name.endswith("tid2eid") else None

    def raw(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """The on-disk tensor `name`, untouched, on `device`, checked there by `check_values` (NaN codes / scale
        bytes / non-finite floats, `tid2eid` ids out of range). KeyError if absent, CheckpointError if corrupt."""
        shape, dt, f = self.info(name)
        t = self._fetch(name, device)
        check_values(t, dt, name, f, n_experts=self._n_experts(name))
        return t

    def raw_part(self, name: str, dim: int, start: int, n: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) start..start+n of `name` as stored, reading (or generating) only those,
        on `device`, checked by `check_values` (indices reported in the full tensor)."""
        shape, dt, f = self.info(name)
        t = self._fetch_part(name, dim, start, n, device)
        check_values(t, dt, name, f, offset=(start, 0) if dim == 0 else (0, start), n_experts=self._n_experts(name))
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
        return self.raw(name, device), self.raw(scale, device)

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
            return self.raw(name, device)
        if not dtype.is_floating_point:
            raise ValueError(f"dtype={dtype}: expected a floating dtype for dequantized weights")
        try:
            if dt in ("F8_E4M3", "I8"):
                w, s = self.get_quantized(name, device)
                deq = quant.fp8_block_dequant if dt == "F8_E4M3" else quant.fp4_dequant
                return deq(w, s, out_dtype=dtype)
            if dt == "F8_E8M0":
                return quant.e8m0_to_float(self.raw(name, device)).to(dtype)
        except (TypeError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{f}: tensor {name}: {e}") from None
        if dt in ("BF16", "F32"):
            return cast_unquantized(self.raw(name, device), dt, dtype)
        if dt == "I64":
            return self.raw(name, device)
        raise CheckpointError(f"{f}: tensor {name} has dtype {dt}, expected one of F8_E4M3, I8, F8_E8M0, BF16, "
                              f"F32, I64")

    def load(self, name: str, part: tuple[int, int, int] | None = None, *, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu", raw: bool = False) -> torch.Tensor:
        """The one tensor read of every loader: `name` whole (`part` None) or its (dim, start, length) part (the
        rows / columns a tensor-parallel rank owns: only those are read or generated), on `device`.

        `raw` (weights="quantized"): FP8 / FP4 codes and ue8m0 scales exactly as stored (a quantized weight's
        `.scale` must be beside it: `_scale_of`). Otherwise as `get`: dequantized to `dtype` (a part of an FP8
        weight with only the scale blocks that cover it, `quant.fp8_block_dequant(origin=...)`), BF16 in `dtype`,
        F32 never narrowed below float32, I64 as int64. Raises what `get` / `raw_part` raise; CheckpointError for a
        split tensor that is not BF16, F32 or F8_E4M3.
        """
        shape, dt, f = self.info(name)
        keep = raw and dt in CODE_DTYPES
        if keep and dt in QUANTIZED_DTYPES:
            self._scale_of(name)  # the F8_E8M0 .scale beside it (headers only)
        if part is None:
            return self.get(name, dequantize=False, device=device) if keep else self.get(name, dtype=dtype,
                                                                                         device=device)
        dim, start, n = part
        t = self.raw_part(name, dim, start, n, device)
        if keep:
            return t
        if dt in ("BF16", "F32"):
            return cast_unquantized(t, dt, dtype)  # F32 never narrowed (the official fp32 parameters)
        if dt != "F8_E4M3":
            raise CheckpointError(f"{f}: tensor {name} has dtype {dt}; a tensor split across ranks must be BF16, "
                                  "F32 or F8_E4M3")
        b = quant.FP8_BLOCK
        b0 = start // b  # only the scale blocks that cover the part (the rest of the weight is not this rank's)
        s = self.raw_part(self._scale_of(name), dim, b0, -(-(start + n) // b) - b0, device)
        origin = (start - b0 * b, 0) if dim == 0 else (0, start - b0 * b)
        try:
            return quant.fp8_block_dequant(t, s, out_dtype=dtype, origin=origin)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{f}: tensor {name}: {e}") from None


# ---------------------------------------------------------------------------------------------- a directory
class Checkpoint(Source):
    """A DeepSeek-V4 checkpoint directory, memory-mapped through `safetensors.safe_open`.

    Opening reads `config.json` (`.args`), the index (or the single `model.safetensors`) and every shard's
    header, and checks that they agree; tensor data is read only by `get` / `get_quantized`.
    A `synth:` spec is not a directory: `open_source` opens either kind (`SynthCheckpoint` for a spec).

    Raises (from the constructor):
        ValueError: `path` is a `synth:` spec (open it with `open_source`).
        FileNotFoundError: no config.json, or neither an index nor `model.safetensors`; `SymlinkLoopError` (a
            FileNotFoundError) naming a symbolic link loop (the directory, config.json, the index or a shard).
        CheckpointError: a malformed index (see `read_index`; a shard name that is not a plain file name in
            the directory is refused, never read); the index names a shard that does not exist (checked for
            every shard before any header is read); both the index and `model.safetensors` are present (which
            one is the checkpoint is ambiguous); a `*.safetensors` file the index does not name (or, without an
            index, besides `model.safetensors`): only `*.safetensors` files count, config.json / tokenizer files /
            README and the like are not looked at; the index and a shard disagree about a tensor (missing
            from its shard, or a shard holding a tensor the index does not list); a truncated or malformed
            shard, or one whose tensors' byte ranges overlap or leave gaps; `total_size` different from the
            sum of the tensors' bytes (when a tensor has the wrong shape or dtype, is not in the official
            inventory, or a tensor of the main inventory - or of an MTP block partly present - is missing from
            both the index and the shards, the error names that tensor instead, as `validate` does).
        PlaceholderCheckpointError (a CheckpointError): placeholder data, not weights (`dsv4 make-checkpoint
            --dry-run` output: `placeholder_evidence`), unless `allow_placeholder=True`.
    """

    def __init__(self, path: str | Path, *, allow_placeholder: bool = False):
        """`allow_placeholder=True`: open a placeholder checkpoint (`dsv4 make-checkpoint --dry-run` output: data
        left as holes, i.e. zeros) for its layout only (headers, index, inventory); refused by default
        (`PlaceholderCheckpointError`). `self.placeholder` lists the evidence found (empty for real data)."""
        if is_synth_source(path):
            raise ValueError(f"{path}: a synthetic source, not a checkpoint directory: open it with "
                             "dsv4.checkpoint.open_source (which returns a SynthCheckpoint)")
        self.path = Path(path)
        check_not_loop(self.path, "a checkpoint directory")
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: not a checkpoint directory")
        self.provenance = None  # synthetic files say so in dsv4_synth.json (`dsv4 diagnose` reads it)
        self.args: ModelArgs = ModelArgs.from_hf_config(self.path)
        self._meta: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
        self._handles: dict[Path, object] = {}
        index = self.path / INDEX_FILE
        check_not_loop(index, INDEX_FILE)
        check_not_loop(self.path / SINGLE_FILE, SINGLE_FILE)
        if index.is_file() and (self.path / SINGLE_FILE).exists():  # which one holds the weights? never guess
            raise CheckpointError(f"{self.path}: holds both {INDEX_FILE} and {SINGLE_FILE}; expected one layout "
                                  f"(an index + its shards, or the single file): remove the one that is not the "
                                  "checkpoint (the other would be ignored silently)")
        others = sorted(f.name for f in self.path.glob("*.safetensors") if f.name != SINGLE_FILE)
        if index.is_file():
            self._open_index(index)
            stray = sorted(set(others) - {f.name for f in self.shards})
            if stray:
                raise CheckpointError(f"{self.path}: {len(stray)} .safetensors file(s) not named in {INDEX_FILE}: "
                                      f"{', '.join(stray)}; expected every shard in the directory to be in the "
                                      "index's weight_map (a stray shard would be ignored silently: remove it or "
                                      "fix the index; e.g. the model{i}-mp{n}.safetensors that DeepSeek's "
                                      "convert.py writes belong in their own directory)")
        elif (self.path / SINGLE_FILE).is_file():
            if others:
                raise CheckpointError(f"{self.path}: holds {SINGLE_FILE} and other .safetensors file(s) "
                                      f"({', '.join(others)}) without {INDEX_FILE}; expected the single file alone, "
                                      "or an index naming the shards (they would be ignored silently)")
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
            if symlink_loop(f):
                raise CheckpointError(f"{index}: weight_map maps {len(names)} tensors (e.g. {names[0]}) to shard "
                                      f"{shard}, but {f} is a symbolic link loop (it resolves back to itself), not "
                                      "a file")
            if not f.is_file():
                raise CheckpointError(f"{index}: weight_map maps {len(names)} tensors (e.g. {names[0]}) to shard "
                                      f"{shard}, but {f} " + ("is a directory, not a file" if f.is_dir() else
                                                               "does not exist"))
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
        tensor is not in the official inventory or has the wrong shape or dtype, or a tensor is missing: one of the
        main inventory (globals and main layers), or of an MTP block of which some tensor is present (a checkpoint
        may leave a whole MTP block out, `open_for_load` names that when the block is needed); return otherwise."""
        try:
            full = expected_tensors(self.args, include_mtp=True)
            required = set(expected_tensors(self.args))
        except ValueError:  # no inventory for this config: the caller's own message stands
            return
        blocks = {n.split(".")[1] for n in self._meta if n.startswith("mtp.")}
        required |= {n for n in full if n.startswith("mtp.") and n.split(".")[1] in blocks}
        self.validate(full, required=required)

    # ------------------------------------------------------------------ data
    def _handle(self, f: Path):
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
        return self._handles[f]

    def _fetch(self, name: str, device) -> torch.Tensor:
        return self._handle(self.info(name)[2]).get_tensor(name).to(device)

    def _fetch_part(self, name: str, dim: int, start: int, n: int, device) -> torch.Tensor:
        sl = self._handle(self.info(name)[2]).get_slice(name)
        return (sl[start:start + n] if dim == 0 else sl[:, start:start + n]).to(device)


# ---------------------------------------------------------------------------------------------- synthesized
class SynthCheckpoint(Source):
    """`synth:GEOMETRY[:LAYERS[:SEED]]`: the checkpoint `dsv4.synth.make_checkpoint(DIR, geometry, layers,
    seed=seed)` would write (MTP included), its tensors synthesized on read (`open_source("synth:pro:61")`).

    The same interface and checks as `Checkpoint` (`Source`: `validate`, `info`, `get`, `get_quantized`, `load`,
    `check_values` on every tensor and part read, on the device it is loaded to); every tensor is bitwise the one
    in that checkpoint's shards (`synth_tensor` / `synth_part`). Nothing is generated at open; `get` generates
    one tensor, a rank only its rows / columns / experts (`raw_part`). `info(name)[2]` (the "file" in every
    error message) is the canonical spec, e.g. `synth:pro:61:0`.

    Raises ValueError (malformed spec, see `dsv4.synth.parse_source`).
    """

    synthetic = True

    def __init__(self, spec: str | SynthSpec):
        self.placeholder: list[str] = []  # synthesized values, never placeholder zeros
        self.source = spec if isinstance(spec, SynthSpec) else parse_source(spec)
        self.path = Path(str(self.source))
        self.args = geometry_args(self.source.geometry, self.source.layers)
        self.seed = self.source.seed
        self.provenance = source_provenance(self.source)
        self._meta = {n: (self.path, dt, shape) for n, (shape, dt) in synth_inventory(self.args).items()}
        self._pending: dict = {}  # the other half of the last quantized (codes, scale) pair generated
        self.shards: list[Path] = []

    def _fetch(self, name: str, device) -> torch.Tensor:
        shape, dt, f = self.info(name)
        key = (name, str(torch.device(device)))
        t = self._pending.pop(key, None)
        if t is not None:
            return t
        if dt in CODE_DTYPES:
            weight = name.removesuffix(".scale") + ".weight" if dt == "F8_E8M0" else name
            w, s = synth.synth_quantized(self.args, weight, self.seed, device)
            other = weight if dt == "F8_E8M0" else weight.removesuffix(".weight") + ".scale"
            t, keep = (s, w) if dt == "F8_E8M0" else (w, s)
            self._pending = {(other, key[1]): keep}  # one pair at most: get_quantized asks for both
            return t
        return synth.synth_tensor(self.args, name, self.seed, device)

    def _fetch_part(self, name: str, dim: int, start: int, n: int, device) -> torch.Tensor:
        self.info(name)  # KeyError naming an absent tensor
        return synth.synth_part(self.args, name, self.seed, dim, start, n, device)


def open_source(spec: str | Path, *, allow_placeholder: bool = False) -> Source:
    """The checkpoint source `spec` names: `SynthCheckpoint` for `synth:GEOMETRY[:LAYERS[:SEED]]`, else the
    directory (`Checkpoint`, `allow_placeholder` as there). Raises what their constructors raise."""
    if is_synth_source(spec):
        return SynthCheckpoint(str(spec))
    return Checkpoint(spec, allow_placeholder=allow_placeholder)


# ---------------------------------------------------------------------------------------------- the load path
def open_for_load(spec: str | Path | Source, *, n_layers: int | None = None, include_mtp: bool = False,
                  quantized: bool = False) -> tuple[Source, ModelArgs, list[str]]:
    """Open `spec` (or take an open `Source`) and validate it for a load: the whole checkpoint's headers against
    `expected_tensors(args, include_mtp=True)` (no unexpected tensor, every shape and dtype right) and every tensor
    that is loaded present. Returns (source, `args.with_layers(n_layers)` or `args`, the names to read, sorted:
    the globals, main layers `< n_layers`, `mtp.*` with `include_mtp`; `.scale` only with `quantized`).

    Raises ValueError (n_layers outside 1..args.n_layers; `NoMTPBlockError` for `include_mtp` when config.json has
    num_nextn_predict_layers 0), FileNotFoundError, CheckpointError (see `Checkpoint`, `Source.validate`; with
    `include_mtp` an MTP block config.json lists but no tensor of it is present, named as such; with `quantized` a
    checkpoint that holds no FP8/FP4 weight: a bf16 checkpoint has nothing to keep quantized).
    """
    src = spec if isinstance(spec, Source) else open_source(spec)
    args = src.args
    if include_mtp:
        check_has_mtp(args, f"{src.path}: this checkpoint")
    out_args = args if n_layers is None else args.with_layers(n_layers)
    want = expected_tensors(args, n_layers, include_mtp)
    for k in range(args.n_mtp_layers if include_mtp else 0):  # a block wholly absent is named as such
        block = [n for n in want if n.startswith(f"mtp.{k}.")]
        if not any(n in src for n in block):
            raise CheckpointError(f"{src.path}: config.json says num_nextn_predict_layers = {args.n_mtp_layers}, "
                                  f"but the checkpoint holds no tensor of the MTP block mtp.{k} ({len(block)} "
                                  "expected, e.g. " + block[0] + "); speculative decoding with the MTP drafter "
                                  "needs it (a checkpoint written without its MTP block must say "
                                  "num_nextn_predict_layers = 0)")
    src.validate(expected_tensors(args, include_mtp=True), required=set(want))
    if quantized and not any(src.info(n)[1] in QUANTIZED_DTYPES for n in want):
        raise CheckpointError(f"{src.path}: dequantize=False (--weights quantized), but the checkpoint holds no "
                              f"FP8/FP4 weight (config.json dtype={args.dtype!r}, expert_dtype={args.expert_dtype!r}): "
                              "a bf16 checkpoint has nothing to keep quantized (use --weights dequantized)")
    return src, out_args, sorted(n for n in want if quantized or not n.endswith(".scale"))


def with_progress(src: Source, names: list[str], progress: bool, what: str = "loading"):
    """`names` as given, or wrapped in a progress bar on stderr (stdout carries the report / completion) when
    `progress` and the read takes a while: several shards, or a synthesized source (every tensor generated:
    `synth:tiny` takes ~30 s on CPU)."""
    if progress and (src.synthetic or len({src.info(n)[2] for n in names}) > 1):
        verb = "generating" if src.synthetic else what
        return track(names, description=f"{verb} {len(names)} tensors from {src.path.name}",
                     console=Console(stderr=True))
    return names


def load_checkpoint(path: str | Path, *, n_layers: int | None = None, include_mtp: bool = False,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    progress: bool = True, dequantize: bool = True) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Open, validate and load a checkpoint (a directory or a `synth:` spec) as an official-name state dict.

    `open_for_load` validates and lists the tensors: the globals (`embed`, `head`, `norm`, `hc_head_*`), main
    layers `< n_layers` (default all; callers pass `dsv4.config.layers_from_env(...)`), and `mtp.*` only with
    `include_mtp`; each is read by `Source.load` (the read of every world size). Every floating non-quantized
    tensor is returned as `dtype`, except that F32 tensors (the fp32 parameters hc_*, attn_sink, ape, gate.bias)
    are never narrowed: with a bf16 `dtype` they stay float32, as in the official model; `tid2eid` stays int64.

    `dequantize=True`: FP8/FP4 weights come dequantized to `dtype` (spec §2), no `.scale` entries.
    `dequantize=False` (for `Transformer(weights="quantized")`): FP8 / FP4 weights come as stored (float8_e4m3fn
    [out, in] / int8 [out, in/2]) together with their `.scale` (float8_e8m0fnu), untouched; the rest as above.

    Returns: (`args.with_layers(n_layers)` if n_layers is given else `args`, {name: tensor on `device`}).
    Raises: ValueError naming a `device` that is not 'cpu', 'cuda' or 'cuda:N' or a CUDA device not visible here
        (`dsv4.state.check_device`); what `open_for_load` and `Source.load` raise (every loaded tensor is checked by
        `check_values` in both modes).
    """
    check_device(device)
    src, out_args, names = open_for_load(path, n_layers=n_layers, include_mtp=include_mtp,
                                         quantized=not dequantize)
    names = sorted(names, key=lambda n: (str(src.info(n)[2]), n))  # shard by shard
    sd = {n: src.load(n, dtype=dtype, device=device, raw=not dequantize)
          for n in with_progress(src, names, progress)}
    return out_args, dict(sorted(sd.items()))
