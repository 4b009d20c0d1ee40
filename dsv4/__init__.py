"""dsv4: DeepSeek-V4 (Flash and Pro) inference people can trust.

A readable PyTorch reference of the official model (`dsv4.model`), the official prompt format
(`dsv4.encoding`), the official checkpoint format (`dsv4.checkpoint`), Triton kernels for the hot paths
(`kernels/`), and the decisive diagnostics behind the merge gate (`dsv4.diagnose`, `dsv4.gate`).
"""

__version__ = "0.1.0"
