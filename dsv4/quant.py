"""Number formats of DeepSeek-V4 (reference spec §2) for the dsv4 package: a re-export of `kernels.numerics`.

The formats (ue8m0 scales, e4m3, e2m1 / FP4 packing, the FP8 / FP4 block sizes, the torch FP8 block
dequantization, the activation quantization simulations) are defined once, in `kernels.numerics`, the leaf module
that both the model and the kernels import (`kernels/` never imports `dsv4`). This module re-exports them under
their historical names, so `from dsv4 import quant; quant.fp4_dequant(...)` is the same function object.
"""

from __future__ import annotations

from kernels.numerics import (ACT_AMAX_FLOOR, E2M1_MAX, E2M1_VALUES, E4M3_MAX, FP4_AMAX_FLOOR, FP4_BLOCK,  # noqa: F401
                              FP8_BLOCK, act_quant, act_quant_sim, ceil_log2, e2m1_codes, e8m0_to_float,
                              float_to_e8m0, fp4_act_quant_sim, fp4_dequant, fp4_quant, fp8_block_dequant,
                              fp8_block_quant)

__all__ = ["E4M3_MAX", "E2M1_MAX", "E2M1_VALUES", "FP8_BLOCK", "FP4_BLOCK", "e8m0_to_float", "float_to_e8m0",
           "ceil_log2", "fp8_block_dequant", "fp8_block_quant", "fp4_dequant", "fp4_quant", "e2m1_codes",
           "act_quant", "act_quant_sim", "fp4_act_quant_sim"]
