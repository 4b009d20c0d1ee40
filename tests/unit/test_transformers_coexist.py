"""Our top-level `kernels` package must not be mistaken by transformers for HuggingFace's hub `kernels`
library (transformers probes it with `is_kernels_available`); both run in one process."""

from __future__ import annotations

import torch


def test_transformers_deepseek_v4_runs_beside_our_kernels():
    import kernels.attention  # noqa: F401  (our Triton kernels, imported first)
    import kernels.mhc  # noqa: F401
    from transformers.utils.import_utils import is_kernels_available

    from dsv4.hf_adapter import build_hf_model
    from dsv4.tiny import random_state_dict, tiny_args

    assert not is_kernels_available(), "transformers would try to load hub kernels from our package"
    args = tiny_args(vocab_size=128, n_layers=2, compress_ratios=(0, 4, 0))
    sd = {k: v for k, v in random_state_dict(args, seed=5).items() if not k.startswith("mtp.")}
    hf = build_hf_model(args, sd)
    logits = hf(torch.randint(0, 128, (1, 9))).logits
    assert logits.shape == (1, 9, 128) and torch.isfinite(logits).all()
