"""The one adapter between dsv4's official tensor names and HuggingFace transformers' DeepseekV4 names.

Used only where we talk to transformers (the parity oracle in tests). The mapping follows transformers'
`conversion_mapping.py` for "deepseek_v4" (reference spec §11, "HF key mapping").
"""

from __future__ import annotations

import re

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from dsv4.config import ModelArgs

__all__ = ["hf_name", "to_hf_state_dict", "hf_config", "build_hf_model"]

_RULES = [  # (pattern on the official name, replacement), applied in order
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.", "model.layers."),
    (r"\.attn\.indexer\.compressor\.", ".attn.compressor.indexer."),
    (r"\.attn\.indexer\.weights_proj\.", ".attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.wq_b\.", ".attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"(compressor(?:\.indexer)?)\.norm\.", r"\1.kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
]
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")


def hf_name(name: str) -> str:
    """Official tensor name -> transformers DeepseekV4 name (routed experts excepted: they are stacked)."""
    for pat, rep in _RULES:
        name = re.sub(pat, rep, name)
    return name


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Official-name, dequantized state dict -> transformers' names. Routed experts are stacked:
    `experts.gate_up_proj [E, 2I, D]` (w1 rows then w3 rows) and `experts.down_proj [E, D, I]`.
    Raises KeyError naming a missing expert tensor."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for k, v in sd.items():
        m = _EXPERT.match(k)
        if m:
            experts.setdefault(int(m[1]), {}).setdefault(int(m[2]), {})[m[3]] = v
        elif not k.startswith("mtp."):
            out[hf_name(k)] = v
    for layer, ex in experts.items():
        E = args.n_routed_experts
        try:
            out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat((ex[e]["w1"], ex[e]["w3"]), 0) for e in range(E)])
            out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([ex[e]["w2"] for e in range(E)])
        except KeyError as err:
            raise KeyError(f"layers.{layer}.ffn.experts: missing {err}") from None
    return out


def hf_config(args: ModelArgs, num_hidden_layers: int | None = None):
    """transformers `DeepseekV4Config` for `args` (unquantized: weights are given dequantized).

    `num_hidden_layers`: None = `args.n_layers`; `args.n_layers + 1` gives the MTP block's layer (spec §10: layer_id
    n_layers, ratio `compress_ratios[n_layers]`) a transformers decoder layer of its own, the oracle of
    tests/unit/test_mtp_oracle.py. Raises ValueError outside n_layers .. len(compress_ratios)."""

    cfg = args.to_hf_config()
    if num_hidden_layers is not None:
        if not args.n_layers <= num_hidden_layers <= len(args.compress_ratios):
            raise ValueError(f"hf_config: num_hidden_layers={num_hidden_layers}, expected {args.n_layers} .. "
                             f"{len(args.compress_ratios)} (the main layers, plus MTP layers that have a ratio)")
        cfg["num_hidden_layers"] = num_hidden_layers
    cfg.pop("quantization_config", None)
    for k in ("architectures", "model_type", "torch_dtype", "topk_method", "expert_dtype"):
        cfg.pop(k, None)
    cfg["rope_parameters"] = dict(cfg.pop("rope_scaling"), rope_type="yarn")
    cfg["max_position_embeddings"] = args.max_context  # original_seq_len x rope_factor (a non-integer factor too)
    return DeepseekV4Config(**cfg)


def build_hf_model(args: ModelArgs, sd: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
    """transformers `DeepseekV4ForCausalLM` holding the weights `sd` (official names), eval mode, eager
    attention. Raises RuntimeError on missing/unexpected keys (strict load)."""

    cfg = hf_config(args)
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).to(dtype).eval()
    hsd = to_hf_state_dict(sd, args)
    own = model.state_dict()
    model.load_state_dict({k: v.to(own[k].dtype) if k in own else v for k, v in hsd.items()}, strict=True)
    return model
