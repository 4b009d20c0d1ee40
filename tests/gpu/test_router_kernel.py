"""The router after its logits (kernels/router.py) against `route_ref` on CUDA at Flash and Pro shapes.

Flash: E = 256, k = 6, route_scale 1.5; Pro: E = 384, k = 6, route_scale 2.5; N = 1 / 8 / 32 / 64 / 1000 rows;
each score function, score and hash rows, fp32 logits at the gate's real spread. Criterion: ids and weights
bitwise equal (kernels/router.py docstring: the fp64 scores rounded once, then one correctly rounded fp32 step at
a time in the same order; the GPU's libdevice fp64 exp / log against torch's CUDA fp64 exp / log1p). Also: exact
ties follow the rule (lower index), the launch captured in a CUDA graph replays to the same bits (no host sync),
and the triton backend's `Gate` calls it.

    pytest -q tests/gpu/test_router_kernel.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.hardstop,  # kernel vs reference on CUDA (issue 27)
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]

SHAPES = [("flash", 256, 6, 1.5), ("pro", 384, 6, 2.5)]


def _assert_bitwise(got, want, what):
    (w, ids), (w_ref, ids_ref) = got, want
    bad = (ids != ids_ref).any(-1).nonzero().flatten().tolist()
    assert not bad, f"{what}: ids differ in rows {bad[:8]}"
    diff = (w.view(torch.int32) != w_ref.view(torch.int32)).nonzero().tolist()
    assert not diff, f"{what}: weights differ bitwise at {diff[:8]} (max |d| {(w - w_ref).abs().max():.3e})"


@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("name,E,k,scale", SHAPES, ids=[s[0] for s in SHAPES])
def test_route_bitwise_on_cuda(name, E, k, scale, score_func):
    from kernels.router import route, route_ref
    g = torch.Generator(device="cuda").manual_seed(27)
    for N in (1, 8, 32, 64, 1000):
        logits = torch.randn(N, E, device="cuda", generator=g) * 4
        logits[0, : E // 3] -= 60.0   # the log1p-of-tiny-exp branch
        bias = torch.randn(E, device="cuda", generator=g) * 0.3
        _assert_bitwise(route(logits, bias, None, k, score_func, scale),
                        route_ref(logits, bias, None, k, score_func, scale), f"{name} {score_func} N={N} score")
        hid = torch.randint(0, E, (N, k), device="cuda", generator=g)
        _assert_bitwise(route(logits, None, hid, k, score_func, scale),
                        route_ref(logits, None, hid, k, score_func, scale), f"{name} {score_func} N={N} hash")


def test_route_ties_on_cuda():
    from kernels.router import route, route_ref
    from tests.unit.test_router_kernel import _rule, _tie_rows
    for sf in ("sqrtsoftplus", "sigmoid", "softmax"):
        logits, bias = _tie_rows(256, sf)
        logits, bias = logits.cuda(), bias.cuda()
        want = route_ref(logits, bias, None, 6, sf, 1.5)
        assert want[1].tolist() == _rule(logits.cpu(), bias.cpu(), sf, 6), sf
        _assert_bitwise(route(logits, bias, None, 6, sf, 1.5), want, f"ties {sf}")


def test_route_graph_capture_replays_the_same_bits():
    from kernels.router import route
    logits = torch.randn(8, 256, device="cuda") * 4
    bias = torch.randn(256, device="cuda") * 0.3
    eager = route(logits, bias, None, 6, "sqrtsoftplus", 1.5)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        route(logits, bias, None, 6, "sqrtsoftplus", 1.5)  # warm-up (compile) outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = route(logits, bias, None, 6, "sqrtsoftplus", 1.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[1], eager[1]) and torch.equal(out[0], eager[0])


def test_triton_gate_uses_the_kernel_and_matches_reference():
    from dsv4.model import Transformer
    from dsv4.tiny import random_state_dict, tiny_args
    from kernels import router
    args = tiny_args(vocab_size=512)
    sd = {k: v for k, v in random_state_dict(args, seed=21).items() if not k.startswith("mtp.")}
    ref, tri = Transformer(args, device="cuda"), Transformer(args, device="cuda", backend="triton")
    ref.load_weights(sd)
    tri.load_weights(sd)
    x, ids = torch.randn(5, args.dim, device="cuda") * 2, torch.randint(0, 512, (5,), device="cuda")
    for layer in (0, 1):
        gate = tri.layers[layer].ffn.gate
        assert gate.route is router.route
        got, want = gate(x, ids), ref.layers[layer].ffn.gate(x, ids)
        _assert_bitwise(got, want, f"layer {layer}")
