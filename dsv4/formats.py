"""The DeepSeek-V4 on-disk format in one place: file names, dtype tables, block sizes, the tensor inventory, and
every value check a loader runs (reference spec §2, §11).

Layout: a directory holding `config.json`, `model.safetensors.index.json`
(`{"metadata": {"total_size": N}, "weight_map": {name: shard}}`) and the shards it names, or one
`model.safetensors`. Tensor names are the official ones (`embed.weight`, `layers.N.attn.wq_a.weight`,
`layers.N.attn.wq_a.scale`, `mtp.0.e_proj.weight`, ...): no `model.` prefix, `.scale` (never
`weight_scale_inv`). safetensors dtype strings: F8_E4M3, F8_E8M0, I8, BF16, F32, I64.

Quantized weights (spec §2, decoded by `dsv4.quant`; block sizes `FP8_BLOCK`, `FP4_BLOCK`, defined there once):
    FP8   `X.weight` F8_E4M3 [out, in]    + `X.scale` F8_E8M0 [ceil(out/128), ceil(in/128)]
    FP4   `X.weight` I8      [out, in/2]  + `X.scale` F8_E8M0 [out, in/32]   (routed experts only)

Value checks (all here; the readers in `dsv4.checkpoint` and the model's `load_weights` call them):
    `check_values` / `find_bad_values`  bytes that decode to NaN (ue8m0 0xFF, e4m3 0x7F/0xFF, non-finite BF16/F32)
                                        and `tid2eid` ids outside 0..n_routed_experts-1, where a tensor is read
    `check_loaded_values`               the same on the value as loaded (after the cast to the parameter dtype)
    `check_bf16_exact`                  a value for a weight held bf16 as on disk must be exact in bf16
    `check_dequantized_range`           resident codes x scales that overflow float32

Imports: torch, `dsv4.config`, `dsv4.quant` only (a leaf of the loader).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dsv4.config import ModelArgs
from dsv4 import quant
from dsv4.quant import FP4_BLOCK, FP8_BLOCK

__all__ = ["INDEX_FILE", "SINGLE_FILE", "PLACEHOLDER_KEY", "PROVENANCE_FILE", "DTYPE_BYTES", "TORCH_DTYPES",
           "QUANTIZED_DTYPES", "CODE_DTYPES", "FP8_BLOCK", "FP4_BLOCK", "Inventory", "CheckpointError",
           "PlaceholderCheckpointError", "expected_tensors", "inventory_bytes", "check_values", "find_bad_values",
           "cast_unquantized", "check_loaded_values", "check_bf16_exact", "check_dequantized_range"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPE_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4,
               "I64": 8, "F64": 8, "BOOL": 1, "I16": 2, "U16": 2, "U32": 4, "U64": 8}
TORCH_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8,
                "BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64}
QUANTIZED_DTYPES = ("F8_E4M3", "I8")  # a quantized `.weight` (codes) beside its F8_E8M0 `.scale`
CODE_DTYPES = ("F8_E4M3", "I8", "F8_E8M0")  # on-disk codes and scales: kept as stored, never cast

Inventory = dict[str, tuple[tuple[int, ...], str]]


class CheckpointError(ValueError):
    """A checkpoint that does not match the official layout; the message names tensor, file, expectation."""


# ---------------------------------------------------------------------------------------------- inventory
def _linear(inv: Inventory, name: str, out: int, inp: int, fmt: str) -> None:
    """Add `name.weight` (and `name.scale`) for a [out, inp] linear stored as `fmt` (fp8 | fp4 | bf16)."""
    if fmt == "fp8":
        inv[f"{name}.weight"] = ((out, inp), "F8_E4M3")
        inv[f"{name}.scale"] = ((math.ceil(out / FP8_BLOCK), math.ceil(inp / FP8_BLOCK)), "F8_E8M0")
    elif fmt == "fp4":
        if inp % FP4_BLOCK:
            raise ValueError(f"{name}: FP4 needs in_features divisible by {FP4_BLOCK}, got {inp}")
        inv[f"{name}.weight"] = ((out, inp // 2), "I8")
        inv[f"{name}.scale"] = ((out, inp // FP4_BLOCK), "F8_E8M0")
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



def cast_unquantized(t: torch.Tensor, dt: str, dtype: torch.dtype) -> torch.Tensor:
    """A BF16 / F32 on-disk tensor `t` (safetensors dtype `dt`) in the floating `dtype` asked for, except that F32
    is never narrowed below float32: the official model keeps its F32 tensors (hc_*, attn_sink, ape, gate.bias)
    as fp32 parameters in every mode, so rounding them to bf16 would change the bf16 model's numerics."""
    if dt == "F32" and torch.finfo(dtype).bits < 32:
        return t.to(torch.float32)
    return t.to(dtype)



PLACEHOLDER_KEY = "dsv4_dry_run"  # index metadata key written by `dsv4 make-checkpoint --dry-run` (true)
PROVENANCE_FILE = "dsv4_synth.json"  # what `dsv4.synth.make_checkpoint` writes (`"dry_run": true` for a dry run)


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


# ---------------------------------------------------------------------------------------------- loaded values
_LOADED_DT = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0", torch.int64: "I64"}


def check_loaded_values(name: str, value: torch.Tensor, given: torch.Tensor, n_routed_experts: int) -> None:
    """`Transformer.load_weights`' value check of one tensor: `value` is what is about to be loaded (already in
    the parameter's dtype), `given` the caller's tensor it was cast from. Floating tensors must be finite, float8
    codes must not be NaN codes (e4m3 0x7F/0xFF, ue8m0 0xFF), `*.tid2eid` (int64) must hold expert ids in
    0..n_routed_experts-1; int8 FP4 codes have no NaN. One or two reductions per tensor where it lives
    (`find_bad_values`), the exact mask only when they flag something.

    Raises ValueError naming the tensor, what is wrong, the first bad index, how many elements are bad, and, for
    a value that became inf in the cast, the finite value given and the dtypes."""
    if value.dtype == torch.int64 and not name.endswith("tid2eid"):
        return
    dt = _LOADED_DT.get(value.dtype, "F32" if value.dtype.is_floating_point else None)
    if dt is None:
        return
    found = find_bad_values(value, dt, n_routed_experts if dt == "I64" else None)
    if found is None:
        return
    what, idx, n_bad = found
    src = given[tuple(idx)]
    cause = ""
    if given.dtype.is_floating_point and given.dtype != value.dtype and bool(torch.isfinite(src.double())):
        cause = (f"; the given {given.dtype} value {src.item():.6g} overflows {value.dtype} (cast to the "
                 "parameter's dtype)")
    raise ValueError(f"load_weights: tensor {name} ({value.dtype}, shape {list(value.shape)}): {what} at index "
                     f"{idx} ({n_bad} bad of {value.numel()}){cause}; refusing to load it (no NaN / inf is loaded "
                     "quietly)")


# ue8m0 scale bytes from which a code can overflow float32 when dequantized: 448 * 2^(e-127) (e4m3) and
# 6 * 2^(e-127) (e2m1) exceed float32's max (~2^128) only for e >= 247 / 253; below, no product can
_OVERFLOW_SCALE_BYTE = {torch.float8_e4m3fn: 247, torch.int8: 253}


def check_bf16_exact(name: str, given: torch.Tensor) -> None:
    """A value for a weight held bf16 as on disk (`held_bf16_names`) must be exactly representable in bf16 (an
    on-disk BF16 tensor read in any wider dtype is): rounding it would change the fp32 maths the official model
    computes, so it is never cast quietly. RuntimeError naming the tensor, the first bad index and the count.
    NaN is left to `check_loaded_values` (its own message)."""
    if given.dtype == torch.bfloat16:
        return
    bad = (given.to(torch.bfloat16).to(given.dtype) != given) & (given == given)
    if bool(bad.any()):
        idx = [int(i) for i in torch.nonzero(bad)[0]]
        raise RuntimeError(f"{name}: {given.dtype} value {float(given[tuple(idx)])!r} at index {idx} "
                           f"({int(bad.sum())} values in all) is not exactly representable in bf16; the model holds this fp32-compute "
                           "weight in bf16 as on disk (weights='quantized') and never rounds it quietly (load the "
                           "checkpoint's BF16 tensor, or use weights='dequantized')")


def check_dequantized_range(name: str, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """Codes that are valid one by one (no NaN code, no NaN scale byte) can still dequantize to inf: e4m3 448 in a
    block whose ue8m0 scale is 2^127. `codes` float8_e4m3fn [out, in] + `scale` [ceil(out/128), ceil(in/128)], or
    int8 FP4 [out, in/2] + `scale` [out, in/32] (spec §2). A screen on the largest scale byte (one reduction over
    the scales, 1/32 of the codes or less); only a suspect tensor is dequantized in fp32 and checked. Raises
    ValueError naming the weight, the first index that dequantizes to inf and how many do."""
    threshold = _OVERFLOW_SCALE_BYTE.get(codes.dtype)
    if threshold is None or scale.numel() == 0 or int(scale.view(torch.uint8).max()) < threshold:
        return
    deq = (quant.fp8_block_dequant if codes.dtype == torch.float8_e4m3fn else quant.fp4_dequant)(codes, scale)
    bad = ~torch.isfinite(deq)
    if bool(bad.any()):
        first = [int(i) for i in torch.nonzero(bad)[0]]
        raise ValueError(f"load_weights: tensor {name} ({codes.dtype} codes + ue8m0 scales): dequantizes to inf at "
                         f"index {first} ({int(bad.sum())} of {bad.numel()}: a code times its block's scale beyond "
                         "float32); refusing to load it (no NaN / inf is loaded quietly)")
