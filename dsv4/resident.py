"""Weights resident in their on-disk precision (reference spec §2, §11): which linears, and how many bytes.

`Transformer(args, weights="quantized")` (and `dsv4.parallel.ParallelTransformer`) build every `Linear` on the
meta device, then `hold_on_disk` gives each one its storage from the official inventory
(`dsv4.checkpoint.expected_tensors`), the one table of on-disk formats:

    F8_E4M3 `X.weight`  -> Linear.hold("fp8"): float8_e4m3fn [out, in] + float8_e8m0fnu `X.scale` [out/128, in/128]
    I8      `X.weight`  -> Linear.hold("fp4"): int8 [out, in/2]       + float8_e8m0fnu `X.scale` [out, in/32]
    BF16    `X.weight`  -> Linear.hold("bf16") for the fp32-compute linears (head, compressor wkv / wgate):
                           bfloat16 [out, in] as on disk, computed in fp32 (the exact upcast)
                           Linear.hold(None) for the others: a parameter in the model dtype
    BF16    `ffn.gate.weight` (the router, not a Linear) -> bfloat16 as on disk (`dsv4.model.gate_held`), computed
                           in fp32

So the attention projections (wq_a, wq_b, wkv, wo_a, wo_b), the indexer's wq_b, the shared expert and the routed
experts stay FP8 / FP4 (experts follow `args.expert_dtype`); head, router and compressor weights stay BF16 (the
official code holds them in fp32: docs/differences.md); embed, norms, hc_* are unchanged. The shapes are the
module's own (per-rank shapes under tensor parallelism).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.checkpoint import DTYPE_BYTES, expected_tensors
from dsv4.config import ModelArgs

__all__ = ["WEIGHTS", "ON_DISK_CODES", "check_weights_mode", "on_disk_formats", "hold_on_disk", "held_bytes",
           "TORCH_TO_SAFETENSORS"]

WEIGHTS = ("dequantized", "quantized")
ON_DISK_CODES = {"F8_E4M3": "fp8", "I8": "fp4"}
TORCH_TO_SAFETENSORS = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8",
                        torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64"}


def on_disk_formats(args: ModelArgs, include_mtp: bool = False) -> dict[str, str]:
    """Module name -> "fp8" | "fp4" for every linear stored quantized on disk (main layers of `args`; the MTP
    blocks with include_mtp)."""
    return {name.removesuffix(".weight"): ON_DISK_CODES[dt]
            for name, (_, dt) in expected_tensors(args, include_mtp=include_mtp).items()
            if dt in ON_DISK_CODES}


def check_weights_mode(weights: str, args: ModelArgs) -> None:
    """Raise ValueError unless `weights` is one of WEIGHTS and, for "quantized", `args` has FP8/FP4 weights.

    A bf16 checkpoint (`dtype="bf16"`, `expert_dtype="bf16"`) has nothing to keep quantized; asking for it is an
    error, never a silent fall back to the dequantized model.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}: expected one of {WEIGHTS}")
    if weights == "quantized" and not on_disk_formats(args):
        raise ValueError(f"weights='quantized': ModelArgs.dtype={args.dtype!r}, expert_dtype={args.expert_dtype!r} "
                         "hold no FP8/FP4 weight (a bf16 checkpoint); load it with weights='dequantized'")


def hold_on_disk(model: nn.Module, args: ModelArgs, device: str | torch.device) -> None:
    """Give every deferred `Linear` of `model` its storage on `device` (see the module docstring); the module
    name (its on-disk dtype) and `Linear.fp32` decide the format. Raises ValueError (from `Linear.hold`) for a linear that is not deferred (already
    holds its weight) or an FP4 width not divisible by 32."""
    mtp = getattr(model, "mtp", None) is not None  # the MTP blocks' linears are in the inventory with include_mtp
    fmts = on_disk_formats(args, mtp)
    bf16 = {name.removesuffix(".weight") for name, (_, dt) in expected_tensors(args, include_mtp=mtp).items()
            if dt == "BF16"}
    for name, mod in model.named_modules():
        if callable(getattr(type(mod), "hold", None)):  # a `dsv4.model.Linear` (this module imports no model class)
            mod.hold(fmts.get(name, "bf16" if mod.fp32 and name in bf16 else None), device)


def held_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's state dict per safetensors dtype string ("F8_E4M3", "F8_E8M0", "I8", "BF16", "F32",
    "I64"): what the model holds resident, comparable with a checkpoint's header bytes. Raises KeyError naming
    a dtype outside that table."""
    out: dict[str, int] = {}
    for name, t in model.state_dict().items():
        if t.dtype not in TORCH_TO_SAFETENSORS:
            raise KeyError(f"{name}: dtype {t.dtype} has no safetensors name")
        dt = TORCH_TO_SAFETENSORS[t.dtype]
        out[dt] = out.get(dt, 0) + t.numel() * DTYPE_BYTES[dt]
    return dict(sorted(out.items()))
