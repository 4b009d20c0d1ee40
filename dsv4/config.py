"""DeepSeek-V4 architecture configuration (`ModelArgs`) and the runtime env knob `TEST_LAYERS`.

Field names are the official inference config names (`inference/config.json`, reference spec §1.2); the
HF-style `config.json` shipped at a checkpoint's root is folded into them by `ModelArgs.from_hf_config`
(spec §1.1, §1.3). Runtime settings (device, dtype, backend, max length) are not architecture and live in
the model's constructor / decode state, never here.

Dimension legend used by every docstring in dsv4 (one place, STYLE §5):
    b   batch                      s   sequence (tokens in this call)      t   absolute token position
    hc  mHC streams (hc_mult = 4)  d   model width (`dim`)                 h   attention heads (`n_heads`)
    hd  head_dim (512)             rd  rope_head_dim (64)                  nd  hd - rd (448)
    E   routed experts             k   activated experts per token         V   vocab_size
    w   compressed entry index     r   compress ratio (0 / 4 / 128)
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ModelArgs", "ModelArgsError", "LimitError", "HF_CONFIG", "HFKey", "HF_CONFIG_KEYS", "CONFIG_RANGES", "FP8_BLOCK",
           "FP4_BLOCK", "layers_from_env", "TEST_LAYERS_ENV", "UnsupportedRevisionError", "detect_revision",
           "IMPLEMENTED_RELEASE", "FIXED_CONFIG_VALUES", "NO_DEFAULT_CONFIG_KEYS", "loads_json", "load_json",
           "SymlinkLoopError", "symlink_loop", "check_not_loop", "NoMTPBlockError", "check_has_mtp"]

TEST_LAYERS_ENV = "TEST_LAYERS"
_SCORE_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
_RATIOS = (0, 4, 128)


class ModelArgsError(ValueError):
    """A `ModelArgs` value that is invalid; `field` is the `ModelArgs` field name (its config.json key:
    `HF_CONFIG_KEYS`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


# Block sizes of the on-disk formats (reference spec §2), defined once: FP8 weights carry one ue8m0 scale per
# FP8_BLOCK x FP8_BLOCK block (config.json `quantization_config.weight_block_size`), FP4 experts one per FP4_BLOCK
# inputs of a row. Their definition is `kernels.numerics` (the number formats' leaf module, which imports torch);
# this torch-free copy exists because the CLI and the tokenizer read configs without torch (this module imports
# nothing of dsv4 and no torch); tests/unit/test_import_health.py checks that both are the same numbers.
FP8_BLOCK = 128
FP4_BLOCK = 32

_NUM = (int, float)  # a JSON number
_INTEGRAL = "integral"  # a JSON number with an integral value (65536 or 65536.0), read as int
_REQUIRED = ...


class LimitError(ValueError):
    """A request exceeds a stated serving limit (`dsv4.memory_plan.MAX_BATCH`, the model's context per row, the
    memory of the decode state); raised before any model work, with the limit's name, its value and what was asked.
    Defined here (the lowest layer) so that `dsv4.model` raises it too; `dsv4.memory_plan` re-exports it."""


@dataclass(frozen=True)
class HFKey:
    """One key of the HF-style config.json (dotted for nested objects: `rope_scaling.factor`).

    field: the `ModelArgs` field it holds, or None for a constant of the format, written as `value` by
        `to_hf_config` (and, with `fixed`, refused by `from_hf_config` when present with another value:
        `FIXED_CONFIG_VALUES`). kind: the JSON type `from_hf_config` accepts (int, str, list, `_NUM`, `_INTEGRAL`;
        None: read as given). default: the value when absent (`_REQUIRED`: a missing key is an error, with the
        reason from `NO_DEFAULT_CONFIG_KEYS`). fp8_only: written only for an fp8 checkpoint (quantization_config).
        written: False for a key `to_hf_config` leaves out (its absence means the same value).
    """

    key: str
    field: str | None = None
    kind: Any = int
    default: Any = _REQUIRED
    value: Any = None
    fixed: bool = False
    fp8_only: bool = False
    written: bool = True


# THE config.json <-> ModelArgs mapping, in the order `to_hf_config` writes it. It drives `from_hf_config` (keys,
# types, defaults, fixed values), `to_hf_config` and the error messages (`HF_CONFIG_KEYS`, `FIXED_CONFIG_VALUES`).
HF_CONFIG: tuple[HFKey, ...] = (
    HFKey("architectures", value=["DeepseekV4ForCausalLM"]),
    HFKey("model_type", value="deepseek_v4"),
    HFKey("vocab_size", "vocab_size"),
    HFKey("hidden_size", "dim"),
    HFKey("moe_intermediate_size", "moe_inter_dim"),
    HFKey("num_hidden_layers", "n_layers"),
    HFKey("num_hash_layers", "n_hash_layers"),
    HFKey("num_nextn_predict_layers", "n_mtp_layers"),
    HFKey("num_attention_heads", "n_heads"),
    HFKey("num_key_value_heads", value=1),
    HFKey("n_routed_experts", "n_routed_experts"),
    HFKey("n_shared_experts", "n_shared_experts"),
    HFKey("num_experts_per_tok", "n_activated_experts"),
    HFKey("scoring_func", "score_func", str),
    HFKey("routed_scaling_factor", "route_scale", _NUM),
    HFKey("norm_topk_prob", value=True, fixed=True),
    HFKey("topk_method", value="noaux_tc", fixed=True),
    HFKey("swiglu_limit", "swiglu_limit", _NUM),
    HFKey("q_lora_rank", "q_lora_rank"),
    HFKey("head_dim", "head_dim"),
    HFKey("qk_rope_head_dim", "rope_head_dim"),
    HFKey("o_groups", "o_groups"),
    HFKey("o_lora_rank", "o_lora_rank"),
    HFKey("sliding_window", "window_size"),
    HFKey("compress_ratios", "compress_ratios", list),
    HFKey("rope_theta", "rope_theta", _NUM),
    HFKey("compress_rope_theta", "compress_rope_theta", _NUM),
    HFKey("rope_scaling.type", value="yarn"),
    HFKey("rope_scaling.factor", "rope_factor", _NUM),
    HFKey("rope_scaling.original_max_position_embeddings", "original_seq_len", _INTEGRAL),
    HFKey("rope_scaling.beta_fast", "beta_fast", _INTEGRAL),
    HFKey("rope_scaling.beta_slow", "beta_slow", _INTEGRAL),
    HFKey("max_position_embeddings", value=1048576),  # written as the model's context (`to_hf_config`)
    HFKey("index_n_heads", "index_n_heads"),
    HFKey("index_head_dim", "index_head_dim"),
    HFKey("index_topk", "index_topk"),
    HFKey("hc_mult", "hc_mult"),
    HFKey("hc_sinkhorn_iters", "hc_sinkhorn_iters"),
    HFKey("hc_eps", "hc_eps", _NUM),
    HFKey("rms_norm_eps", "norm_eps", _NUM),
    HFKey("bos_token_id", "bos_token_id", default=0, value=0, fixed=True),
    HFKey("eos_token_id", "eos_token_id", default=1, value=1, fixed=True),
    HFKey("tie_word_embeddings", value=False, fixed=True),
    HFKey("torch_dtype", value="bfloat16"),
    HFKey("attention_bias", value=False, fixed=True),
    HFKey("hidden_act", value="silu", fixed=True),
    HFKey("mlp_bias", value=False, fixed=True, written=False),
    HFKey("expert_dtype", "expert_dtype", None, default=None),  # absent: fp4 for fp8 checkpoints ([F0], spec §1.1)
    HFKey("quantization_config.quant_method", value="fp8", fp8_only=True),
    HFKey("quantization_config.fmt", value="e4m3", fp8_only=True),
    HFKey("quantization_config.activation_scheme", value="dynamic", fixed=True, fp8_only=True),
    HFKey("quantization_config.scale_fmt", "scale_fmt", None, default="ue8m0", fp8_only=True),
    HFKey("quantization_config.weight_block_size", value=[FP8_BLOCK, FP8_BLOCK], fp8_only=True),
)

# ModelArgs fields whose config.json key has another name, for error messages (from `HF_CONFIG`)
HF_CONFIG_KEYS: dict[str, str] = {k.field: k.key for k in HF_CONFIG if k.field is not None and k.field != k.key}

# Ranges of the fields that size no tensor of the checkpoint (so no header bounds them) but a loop or an allocation:
# a value outside would hang or exhaust memory before anything could report it (issue 28). Released values inside.
CONFIG_RANGES: dict[str, tuple[int, int, str]] = {
    "hc_sinkhorn_iters": (1, 1000, "released 20; the Sinkhorn loop runs this many iterations per token and layer, "
                                   "1e9 would never finish"),
    "window_size": (1, 65536, "released 128; the decode state holds a window ring of this many KV entries per "
                              "layer and sequence"),
    "index_topk": (1, 65536, "released 512 / 1024; the indexer selects (and the captured decode step allocates) "
                             "this many compressed entries per query"),
    "n_routed_experts": (1, 4096, "released 256 / 384; the tensor inventory lists three linears per expert and "
                                  "layer before any header is read"),
}


def _json_type_name(typ: type | tuple[type, ...]) -> str:
    """'an integer', 'a number', 'a string', 'a JSON list', 'a JSON object' for the types `from_hf_config` reads."""
    names = {int: "an integer", float: "a number", str: "a string", list: "a JSON list", dict: "a JSON object",
             bool: "true or false"}
    if isinstance(typ, tuple):
        return "a number" if set(typ) == {int, float} else " or ".join(names.get(t, t.__name__) for t in typ)
    return names.get(typ, typ.__name__)


@dataclass(frozen=True)
class ModelArgs:
    """Frozen DeepSeek-V4 architecture (official `ModelArgs` field names; spec §1).

    Raises:
        ModelArgsError (a ValueError, `.field` = the field): from `__post_init__`, naming the field, its value
            and what was expected, for any
            inconsistent value (e.g. `head_dim` not a multiple of 2, `n_heads % o_groups != 0`,
            `compress_ratios` shorter than `n_layers` or holding a ratio other than 0/4/128).
    """

    vocab_size: int = 129280
    dim: int = 4096
    moe_inter_dim: int = 2048
    n_layers: int = 43
    n_hash_layers: int = 3
    n_mtp_layers: int = 1
    n_heads: int = 64
    # MoE
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    # attention
    q_lora_rank: int = 1024
    head_dim: int = 512
    rope_head_dim: int = 64
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    compress_ratios: tuple[int, ...] = field(default_factory=lambda: (0, 0) + (4, 128) * 20 + (4, 0))
    # RoPE / YaRN (YaRN applies to ratio>0 layers only, never an mscale: spec §5)
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: int = 32
    beta_slow: int = 1
    # lightning indexer
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    # on-disk quantization: dtype "fp8" (128x128 e4m3 + ue8m0) or "bf16"; expert_dtype "fp4" | "fp8" | "bf16"
    dtype: str = "fp8"
    scale_fmt: str | None = "ue8m0"
    expert_dtype: str = "fp4"
    bos_token_id: int = 0
    eos_token_id: int = 1

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        ratios = tuple(self.compress_ratios)
        for i, r in enumerate(ratios):
            if not isinstance(r, int) or isinstance(r, bool):
                raise ModelArgsError("compress_ratios", f"ModelArgs.compress_ratios[{i}]={r!r}: expected an int "
                                     "(0, 4 or 128)")
        object.__setattr__(self, "compress_ratios", ratios)

        def bad(name: str, expected: str) -> ValueError:
            return ModelArgsError(name, f"ModelArgs.{name}={getattr(self, name)!r}: expected {expected}")

        for name in ("vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "n_routed_experts",
                     "n_activated_experts", "q_lora_rank", "head_dim", "rope_head_dim", "o_groups",
                     "o_lora_rank", "window_size", "index_n_heads", "index_head_dim", "index_topk",
                     "hc_mult", "hc_sinkhorn_iters", "original_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad(name, "a positive integer")
        for name, (lo, hi, why) in CONFIG_RANGES.items():
            if not lo <= getattr(self, name) <= hi:
                raise bad(name, f"an integer in {lo}..{hi} ({why})")
        for name in ("n_hash_layers", "n_mtp_layers", "n_shared_experts"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise bad(name, "a non-negative integer")
        if self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            raise bad("rope_head_dim", f"an even number <= head_dim ({self.head_dim})")
        if self.index_head_dim % 2 or self.rope_head_dim > self.index_head_dim:
            raise bad("index_head_dim", f"an even number >= rope_head_dim ({self.rope_head_dim})")
        if self.index_head_dim & (self.index_head_dim - 1):
            raise bad("index_head_dim", "a power of two (the indexer applies a Walsh-Hadamard rotation)")
        if self.n_heads % self.o_groups:
            raise bad("o_groups", f"a divisor of n_heads ({self.n_heads})")
        if self.n_activated_experts > self.n_routed_experts:
            raise bad("n_activated_experts", f"<= n_routed_experts ({self.n_routed_experts})")
        if self.n_hash_layers > self.n_layers:
            raise bad("n_hash_layers", f"<= n_layers ({self.n_layers})")
        if len(self.compress_ratios) < self.n_layers:
            raise bad("compress_ratios", f"at least n_layers={self.n_layers} entries "
                      "(main layers, then one per MTP block)")
        for i, r in enumerate(self.compress_ratios):
            if r not in _RATIOS:
                raise ModelArgsError("compress_ratios", f"ModelArgs.compress_ratios[{i}]={r}: expected one of "
                                     f"{_RATIOS}")
        if self.score_func not in _SCORE_FUNCS:
            raise bad("score_func", f"one of {_SCORE_FUNCS}")
        if self.dtype not in ("fp8", "bf16"):
            raise bad("dtype", "'fp8' or 'bf16'")
        if self.expert_dtype not in ("fp4", "fp8", "bf16"):
            raise bad("expert_dtype", "'fp4', 'fp8' or 'bf16'")
        if self.dtype == "fp8" and self.scale_fmt != "ue8m0":
            raise bad("scale_fmt", "'ue8m0' for an fp8 checkpoint")
        for name in ("rope_theta", "compress_rope_theta", "rope_factor", "route_scale", "norm_eps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise bad(name, "a finite positive number")
        for name in ("hc_eps", "swiglu_limit"):  # norm_eps above: every RMSNorm needs eps > 0 (x / sqrt(ms + eps))
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise bad(name, "a finite non-negative number")
        for name in ("beta_fast", "beta_slow"):  # YaRN correction dims take log(original_seq_len / beta)
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
                raise bad(name, "a finite positive number (YaRN rotations)")
        if not self.beta_fast > self.beta_slow:
            raise bad("beta_fast", f"> beta_slow ({self.beta_slow}): YaRN ramps between the two correction dims")
        for name in ("bos_token_id", "eos_token_id"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < self.vocab_size:
                raise bad(name, f"a token id in 0..{self.vocab_size - 1}")

    # ------------------------------------------------------------------ derived
    @property
    def max_context(self) -> int:
        """Tokens one row may hold: original_seq_len x rope_factor (YaRN, spec §5.2; = max_position_embeddings).
        The one place of this rule: `dsv4.memory_plan.max_context`, `Transformer.forward` and `dsv4.warmup` read it."""
        return int(self.original_seq_len * self.rope_factor)

    @property
    def nope_head_dim(self) -> int:
        """`head_dim - rope_head_dim` (448 for the released models)."""
        return self.head_dim - self.rope_head_dim

    def ratio(self, layer_id: int) -> int:
        """Compress ratio of main layer `layer_id` (0 = sliding window only, 4 = CSA, 128 = HCA)."""
        return self.compress_ratios[layer_id]

    def with_layers(self, n_layers: int) -> "ModelArgs":
        """Copy keeping only the first `n_layers` main layers (ratios of later layers are dropped, the MTP
        block's ratio is kept last). Raises ValueError if n_layers is not in 1..self.n_layers."""
        if not (isinstance(n_layers, int) and 1 <= n_layers <= self.n_layers):
            raise ValueError(f"n_layers={n_layers!r}: expected an integer in 1..{self.n_layers}")
        mtp = self.compress_ratios[self.n_layers:]
        return dataclasses.replace(self, n_layers=n_layers,
                                   n_hash_layers=min(self.n_hash_layers, n_layers),
                                   compress_ratios=self.compress_ratios[:n_layers] + mtp)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf_config(cls, path_or_dict: str | os.PathLike | dict[str, Any]) -> "ModelArgs":
        """Build from an HF-style `config.json` (file, checkpoint directory, or parsed dict); spec §1.1. Every key,
        its type, default and the field it fills come from `HF_CONFIG`.

        Raises:
            FileNotFoundError: the path has no config.json, or its config.json is a directory or not a regular
                file, each said as such (`SymlinkLoopError`, a FileNotFoundError, when the path or its config.json
                is a symbolic link loop).
            UnsupportedRevisionError (a ValueError): the config belongs to a known later revision (V4.1, a DSpark
                re-release such as V4-Flash-0731, or the released layer counts with more `compress_ratios`
                entries than main layers + MTP blocks); the message names the revision, the evidence and what
                differs (`detect_revision`).
            ValueError: the file is not valid JSON or its top level is not an object (e.g. a list); a required
                key is missing, has the wrong type, or a value is unsupported (the message names the file and
                key); `model_type` missing or not 'deepseek_v4'; `architectures` present without
                'DeepseekV4ForCausalLM'; `num_key_value_heads != 1`; `rope_scaling` not
                YaRN; `compress_ratios` without exactly one entry for each main layer and MTP block; a value `ModelArgs` rejects (its message, prefixed
                with the config file when read from one, followed by the config.json key when it is named
                differently: `HF_CONFIG_KEYS`; out-of-range values: `CONFIG_RANGES`).
        """
        src = "<dict>"
        if isinstance(path_or_dict, dict):
            cfg = path_or_dict
        else:
            p = Path(path_or_dict)
            check_not_loop(p, "a checkpoint directory or its config.json")
            if p.is_dir():
                p = p / "config.json"
                check_not_loop(p, "an HF-style DeepSeek-V4 config.json")
                if p.is_dir():
                    raise FileNotFoundError(f"{p}: is a directory, not a file (expected the HF-style DeepSeek-V4 "
                                            "config.json file)")
            if not p.is_file():
                what = "no config.json" if not p.exists() else "not a regular file (e.g. a FIFO or device)"
                raise FileNotFoundError(f"{p}: {what} (expected an HF-style DeepSeek-V4 config)")
            src = str(p)
            cfg = load_json(p)
        if not isinstance(cfg, dict):
            raise ValueError(f"{src}: top level is a JSON {type(cfg).__name__}, expected a JSON object "
                             "(one HF-style DeepSeek-V4 config, not a list of them)")
        found = detect_revision(cfg)
        if found is not None:
            raise UnsupportedRevisionError(src, *found)
        for key, want in FIXED_CONFIG_VALUES.items():  # keys dsv4 implements one value of: never ignored
            v = _lookup(cfg, key)
            if v is not ... and not _same_value(v, want):
                raise ValueError(f"{src}: key {key!r}={_json_value(v)} ({_json_kind(v)}): dsv4 implements only "
                                 f"{_json_value(want)} ({_json_kind(want)}; the value of the released DeepSeek-V4 "
                                 "configs, compared by type and value); a checkpoint with another value would run "
                                 "a different model")
        if "model_type" not in cfg:  # transformers would guess the model (and print a false tokenizer warning)
            raise ValueError(f"{src}: missing key 'model_type' (expected 'deepseek_v4', as in every released "
                             "DeepSeek-V4 config.json; transformers and dsv4 read it to know the model)")
        mt = cfg["model_type"]
        if mt != "deepseek_v4":
            raise ValueError(f"{src}: model_type={mt!r}, expected 'deepseek_v4'")
        arch = cfg.get("architectures")  # optional; when present it must name this model (transformers reads it)
        if arch is not None and (not isinstance(arch, list) or "DeepseekV4ForCausalLM" not in arch):
            raise ValueError(f"{src}: key 'architectures'={_json_value(arch)} ({_json_kind(arch)}), expected a "
                             "list naming 'DeepseekV4ForCausalLM' (as in every released DeepSeek-V4 config.json; "
                             "another architecture with model_type 'deepseek_v4' is a different model)")
        kv = cfg.get("num_key_value_heads", 1)
        if not isinstance(kv, int) or isinstance(kv, bool):
            raise ValueError(f"{src}: key 'num_key_value_heads'={kv!r} has type {type(kv).__name__}, expected "
                             "an integer")
        if kv != 1:
            raise ValueError(f"{src}: num_key_value_heads={kv}, expected 1 (shared K=V)")
        rs = cfg.get("rope_scaling", None) if "rope_scaling" not in cfg else cfg["rope_scaling"]
        if "rope_scaling" in cfg and not isinstance(rs, dict):
            raise ValueError(f"{src}: key 'rope_scaling'={rs!r} has type {type(rs).__name__}, expected a JSON "
                             "object")
        if rs is None:  # transformers' newer layout: rope_parameters.compress
            rp = cfg.get("rope_parameters") or {}
            rs = rp.get("compress") if isinstance(rp, dict) else None
            if rs is None:
                raise ValueError(f"{src}: missing key 'rope_scaling' (YaRN parameters for compressed layers)")
            if not isinstance(rs, dict):
                raise ValueError(f"{src}: key 'rope_parameters.compress'={rs!r} has type {type(rs).__name__}, "
                                 "expected a JSON object (YaRN parameters)")
        rtype = rs.get("type", rs.get("rope_type"))
        if "type" in rs and "rope_type" in rs and rs["type"] != rs["rope_type"]:  # readers differ on which wins
            raise ValueError(f"{src}: rope_scaling.type={rs['type']!r} and rope_scaling.rope_type="
                             f"{rs['rope_type']!r} disagree (dsv4 reads type, transformers rope_type first); "
                             "expected both 'yarn', or one of them")
        if rtype != "yarn":
            raise ValueError(f"{src}: rope_scaling.type={rtype!r}, expected 'yarn'")
        q = cfg.get("quantization_config")
        if q is not None and not isinstance(q, dict):
            raise ValueError(f"{src}: key 'quantization_config'={q!r} has type {type(q).__name__}, expected a "
                             "JSON object (absent for a bf16 checkpoint)")
        if q is not None:
            if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3":
                raise ValueError(f"{src}: quantization_config={q!r}, expected quant_method 'fp8', fmt 'e4m3'")
            want = _CONSTANTS["quantization_config.weight_block_size"]
            wbs = q.get("weight_block_size", want)
            if not _same_value(wbs, want):
                raise ValueError(f"{src}: key 'quantization_config.weight_block_size'={_json_value(wbs)} "
                                 f"({_json_kind(wbs)}), expected {_json_value(want)} (a list of two integers; "
                                 "compared by type and value)")
        sections = {"rope_scaling": rs, "quantization_config": q or {}}
        fields: dict[str, Any] = {}
        for k in _FIELD_KEYS:
            head, _, rest = k.key.partition(".")
            v = _lookup(sections[head], rest) if rest else cfg.get(k.key, ...)
            if v is ...:
                if k.default is _REQUIRED:
                    why = NO_DEFAULT_CONFIG_KEYS.get(k.key)
                    raise ValueError(f"{src}: missing key {k.key!r}" + (f" ({why})" if why else ""))
                v = k.default
            elif k.kind is not None and not _json_kind_ok(v, k.kind):
                raise ValueError(f"{src}: key {k.key!r}={v!r} has type {type(v).__name__}, expected "
                                 f"{_json_type_name(int if k.kind == _INTEGRAL else k.kind)}")
            fields[k.field] = (float(v) if k.kind == _NUM else int(v) if k.kind == _INTEGRAL
                               else tuple(v) if k.kind is list else v)
        fields["dtype"] = "bf16" if q is None else "fp8"
        if q is None:
            fields["scale_fmt"] = None
        if fields["expert_dtype"] is None:
            fields["expert_dtype"] = q.get("expert_dtype") if q else None
        if fields["expert_dtype"] is None:  # initial Flash revision [F0]: no key, FP4 experts on disk (spec §1.1)
            fields["expert_dtype"] = "fp4" if q is not None else "bf16"
        try:
            args = cls(**fields)
        except ValueError as e:  # name the file the bad value came from, and the config.json key of the field
            key = HF_CONFIG_KEYS.get(getattr(e, "field", None))
            hint = f" (config.json key {key!r})" if key else ""
            if src == "<dict>" and not hint:
                raise
            raise ValueError(f"{'' if src == '<dict>' else src + ': '}{e}{hint}") from None
        # read nowhere else: it must say the context the model has, or be the released configs' 1048576, which
        # dsv4 before c9d97ad wrote into every config.json (tiny ones included): those checkpoints still load
        mpe = cfg.get("max_position_embeddings", ...)
        if mpe is not ... and not (_json_kind_ok(mpe, _INTEGRAL) and int(mpe) in (args.max_context, LEGACY_MPE)):
            raise ValueError(f"{src}: key 'max_position_embeddings'={_json_value(mpe)}, expected {args.max_context}: "
                             f"the context is rope_scaling.original_max_position_embeddings ({args.original_seq_len}) "
                             f"x rope_scaling.factor ({args.rope_factor:g}) (YaRN, spec §5.2)")
        want_n = args.n_layers + args.n_mtp_layers
        if len(args.compress_ratios) != want_n:  # one ratio per main layer, then one per MTP block
            released = "" if args.n_mtp_layers == 1 else \
                "; the released configs have num_nextn_predict_layers 1 (one MTP block)"
            raise ValueError(f"{src}: key 'compress_ratios' has {len(args.compress_ratios)} entries, expected "
                             f"{want_n}: one per main layer (num_hidden_layers={args.n_layers}), then one per MTP "
                             f"block (num_nextn_predict_layers={args.n_mtp_layers}){released}")
        return args

    def to_hf_config(self) -> dict[str, Any]:
        """Inverse of `from_hf_config`: the HF-style `config.json` dict for this architecture (`HF_CONFIG` in its
        order; `quantization_config` only for an fp8 checkpoint)."""
        cfg: dict[str, Any] = {}
        for k in HF_CONFIG:
            if not k.written or k.fp8_only and self.dtype != "fp8":
                continue
            v = k.value if k.field is None else getattr(self, k.field)
            if k.key == "max_position_embeddings":  # the context this config describes (the released: 1048576)
                v = self.max_context
            node = cfg
            *parents, last = k.key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = list(v) if isinstance(v, (tuple, list)) else v
        return cfg


# ------------------------------------------------------------------ later revisions (refused by name)

IMPLEMENTED_RELEASE = ("the April 2026 DeepSeek-V4 release (DeepSeek-V4-Flash / DeepSeek-V4-Pro of 24 April 2026: "
                       "one MTP block, the April prompt encoder)")

_DSPARK_DIFF = (
    "a DSpark speculative-decoding drafter (tensors mtp.0..2.* with main_proj, markov_head, confidence_head) "
    "replaces the single MTP block, so compress_ratios carries one entry per drafter block; the 0731/0813 "
    "re-releases ship new weights, and 0731's prompt encoder changed: reasoning_effort has three levels (low = "
    "no preamble and the default, high = the April 'max' preamble, max = a new 'Beyond maximum' preamble), so "
    "April prompts are wrong for it")
_V41_DIFF = (
    "a different architecture (CSA2 attention with shared compressed KV across layers, single-pass mHC, Engram "
    "memory modules, a vision encoder; a composite config with text_config / vision_config) and a different "
    "prompt encoder")


_RELEASED_MAIN_LAYERS = {"Flash": 43, "Pro": 61}


class UnsupportedRevisionError(ValueError):
    """config.json belongs to a known DeepSeek-V4 revision that dsv4 does not implement.

    Attributes:
        source: the config file (or "<dict>").
        revision: the revision's name, e.g. "DeepSeek-V4-Flash-0731 (or DeepSeek-V4-Flash-DSpark)".
        evidence: the config keys/values that identify it.
        differences: what differs from the April release dsv4 implements.
    """

    def __init__(self, source: str, revision: str, evidence: list[str], differences: str) -> None:
        self.source, self.revision, self.evidence, self.differences = source, revision, evidence, differences
        super().__init__(f"{source}: this is {revision} ({'; '.join(evidence)}), not the release dsv4 implements: "
                         f"dsv4 implements {IMPLEMENTED_RELEASE}. What differs: {differences}.")


def detect_revision(cfg: dict[str, Any]) -> tuple[str, list[str], str] | None:
    """Recognise a config.json of a known later DeepSeek-V4 revision; None for the April release.

    Public facts used (the reference spec's variant warning and the public model cards / serving-engine notes):
      * V4.1 (Sept 2026): `model_type` "deepseek_v41" (or "deepseek_v41_text"), architecture
        `DeepseekV41ForCausalLM`, a composite config whose `text_config` has that model_type.
      * DSpark re-releases (V4-Flash-0731, V4-Pro-0813, and the -DSpark checkpoints): the April keys plus
        `dspark_*` keys (0731: dspark_block_size 5, dspark_noise_token_id 128799, dspark_target_layer_ids
        [40, 41, 42], dspark_markov_rank 256) and 46 `compress_ratios` for 43 main layers. config.json alone
        cannot tell 0731 from the -DSpark checkpoint (same layout); the geometry tells Flash from Pro.
      * A config with the released counts (Flash 43 / Pro 61 main layers, `num_nextn_predict_layers` 1) and more
        `compress_ratios` entries than `num_hidden_layers + num_nextn_predict_layers` (the April layout: one per
        main layer, then one per MTP block) is a later layout, named as such. With an edited count (an MTP count
        of 0, fewer layers) the same mismatch is a bad value, never a revision: `from_hf_config` names the keys.
    Returns:
        (revision name, evidence strings, what differs), or None.
    """
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    types = {str(cfg.get("model_type")), str(text_cfg.get("model_type"))}
    archs = [a for a in (cfg.get("architectures") or []) if isinstance(a, str)]
    v41 = sorted(t for t in types if t.startswith("deepseek_v41")) + [a for a in archs if "V41" in a]
    if v41:
        return "DeepSeek-V4.1", [f"model_type/architectures {v41}"], _V41_DIFF
    dspark = sorted(k for k in cfg if isinstance(k, str) and k.startswith("dspark"))
    # an absent num_nextn_predict_layers is not evidence of anything: from_hf_config refuses it by name; only
    # layer counts that make sense count (num_hidden_layers 0 or a negative MTP count is a bad value, which
    # `ModelArgs` names, not a revision)
    ratios, n, mtp = cfg.get("compress_ratios"), cfg.get("num_hidden_layers"), cfg.get("num_nextn_predict_layers")
    hidden = cfg.get("hidden_size")
    geometry = {4096: "Flash", 7168: "Pro"}.get(hidden) if type(hidden) is int else None  # 4096.0 is not 4096
    extra = (isinstance(ratios, list) and isinstance(n, int) and isinstance(mtp, int) and not isinstance(n, bool)
             and not isinstance(mtp, bool) and n >= 1 and mtp >= 0 and len(ratios) > n + mtp)
    # Counts alone name a revision only where the other counts are the released ones (Flash 43 / Pro 61 main
    # layers, one MTP block): more ratios there is the DSpark drafter's layout. An edited count
    # (num_nextn_predict_layers 0, num_hidden_layers 42, a tiny config) with a ratio list that no longer fits is a
    # bad value, and `from_hf_config` names the keys that disagree instead of a revision nobody released.
    if extra and not dspark and not (mtp == 1 and _RELEASED_MAIN_LAYERS.get(geometry) == n):
        extra = False
    if not dspark and not extra:
        return None
    evidence = [f"keys {dspark}"] if dspark else []
    if extra:
        evidence.append(f"compress_ratios has {len(ratios)} entries for {n} main layers + {mtp} MTP block(s), "
                        f"the April layout has {n + mtp}")
    if not dspark:
        return ("a later DeepSeek-V4 revision (extra compress_ratios entries, as in the DSpark re-releases)",
                evidence, _DSPARK_DIFF)
    name = {"Flash": "DeepSeek-V4-Flash-0731 (or DeepSeek-V4-Flash-DSpark: same config layout)",
            "Pro": "DeepSeek-V4-Pro-0813 or DeepSeek-V4-Pro-DSpark (a DSpark revision of Pro)"}.get(
        geometry, "a DSpark revision of DeepSeek-V4 (V4-Flash-0731 / V4-Pro-0813 / -DSpark)")
    return name, evidence, _DSPARK_DIFF


# config.json keys whose released value is the only one dsv4 implements (absent = that value). Another value
# would silently change the model (routing weights, activation, tied head, biases, the tokenizer's BOS/EOS ids,
# which `dsv4.tokenizer` checks to be 0 and 1), so it is refused by name instead of being ignored.
FIXED_CONFIG_VALUES: dict[str, Any] = {k.key: k.value for k in HF_CONFIG if k.fixed}  # from `HF_CONFIG`
LEGACY_MPE = 1048576  # `max_position_embeddings` of the released configs; dsv4 wrote it for every model before c9d97ad
_CONSTANTS: dict[str, Any] = {k.key: k.value for k in HF_CONFIG if k.field is None}
_FIELD_KEYS: tuple[HFKey, ...] = tuple(k for k in HF_CONFIG if k.field is not None)


def _lookup(cfg: Any, dotted: str) -> Any:
    """The value at the dotted key in nested JSON objects; `...` when absent (or a parent is not an object)."""
    v = cfg
    for part in dotted.split("."):
        v = v.get(part, ...) if isinstance(v, dict) else ...
    return v


def _json_kind_ok(v: Any, kind: Any) -> bool:
    """`v` has the JSON type `kind` (a bool is never a number; `_INTEGRAL`: an integer or an integral float)."""
    if isinstance(v, bool):
        return kind is bool
    if kind == _INTEGRAL:
        return isinstance(v, int) or isinstance(v, float) and v.is_integer()
    return isinstance(v, kind)


# config.json keys that change the maths and have no safe default: a missing one is an error, never a fallback.
# A default here once ran a checkpoint whose config lacked the key as a different model, silently: no hash routing
# (num_hash_layers 0), route_scale 1.0, no SwiGLU clamp (swiglu_limit 0) -- the official `ModelArgs` toy defaults
# (spec §1.2 pitfall), which public DeepSeek-V4 ports shipped (docs/public_bugs.md). Every released config has them.
NO_DEFAULT_CONFIG_KEYS: dict[str, str] = {
    "num_hash_layers": "released value 3: the first layers route by tid2eid[token]; 0 would route them by score",
    "num_nextn_predict_layers": "released value 1: compress_ratios holds one entry per main layer and MTP block",
    "n_shared_experts": "released value 1: the always-on shared expert",
    "scoring_func": "released value 'sqrtsoftplus': the router's score function",
    "routed_scaling_factor": "released values 1.5 (Flash) and 2.5 (Pro): the routed weights' scale",
    "swiglu_limit": "released value 10.0: the SwiGLU clamp; 0 would disable it",
}


def _same_value(v: Any, want: Any) -> bool:
    """`v == want` with the JSON type compared too, recursively: `true` is not 1, 1.0 is not 1, [128.0, 128] is not
    [128, 128] (Python's `==` says True == 1 == 1.0)."""
    if type(v) is not type(want):
        return False
    if isinstance(want, list):
        return len(v) == len(want) and all(_same_value(a, b) for a, b in zip(v, want))
    if isinstance(want, dict):
        return v.keys() == want.keys() and all(_same_value(v[k], want[k]) for k in want)
    return v == want


def _json_value(v: Any) -> str:
    """A config value as it reads in config.json (`true`, `1.0`, `"silu"`)."""
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


def _json_kind(v: Any) -> str:
    """The JSON type of a config value, for messages: boolean, integer, float, string, list, object, null."""
    return {bool: "boolean", int: "integer", float: "float", str: "string", list: "list", dict: "object",
            type(None): "null"}.get(type(v), type(v).__name__)


class SymlinkLoopError(FileNotFoundError):
    """A path that is a symbolic link loop (ELOOP: the link resolves back to itself). A FileNotFoundError subclass,
    so every handler of a missing checkpoint handles it, but the message names the loop instead of a missing file."""


def symlink_loop(p: str | os.PathLike) -> bool:
    """True when resolving `p` fails with ELOOP (a link cycle); False for a path that exists or is missing."""
    try:
        os.stat(p)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def check_not_loop(p: str | os.PathLike, expected: str) -> None:
    """Raise `SymlinkLoopError` naming `p` when it is a symbolic link loop (`expected`: what should be there)."""
    if symlink_loop(p):
        raise SymlinkLoopError(f"{p}: symbolic link loop (the link resolves back to itself), expected {expected}; "
                               "fix or remove the link")


class NoMTPBlockError(ValueError):
    """The MTP drafter (or a load of the MTP block) was asked of a checkpoint / `ModelArgs` without one
    (`num_nextn_predict_layers` 0, e.g. `dsv4 make-checkpoint --no-mtp`)."""


def check_has_mtp(args: "ModelArgs", where: str = "this checkpoint") -> None:
    """Raise `NoMTPBlockError` (a ValueError) naming `where` when `args` has no MTP block
    (`n_mtp_layers` = config.json `num_nextn_predict_layers` 0): speculative decoding with the MTP drafter needs one."""
    if args.n_mtp_layers == 0:
        raise NoMTPBlockError(f"{where} has no MTP block (num_nextn_predict_layers = 0); speculative decoding with "
                              "the MTP drafter needs it (use a checkpoint with an MTP block, or another drafter)")


class DuplicateKeyError(ValueError):
    """A JSON object with the same key twice (Python's json keeps the last value silently)."""


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for k, _ in pairs:
        if k in seen:
            raise DuplicateKeyError(k)
        seen.add(k)
    return dict(pairs)


def loads_json(text: str | bytes, src: str) -> Any:
    """`json.loads` for files dsv4 reads from a checkpoint (config.json, the index, safetensors headers).

    Raises ValueError naming `src`: not UTF-8, not valid JSON, or an object with a duplicate key (json would
    keep the last value silently: `"num_hidden_layers": 4, "num_hidden_layers": 2` must not load as 2).
    NaN / Infinity literals are accepted here; the fields that hold numbers check finiteness themselves."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except DuplicateKeyError as e:
        raise ValueError(f"{src}: duplicate key {e.args[0]!r} in a JSON object (expected each key once; JSON "
                         "readers would silently keep only the last value)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{src}: not valid JSON ({e})") from None


def load_json(path: str | os.PathLike) -> Any:
    """`loads_json` of a file's text (UTF-8); errors name the file."""
    return loads_json(Path(path).read_bytes(), str(path))


def layers_from_env(n_layers: int, environ: dict[str, str] | None = None) -> int:
    """Number of main layers to load/run, from the `TEST_LAYERS` environment variable (never a CLI arg).

    Returns `n_layers` when the variable is unset or empty.

    Raises:
        ValueError: `TEST_LAYERS` is not a canonical decimal integer (" 2", "+2", "02", "1_0" are refused, as
            are "two" and "1.5"), or not in 1..n_layers (the message quotes the value).
    """
    env = os.environ if environ is None else environ
    raw = env.get(TEST_LAYERS_ENV, "")
    if raw == "":
        return n_layers
    # canonical decimal only: int() would also take "+5", "1_0", " 7", "07", "٣" (a stray space or sign in a
    # shell script is a typo, not a layer count)
    if not (raw.isascii() and raw.isdigit() and str(int(raw)) == raw):
        raise ValueError(f"{TEST_LAYERS_ENV}={raw!r}: expected an integer in 1..{n_layers} "
                         "(canonical decimal: no spaces, sign, leading zeros or underscores)")
    n = int(raw)
    if not 1 <= n <= n_layers:
        raise ValueError(f"{TEST_LAYERS_ENV}={raw!r}: expected an integer in 1..{n_layers} "
                         f"(the checkpoint has {n_layers} main layers)")
    return n
