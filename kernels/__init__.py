"""Triton kernels for DeepSeek-V4's hot paths. Each module holds `<op>_ref` (plain torch, the executable
spec), the `@triton.jit` kernel and its launcher, in that order (STYLE §1).

This top-level package is *not* HuggingFace's hub `kernels` library. transformers probes for that
library (`is_kernels_available`) and only accepts versions in [0.18.2, 0.19); `__version__` below and
the distribution version of dsv4 keep its probe false, which tests/unit/test_transformers_coexist.py
checks with transformers' DeepseekV4 running in the same process as these kernels.
"""

__version__ = "0.0.0+dsv4"
