"""Launch inventory of one decode step, per layer kind, on the CPU (issue 27: launches per layer).

Runs one eager decode step of a small triton-backend model (every layer kind of Flash: sliding-window, CSA with
its indexer, HCA; bf16, weights="quantized", FP4 experts at widths that take the grouped kernel) under
TRITON_INTERPRET=1 and lists what a CUDA run would launch: every Triton kernel launch and every torch op that
allocates or writes (a `TorchDispatchMode` sees each aten op; views and metadata ops launch nothing and are
skipped). On a GPU one aten op is one kernel for all the ops listed here except a few (`topk`, `sort`: 2-3),
so this is the count's shape, not the exact number `bench_model.py` measures with the CUDA profiler.

    TRITON_INTERPRET=1 python benchmarks/launch_inventory.py [--batch 1] [--verbose]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that launch nothing on a GPU (views, metadata, shape queries)
_FREE = {"view", "_unsafe_view", "reshape", "expand", "as_strided", "slice", "select", "unsqueeze", "squeeze",
         "permute", "transpose", "t", "detach", "alias", "unflatten", "flatten", "split", "split_with_sizes",
         "unbind", "narrow", "empty", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "sym_size",
         "sym_stride", "is_nonzero", "_local_scalar_dense", "item", "set_", "resize_", "view_as_real",
         "view_as_complex", "_reshape_alias", "diagonal", "numpy_T", "chunk", "contiguous_noop", "empty_like",
         "scalar_tensor"}


def _site() -> str:
    """file:line of the innermost dsv4/ or kernels/ frame that made the call (the launch's source)."""
    import traceback
    for fr in reversed(traceback.extract_stack()):
        if ("/dsv4/" in fr.filename or "/kernels/" in fr.filename) and "launch_inventory" not in fr.filename:
            return f"{fr.filename.split('/')[-2]}/{fr.filename.split('/')[-1]}:{fr.lineno}"
    return "?"


class _Ops(TorchDispatchMode):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in _FREE and not self.log.get("in_triton"):
            self.log["ops"].append(("aten", name, self.log["where"][-1] if self.log["where"] else "?", _site()))
        return func(*args, **(kwargs or {}))


def inventory(batch: int = 1, verbose: bool = False) -> dict:
    """{layer kind: launches} of one eager decode step (see the module docstring)."""
    import triton.runtime.interpreter as interp
    from dsv4.model import Transformer
    from dsv4.testing import fill_random_quantized_
    from dsv4.tiny import tiny_args

    args = tiny_args(vocab_size=256, dim=128, moe_inter_dim=128, q_lora_rank=128, head_dim=128, rope_head_dim=64,
                     o_lora_rank=128, index_head_dim=128, n_heads=4, o_groups=2, n_layers=3,
                     compress_ratios=(0, 4, 128, 0), n_hash_layers=0, window_size=8, index_topk=4)
    m = Transformer(args, dtype=torch.bfloat16, backend="triton", weights="quantized")
    fill_random_quantized_(m, seed=0)
    st = m.new_state(batch, 512)
    ids = torch.randint(0, args.vocab_size, (batch, 140))
    m(ids, st)
    log = {"ops": [], "where": []}
    orig = interp.InterpretedFunction.__call__ if hasattr(interp.InterpretedFunction, "__call__") else None
    orig_run = interp.InterpretedFunction.run

    def run(self, *a, **k):
        log["ops"].append(("triton", getattr(self.fn, "__name__", str(self.fn)),
                           log["where"][-1] if log["where"] else "?", _site()))
        log["in_triton"] = True
        try:
            return orig_run(self, *a, **k)
        finally:
            log["in_triton"] = False

    hooks = []
    for i, layer in enumerate(m.layers):
        kind = {0: "sliding", 4: "csa", 128: "hca"}[layer.attn.ratio]
        hooks.append(layer.register_forward_pre_hook(lambda mod, a, kind=kind: log["where"].append(kind)))
        hooks.append(layer.register_forward_hook(lambda mod, a, o: log["where"].append("between")))
    interp.InterpretedFunction.run = run
    try:
        tok = torch.randint(0, args.vocab_size, (batch, 1))
        with _Ops(log):
            # the layer loop's fused boundaries call `forward_deferred`, not `forward`: mark the layers by hand
            orig_fd = type(m.layers[0]).forward_deferred

            def fd(self, *a, **k):
                log["where"].append({0: "sliding", 4: "csa", 128: "hca"}[self.attn.ratio])
                try:
                    return orig_fd(self, *a, **k)
                finally:
                    log["where"].append("between")
            type(m.layers[0]).forward_deferred = fd
            try:
                m(tok, st)
            finally:
                type(m.layers[0]).forward_deferred = orig_fd
    finally:
        interp.InterpretedFunction.run = orig_run
        for h in hooks:
            h.remove()
    per = collections.Counter(w for _, _, w, _ in log["ops"])
    if verbose:
        for kind in ("sliding", "csa", "hca"):
            print(f"== {kind}: {per[kind]} launches, in order")
            for t, n, w, site in log["ops"]:
                if w == kind:
                    print(f"   {t}:{n:28s} {site}")
    return dict(per)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 (this tool runs the Triton kernels in the CPU interpreter)", file=sys.stderr)
        return 2
    print(inventory(a.batch, a.verbose))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
