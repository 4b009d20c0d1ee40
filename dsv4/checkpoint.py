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
file and what was expected. Nothing is renamed, cast or skipped silently.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from dsv4.config import ModelArgs
from dsv4 import quant

__all__ = ["CheckpointError", "Checkpoint", "expected_tensors", "load_checkpoint", "DTYPE_BYTES",
           "INDEX_FILE", "SINGLE_FILE"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPE_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4,
               "I64": 8, "F64": 8, "BOOL": 1, "I16": 2, "U16": 2, "U32": 4, "U64": 8}
_TORCH_DTYPE = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8,
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
