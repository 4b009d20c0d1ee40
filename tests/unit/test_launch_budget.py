"""The launch budget of one triton decode step per layer kind (issue 27: launches per layer, the lever at batch 1).

Each kernel boundary of the CUDA-graph decode step costs ~3 µs on an H200 beyond the kernel's own work
(benchmarks/RESULTS.md, session of 2026-12-04), so the step's launches are budgeted: the count of one eager step of
the inventory model (`benchmarks/launch_inventory.py`: window-only, CSA and HCA layers at widths that take every
fast path), through `dsv4.testing.decode_launches` (Triton launches + aten ops that launch), must not exceed the
budget below - the count after the MoE decode kernels took over the act_quant of x and h (session of 2026-12-04
(2); 25 / 43 / 30 at 496c3d7). A change that adds a launch to the decode step raises the budget here, in
review, with its reason; one that removes launches lowers it. Not timed: a structural count. Negative control: the
same step on the reference backend (torch ops everywhere) is far over budget, so the counter sees launches.
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import launch_inventory as inv  # noqa: E402

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
# launches of one decode step at batch 1, per layer kind (94-98 per layer on the GPU before issue 27's fusions, 39-46
# at 496c3d7; the MoE gemv kernels' in-register act_quant: 2 fewer in every kind; attn_norm / ffn_norm inside the
# decode mHC launches: 2 fewer; the shared expert's SwiGLU in its GEMV's epilogue: 1 fewer; the shared output added
# by the routed slot sum: 1 fewer; each compressor's wkv and wgate as one GEMV: 2 / 1 fewer in CSA / HCA; the q and
# KV finish as one launch: 1 fewer; the key slots of window-only / HCA layers in that launch too: 1 fewer there; the
# attention output's de-rotation in the attention's epilogue: 1 fewer; the indexer query's RoPE inside its rotation
# launch: 1 fewer in CSA; its head-weight scale inside the scoring launch: 1 fewer in CSA; the CSA key slots written
# by the q / KV finish launch and the top-k: 1 fewer in CSA; then 6 MORE in every kind, measured faster: each of the
# two layer boundaries as hc_post + the two-launch hc_pre + its RMSNorm launch instead of the one fused
# `hc_post_pre` launch - on one H100 per site 16.7 -> ~13 µs at T 1, 19.9 -> ~14 at T 8 (in a CUDA graph), and the
# batch-1 step -7 µs per layer in an A/B in one call (benchmarks/RESULTS.md, fifth session of 2026-12-06;
# `kernels.mhc.POST_PRE_ONE_LAUNCH_MAX_T`)
BUDGET = {"sliding": 22, "csa": 36, "hca": 26}


@pytest.mark.slow
@pytest.mark.skipif(not INTERP, reason="counts the Triton launches through the interpreter (TRITON_INTERPRET=1)")
def test_decode_step_launches_within_budget():
    from dsv4.testing import decode_launches
    torch.manual_seed(0)
    m = inv.inventory_model()
    st = m.new_state(1, 256)
    m(torch.randint(0, m.args.vocab_size, (1, 9)), st)
    ops = decode_launches(m, torch.randint(0, m.args.vocab_size, (1, 1)), st)
    kind = {layer.layer_id: inv.KINDS[layer.attn.ratio] for layer in m.layers}
    per = collections.Counter(kind[li] for li, _, _ in ops if li in kind)
    assert set(per) == set(BUDGET), per
    over = {k: (per[k], BUDGET[k]) for k in BUDGET if per[k] > BUDGET[k]}
    assert not over, (f"decode-step launches over budget (count, budget) {over}; the step's launches, in order: "
                      + "; ".join(f"{kind.get(li, '-')}:{n}" for li, _, n in ops))
    # the only torch op left inside the blocks: the indexer's bf16 weights_proj (a cuBLAS GEMM: the triton
    # backend's bf16 linear), CSA layers only (its scale, spec §7.2, runs inside the scoring launch)
    torch_ops = [(kind[li], n) for li, t, n in ops if li in kind and t == "aten"]
    assert sorted(torch_ops) == [("csa", "mm")], f"torch ops inside the decode step: {torch_ops}"
    # negative control: the reference backend's step (the torch chains) counts far more launches per layer
    ref = type(m)(m.args, dtype=torch.bfloat16, backend="reference", weights="quantized")
    ref.load_weights(m.state_dict())
    rst = ref.new_state(1, 256)
    ref(torch.randint(0, m.args.vocab_size, (1, 9)), rst)
    rops = decode_launches(ref, torch.randint(0, m.args.vocab_size, (1, 1)), rst)
    rper = collections.Counter(kind[li] for li, _, _ in rops if li in kind)
    assert all(rper[k] > 2 * BUDGET[k] for k in BUDGET), rper
