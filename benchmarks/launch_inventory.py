"""Launch inventory of one decode step, per layer kind, on the CPU (issue 27: launches per layer).

Runs one eager decode step of a small triton-backend model (every layer kind of Flash: sliding-window, CSA with
its indexer, HCA; bf16, weights="quantized", FP4 experts at widths that take the grouped kernel) under
TRITON_INTERPRET=1 and lists what a CUDA run would launch (`dsv4.testing.decode_launches`: every Triton kernel
launch and every aten op that launches). The count's shape, not the exact number `bench_model.py` measures with
the CUDA profiler; tests/unit/test_launch_budget.py holds the per-kind budget.

    TRITON_INTERPRET=1 python benchmarks/launch_inventory.py [--batch 1] [--verbose]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

KINDS = {0: "sliding", 4: "csa", 128: "hca"}


def inventory_model():
    """The small model of the inventory and of the launch budget test: layers of ratio 0 / 4 / 128 at widths that
    take every fast path (multiples of 128), bf16, weights="quantized", triton backend."""
    from dsv4.model import Transformer
    from dsv4.testing import fill_random_quantized_
    from dsv4.tiny import tiny_args

    args = tiny_args(vocab_size=256, dim=128, moe_inter_dim=128, q_lora_rank=128, head_dim=128, rope_head_dim=64,
                     o_lora_rank=128, index_head_dim=128, n_heads=4, o_groups=2, n_layers=3,
                     compress_ratios=(0, 4, 128, 0), n_hash_layers=0, window_size=8, index_topk=4)
    m = Transformer(args, dtype=torch.bfloat16, backend="triton", weights="quantized")
    fill_random_quantized_(m, seed=0)
    return m


def inventory(batch: int = 1, prefill: int = 9) -> tuple[dict, list]:
    """({layer kind: launches}, [(layer, kind of launch, name)]) of one eager decode step after a prefill."""
    from dsv4.testing import decode_launches
    m = inventory_model()
    st = m.new_state(batch, 256)
    m(torch.randint(0, m.args.vocab_size, (batch, prefill)), st)
    ops = decode_launches(m, torch.randint(0, m.args.vocab_size, (batch, 1)), st)
    kind = {layer.layer_id: KINDS[layer.attn.ratio] for layer in m.layers}
    per = collections.Counter(kind.get(li, "outside the blocks") for li, _, _ in ops)
    return dict(per), [(kind.get(li, "-"), t, n) for li, t, n in ops]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 (this tool runs the Triton kernels in the CPU interpreter)", file=sys.stderr)
        return 2
    per, ops = inventory(a.batch)
    if a.verbose:
        for kind in ("sliding", "csa", "hca"):
            print(f"== {kind}: {per.get(kind, 0)} launches, in order")
            for k, t, n in ops:
                if k == kind:
                    print(f"   {t}:{n}")
    print(per)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
