"""The MTP block (spec §10) against an independent oracle, fp32, on tiny random weights.

The speculative tests check the MTP drafter's own consistency (prefill == token by token, its inputs matter) and
that speculative greedy equals plain greedy whatever it drafts, so a wrong MTP block would pass them all and only
lower the acceptance (public report vllm-project/vllm#48304: YaRN / the compressed layers' RoPE on the MTP
attention; acceptance 57 % -> 69 % once fixed). Here the block's logits are compared with:

  * its Block (sliding-window attention, MoE with the non-hash gate, both mHC sites) run by
    transformers' `DeepseekV4DecoderLayer` as layer `n_layers` of a transformers model with one more layer
    (`dsv4.hf_adapter.hf_config(args, n_layers + 1)`: that layer takes `compress_ratios[n_layers]` = 0, the
    main (non-YaRN) RoPE, like the official MTPBlock's layer_id = n_layers), whose input H is the transformers
    model's own last main streams;
  * the rest written here from spec §10: x = e_proj(enorm(embed(next ids))) broadcast over the streams
    + h_proj(hnorm(H)) per stream; logits = head(norm(hc_head_mtp(Block(x)))), hc_head_mtp being transformers'
    `DeepseekV4HyperHead` holding mtp.0.hc_head_*.

Tolerance: 5e-5 absolute on logits of O(1) (the parity tests' LOGIT_ATOL, test_model.py: fp32 through a few layers
of different summation orders). Negative controls, each beyond 100x that: the compressed layers' frequencies
(θ compress_rope_theta with YaRN) on the MTP attention (vllm#48304's class), the main model's hc_head_* instead
of mtp.0.hc_head_*, e_proj and h_proj swapped, the MTP block fed the token at t instead of t + 1.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers import DeepseekV4ForCausalLM  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead  # noqa: E402

from dsv4.hf_adapter import hf_config, to_hf_state_dict  # noqa: E402
from dsv4.model import Transformer, rope_inv_freq  # noqa: E402
from dsv4.tiny import random_state_dict, tiny_args  # noqa: E402

pytestmark = pytest.mark.hardstop  # the MTP block vs an independent oracle (transformers' decoder layer)

VOCAB = 512
ATOL = 5e-5
MTP_ONLY = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.", "hc_head_")  # the parts outside the Block


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Oracle:
    """transformers' DeepseekV4 with the MTP block's Block as its layer n_layers, and spec §10 around it."""

    def __init__(self, args, sd: dict[str, torch.Tensor]):
        n = args.n_layers
        cfg = hf_config(args, num_hidden_layers=n + 1)
        cfg._attn_implementation = "eager"
        self.hf = DeepseekV4ForCausalLM(cfg).float().eval()
        main = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
        block = {f"layers.{n}." + k[len("mtp.0."):]: v for k, v in sd.items()
                 if k.startswith("mtp.0.") and not k[len("mtp.0."):].startswith(MTP_ONLY)}
        self.hf.load_state_dict({k: v.float() for k, v in to_hf_state_dict({**main, **block}, args).items()},
                                strict=True)
        self.args, self.sd, self.n = args, sd, n

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, nxt: torch.Tensor, hc_head: str = "mtp.0.hc_head_",
               swap_projections: bool = False) -> torch.Tensor:
        sd, eps = self.sd, self.args.norm_eps
        e_w, h_w = sd["mtp.0.e_proj.weight"].float(), sd["mtp.0.h_proj.weight"].float()
        if swap_projections:
            e_w, h_w = h_w, e_w
        e = _rms(sd["embed.weight"].float()[nxt], sd["mtp.0.enorm.weight"].float(), eps)
        out = {}

        def pre(module, args, kwargs):  # H: the transformers model's last main streams [b, s, hc, dim]
            H = args[0]
            x = (e @ e_w.T).unsqueeze(2) + _rms(H, sd["mtp.0.hnorm.weight"].float(), eps) @ h_w.T
            return (x,) + args[1:], {**kwargs, "input_ids": nxt}

        def post(module, args, output):
            out["x"] = output

        layer = self.hf.model.layers[self.n]
        hooks = [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post)]
        try:
            self.hf.model(input_ids=ids)
        finally:
            for h in hooks:
                h.remove()
        head = DeepseekV4HyperHead(self.hf.config).float()
        head.hc_fn.data, head.hc_base.data, head.hc_scale.data = (sd[hc_head + s].float() for s in ("fn", "base",
                                                                                                  "scale"))
        y = head(out["x"])
        return _rms(y, sd["mtp.0.norm.weight"].float(), eps) @ sd["head.weight"].float().T


@pytest.fixture(scope="module")
def models():
    args = tiny_args(vocab_size=VOCAB)
    sd = random_state_dict(args, seed=31)
    m = Transformer(args, mtp=True)
    m.load_weights(sd)
    return m, Oracle(args, sd)


def _ours(m, ids: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    blk = m.mtp[0]
    with torch.no_grad():
        _, H = m(ids, m.new_state(1), streams=True)
        st = blk.attn.new_state(1, 256, m.dtype, m.device)
        return blk.predict(H, m.embed(nxt), 0, nxt, st, m.backend, m.head)[0]


@pytest.mark.parametrize("s", [5, 140])  # within the tiny window (8 tokens), and far past it (it slides)
def test_mtp_block_matches_the_transformers_layer_and_spec(models, seed, s):
    m, oracle = models
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (1, s + 1), generator=g)
    ids, nxt = tokens[:, :-1], tokens[:, 1:]  # position t reads H_t and the token at t + 1
    ours, want = _ours(m, ids, nxt), oracle.logits(ids, nxt)
    scale = float(want.abs().max())
    assert 0.1 < scale < 100, scale  # logits of O(1): an absolute tolerance is meaningful
    err = float((ours - want).abs().max())
    assert err <= ATOL, f"MTP logits vs the oracle: max |d| {err:.3g} > {ATOL}"
    # negative controls on the oracle: each wiring error of the MTP class is far outside the tolerance
    for name, bad in (("main hc_head", oracle.logits(ids, nxt, hc_head="hc_head_")),
                      ("e_proj / h_proj swapped", oracle.logits(ids, nxt, swap_projections=True)),
                      ("token at t, not t + 1", oracle.logits(ids, ids))):
        assert float((bad - want).abs().max()) > 100 * ATOL, f"control {name} is not seen"


def test_compressed_layer_rope_on_the_mtp_attention_is_seen(models, seed):
    """vllm#48304's class: the MTP attention with the compressed layers' frequencies (compress_rope_theta and the
    YaRN ramp) instead of its own layer's (ratio 0: rope_theta, no YaRN) is refused by the oracle comparison."""
    m, oracle = models
    args = m.args
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (1, 41), generator=g)
    ids, nxt = tokens[:, :-1], tokens[:, 1:]
    attn = m.mtp[0].attn
    names = [k for k, v in attn.named_buffers() if k.endswith("inv_freq")]
    assert names, "the MTP attention holds no inv_freq buffer: the control cannot be applied"
    mine = rope_inv_freq(args, args.compress_ratios[args.n_layers])
    compressed = rope_inv_freq(args, 4)
    assert not torch.allclose(mine, compressed)
    saved = {k: attn.get_buffer(k).clone() for k in names}
    assert all(torch.equal(v.to(mine.dtype), mine.to(v.device)) for v in saved.values()), "its own frequencies"
    want = oracle.logits(ids, nxt)
    try:
        for k in names:
            attn.get_buffer(k).copy_(compressed.to(saved[k].dtype))
        bad = _ours(m, ids, nxt)
    finally:
        for k, v in saved.items():
            attn.get_buffer(k).copy_(v)
    assert float((bad - want).abs().max()) > 100 * ATOL, "the compressed layers' RoPE on the MTP block is not seen"
    assert float((_ours(m, ids, nxt) - want).abs().max()) <= ATOL  # restored
