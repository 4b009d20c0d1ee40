"""Tiny DeepSeek-V4 checkpoints in the official on-disk layout (reference spec §11), for tests and the CLI.

`tiny_args()` is THE tiny architecture: every feature at tiny width (hc_mult 4; sliding, CSA and HCA layers;
an indexer whose top-k (4) is below the compressed entries available at test lengths; one hash-routed layer
with a distinct-expert `tid2eid`; a shared expert; one MTP block; FP8 weights + FP4 experts) and the real
vocabulary (129,280) so the real tokenizer files apply. `random_state_dict` draws realistic full-precision
weights; `make_tiny` quantizes them and writes config.json, generation_config.json, the index, several shards
and the tokenizer files exactly as the released checkpoints are laid out. Deterministic given the seed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsv4 import quant
from dsv4.checkpoint import INDEX_FILE, expected_tensors, inventory_bytes
from dsv4.config import ModelArgs

__all__ = ["tiny_args", "random_state_dict", "make_tiny", "VARIANTS", "tokenizer_dir"]

VARIANTS = ("fp8", "bf16")

_TINY = dict(
    vocab_size=129280, dim=64, moe_inter_dim=32, n_layers=4, n_hash_layers=1, n_mtp_layers=1, n_heads=4,
    n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, score_func="sqrtsoftplus", route_scale=1.5,
    swiglu_limit=10.0, q_lora_rank=32, head_dim=64, rope_head_dim=16, o_groups=2, o_lora_rank=32,
    window_size=8, compress_ratios=(0, 4, 128, 4) + (0,), rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_factor=16.0, original_seq_len=64, beta_fast=32, beta_slow=1, index_n_heads=4, index_head_dim=32,
    index_topk=4, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6, dtype="fp8",
    scale_fmt="ue8m0", expert_dtype="fp4",
)


def tiny_args(**overrides) -> ModelArgs:
    """The tiny architecture (dim 64, 4 main layers with ratios 0/4/128/4 + one ratio-0 MTP block, vocab 129280,
    FP8 + FP4 experts; YaRN active beyond original_seq_len 64). `overrides` replace fields by official name.

    Raises ValueError (from ModelArgs) for an override that makes the config invalid.
    """
    return ModelArgs(**{**_TINY, **overrides})


# ---------------------------------------------------------------------------------------------- weights
def _role(name: str) -> str:
    """Which family of values a tensor name gets in `random_state_dict`."""
    last = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return "norm"
    if name == "embed.weight":
        return "embed"
    if ".experts." in name:
        return "expert"
    return {"attn_sink": "sink", "ape": "ape", "bias": "bias", "tid2eid": "tid2eid"}.get(last, "")


def _hc(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Asymmetric mHC parameters: fn ~ N(0, 0.05^2) (so fn @ x_normalised is O(1) across the 4·D inputs),
    base ~ N(0, 0.5^2) different per entry, scale in [0.5, 1.5] different per entry."""
    if name.endswith("_fn"):
        return torch.randn(shape, generator=g) * (0.5 / math.sqrt(shape[1] / 4))
    if name.endswith("_base"):
        return torch.randn(shape, generator=g) * 0.5
    return 0.5 + torch.rand(shape, generator=g)


def _binade_blocks(w: torch.Tensor, rows: int, cols: int, lo: int, hi: int, g: torch.Generator) -> torch.Tensor:
    """Multiply each [rows, cols] block of `w` by 2^k, k uniform in lo..hi, so quantization scales span binades."""
    out, inp = w.shape
    k = torch.randint(lo, hi + 1, (-(-out // rows), -(-inp // cols)), generator=g).float()
    f = torch.exp2(k).repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :inp]
    return w * f


def random_state_dict(args: ModelArgs, seed: int = 0, include_mtp: bool = True) -> dict[str, torch.Tensor]:
    """Full-precision official-name weights with realistic, non-degenerate values; deterministic given `seed`.

    Every tensor of `expected_tensors(args, include_mtp=include_mtp)` except `.scale`, with the unquantized
    shape ([out, in] for FP4 experts too): float32, except `ffn.gate.tid2eid` int64 [V, k] whose rows hold
    DISTINCT experts in [0, n_routed_experts) (spec §8.7). Values:
        linear weights   N(0, 1/in), each FP8 128x128 block (2^-2..2^1) and each FP4 1x32 group (2^-3..2^1)
                         rescaled by a power of two so the quantization scales span several binades
        embed            N(0, 1);   norms 1 + N(0, 0.1^2);   attn_sink N(0, 1);   ape N(0, 0.5^2)
        gate.bias        N(0, 0.1^2);   hc_* see `_hc` (non-trivial Sinkhorn, pre and post)
    The values do not depend on `args.dtype` / `args.expert_dtype`, so the fp8 and bf16 variants of one seed
    hold the same weights up to quantization.
    """
    g = torch.Generator().manual_seed(seed)
    inv = expected_tensors(dataclasses.replace(args, dtype="fp8", scale_fmt="ue8m0", expert_dtype="fp4"),
                           include_mtp=include_mtp)
    fp8 = {k.removesuffix(".scale") + ".weight" for k in inv if k.endswith(".scale")}
    sd: dict[str, torch.Tensor] = {}
    for name, (shape, dt) in inv.items():
        if name.endswith(".scale"):
            continue
        role = _role(name)
        if role == "expert":
            shape = (shape[0], shape[1] * 2)  # FP4 inventory shape is packed [out, in/2]
        if role == "tid2eid":
            sd[name] = torch.rand(shape[0], args.n_routed_experts, generator=g).argsort(dim=1)[:, :shape[1]]
            continue
        if "hc_" in name and dt == "F32":
            sd[name] = _hc(name, shape, g)
        elif role == "norm":
            sd[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif role == "embed":
            sd[name] = torch.randn(shape, generator=g)
        elif role == "sink":
            sd[name] = torch.randn(shape, generator=g)
        elif role == "ape":
            sd[name] = 0.5 * torch.randn(shape, generator=g)
        elif role == "bias":
            sd[name] = 0.1 * torch.randn(shape, generator=g)
        else:
            w = torch.randn(shape, generator=g) / math.sqrt(shape[1])
            if role == "expert":
                w = _binade_blocks(w, 1, quant.FP4_BLOCK, -3, 1, g)
            elif name in fp8:
                w = _binade_blocks(w, quant.FP8_BLOCK, quant.FP8_BLOCK, -2, 1, g)
            sd[name] = w
    return sd
