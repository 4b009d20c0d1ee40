#!/bin/bash
# GPU correctness of the kernels this session changed (issue 27): the unit tests of the GEMV / MoE / quant / norm /
# rope / indexer kernels run on CUDA, and the GPU suite's gemm / moe / model-backend files.
timeout ${1:-280} python3 -m pytest -n 4 -q -p no:cacheprovider tests/unit/test_gemm_moe_kernels.py \
  tests/unit/test_quant_kernels.py tests/unit/test_norm_kernel.py tests/unit/test_rope_kernel.py \
  tests/unit/test_mhc_kernels.py tests/gpu/test_mhc_kernels.py \
  tests/gpu/test_gemm_moe_kernels.py tests/gpu/test_model_backends.py tests/gpu/test_graph_decode.py \
  tests/gpu/test_batch_invariant.py -k "not real" 2>&1 | tail -${2:-12}
