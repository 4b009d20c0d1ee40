"""SwiGLU clamp (spec §8.5, pitfall 15): the experts against a float64 hand formula on inputs LARGE enough that
the clamp is engaged.

Why a separate test: the model-level anchors (transformers parity, prefill == decode) run random weights whose
expert pre-activations stay well inside swiglu_limit = 10, so a missing clamp passes them all (the mutant
`swiglu_clamp_missing` survived them). Here the input is scaled so that many gate values u exceed +10 (and go
below -10, where only the upper bound applies) and many up values v leave [-10, 10]; the test asserts that.

Formula (spec §8.5): u = w1·x, v = w3·x, v <- clamp(v, -limit, limit), u <- min(u, limit),
h = silu(u)·v (times the routing weight, for routed experts, BEFORE w2), y = w2·h.
Tolerance: rtol 1e-5 (fp32 table) and atol 1e-5 x max|expected| (outputs reach ~200): the experts accumulate
64 and 32 fp32 products, so an element's rounding error scales with its largest terms, not with its own value
(measured max |error| 5e-5 at max|expected| ~230, i.e. 2e-7 of the scale). A missing clamp errs by ~1e2.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.model import Transformer
from dsv4.testing import assert_close
from dsv4.tiny import random_state_dict, tiny_args

pytestmark = pytest.mark.hardstop  # SwiGLU clamps and routing (kills swiglu_clamp_missing)

X_SCALE = 8.0  # input scale that drives |w1 x|, |w3 x| well past swiglu_limit (asserted below)


@pytest.fixture(scope="module")
def moe():
    args = tiny_args(vocab_size=512)
    model = Transformer(args)
    model.load_weights({k: v for k, v in random_state_dict(args, seed=21).items() if not k.startswith("mtp.")})
    return args, model.layers[1].ffn  # layer 1: a score-routed layer (layer 0 is hash-routed)


def swiglu64(x, expert, limit: float, weight=None, clamp: bool = True) -> torch.Tensor:
    """float64 SwiGLU of spec §8.5 with the expert's weights; `clamp=False` is the unclamped formula."""
    u = x.double() @ expert.w1.weight.double().T
    v = x.double() @ expert.w3.weight.double().T
    if clamp:
        v, u = v.clamp(-limit, limit), u.clamp(max=limit)
    h = u * torch.sigmoid(u) * v
    if weight is not None:
        h = h * weight.double()
    return h @ expert.w2.weight.double().T


@pytest.mark.parametrize("which", ["routed", "shared"])
@torch.no_grad()
def test_swiglu_clamp_engaged(moe, which, seed):
    args, ffn = moe
    limit = args.swiglu_limit
    assert limit == 10.0
    expert = ffn.experts[3] if which == "routed" else ffn.shared_experts  # shared: clamped since [F1]
    x = torch.randn(96, args.dim) * X_SCALE
    u, v = x @ expert.w1.weight.T, x @ expert.w3.weight.T
    assert int((u > limit).sum()) >= 20 and int((u < -limit).sum()) >= 20 and int((v.abs() > limit).sum()) >= 20, \
        "inputs must drive the clamp on both u bounds' sides and v"
    weight = torch.rand(96, 1) + 0.5 if which == "routed" else None
    got = expert(x, weight) if weight is not None else expert(x)
    assert got.dtype == torch.float32
    want = swiglu64(x, expert, limit, weight)
    atol = 1e-5 * float(want.abs().max())
    assert_close(got, want, f"{which} expert output", rtol=1e-5, atol=atol)
    # negative control: the unclamped formula is far from the output (the check can see a missing clamp)
    with pytest.raises(AssertionError):
        assert_close(got, swiglu64(x, expert, limit, weight, clamp=False), "unclamped", rtol=1e-5, atol=atol)


@torch.no_grad()
def test_moe_applies_routing_weight_before_w2_with_clamp(moe, seed):
    """The MoE output equals sum over picked experts of g_e * swiglu_e(x) plus the shared expert, clamp engaged."""
    args, ffn = moe
    x = torch.randn(1, 40, args.dim) * X_SCALE
    ids = torch.randint(0, 512, (1, 40))
    weights, picks = ffn.gate(x.reshape(40, -1), ids.reshape(-1))
    want = swiglu64(x[0], ffn.shared_experts, args.swiglu_limit)
    for t in range(40):
        for j in range(picks.shape[1]):
            want[t] += swiglu64(x[0, t:t + 1], ffn.experts[int(picks[t, j])], args.swiglu_limit,
                                weights[t, j].view(1, 1))[0]
    assert_close(ffn(x, ids)[0], want, "MoE output", rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@torch.no_grad()
def test_repeated_expert_in_a_tid2eid_row_counts_once_per_slot(seed):
    """Difference M5 (docs/differences.md): a hash-layer `tid2eid` row naming one expert twice contributes that
    expert once per slot, each with its own routing weight (accumulation, as transformers' `index_add_`). The
    official `y[idx] += ...` keeps one of the two writes. Layer 0 (hash-routed) of the tiny model, float64
    oracle, tolerance as above."""
    args = tiny_args(vocab_size=512)
    model = Transformer(args)
    sd = {k: v for k, v in random_state_dict(args, seed=seed % 1000).items() if not k.startswith("mtp.")}
    tok = 7
    row = sd["layers.0.ffn.gate.tid2eid"][tok].clone()
    row[1] = row[0]  # expert row[0] picked twice for token 7
    sd["layers.0.ffn.gate.tid2eid"][tok] = row
    model.load_weights(sd)
    ffn = model.layers[0].ffn
    assert ffn.gate.hash
    x = torch.randn(1, 1, args.dim) * X_SCALE
    ids = torch.tensor([[tok]])
    weights, picks = ffn.gate(x.reshape(1, -1), ids.reshape(-1))
    assert int(picks[0, 0]) == int(picks[0, 1]) == int(row[0])
    want = swiglu64(x[0], ffn.shared_experts, args.swiglu_limit)[0]
    per_slot = [swiglu64(x[0], ffn.experts[int(picks[0, j])], args.swiglu_limit, weights[0, j].view(1, 1))[0]
                for j in range(picks.shape[1])]
    atol = 1e-5 * float((want + sum(per_slot)).abs().max())
    assert_close(ffn(x, ids)[0, 0], want + sum(per_slot), "MoE output, repeated expert", rtol=1e-5, atol=atol)
    # negative control: the official single write (slot 1 lost) is visibly different
    with pytest.raises(AssertionError):
        assert_close(ffn(x, ids)[0, 0], want + sum(per_slot) - per_slot[1], "one write", rtol=1e-5, atol=atol)
