"""Per-rank memory plan (dsv4.memory_plan) against real models and published totals; docs/multi_gpu.md in sync."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch

from dsv4.checkpoint import expected_tensors
from dsv4.config import ModelArgs
from dsv4.memory_plan import GiB, memory_table, rank_memory, state_bytes
from dsv4.model import Transformer
from dsv4.parallel import Comm, ParallelTransformer
from dsv4.tiny import random_state_dict, tiny_args

ROOT = Path(__file__).resolve().parents[2]


def _args(name: str) -> ModelArgs:
    return ModelArgs.from_hf_config(ROOT / f"fixtures/configs/deepseek_v4_{name}.config.json")


def _bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_bf16_plan_equals_what_the_models_hold():
    args = tiny_args()
    assert rank_memory(args, 1, 0, "bf16").weights == _bytes(Transformer(args, dtype=torch.bfloat16))
    for r in range(2):
        m = ParallelTransformer(args, Comm(r, 2), dtype=torch.bfloat16)
        assert rank_memory(args, 2, r, "bf16").weights == _bytes(m), f"rank {r}"


def test_flash_quantized_experts_match_the_published_total():
    """Spec §11: Flash routed experts are 147.17 GB on disk; in the quantized plan they stay as on disk."""
    plan = rank_memory(_args("flash"), 1, 0, "quantized")
    assert plan.experts == pytest.approx(147.17e9, abs=0.006e9)
    assert rank_memory(_args("flash"), 1, 0, "bf16").weights / 1e9 == pytest.approx(570.5, abs=0.5)  # issue: ~570 GB


@pytest.mark.parametrize("name", ["flash", "pro"])
def test_quantized_plan_holds_the_fp32_linears_bf16(name):
    """"quantized": head, router gate, compressor wkv / wgate at 2 B (as on disk) instead of the bf16 plan's 4 B;
    the temp is the reference path's fp32 upcast of the head shard, [V/W, dim] x 4 B, where that is the largest."""
    a = _args(name)
    inv = expected_tensors(a)
    fp32_lin = sum(math.prod(shape) for n, (shape, dt) in inv.items() if not n.startswith("mtp.")
                   and n.endswith(("head.weight", ".ffn.gate.weight", ".compressor.wkv.weight",
                                   ".compressor.wgate.weight")))
    head = a.vocab_size * a.dim
    for w in (1, 8):
        q, b = rank_memory(a, w, inventory=inv), rank_memory(a, w, 0, "bf16", inventory=inv)
        f32_q = q.by_dtype["F32"]
        assert b.by_dtype["F32"] - f32_q == 4 * (fp32_lin - head) + 4 * head // w
        assert q.dequant_temp == 4 * head // w


@pytest.mark.parametrize("name", ["flash", "pro"])
def test_sharding_divides_split_and_expert_bytes(name):
    a = _args(name)
    inv = expected_tensors(a)
    one, eight = rank_memory(a, 1, inventory=inv), rank_memory(a, 8, inventory=inv)
    assert eight.experts * 8 == one.experts and eight.split * 8 == one.split
    assert eight.replicated == one.replicated
    assert rank_memory(a, 8, 7, inventory=inv).weights == eight.weights


def test_state_bytes_equal_a_real_decode_state():
    args = tiny_args(vocab_size=512)
    m = Transformer(args)
    m.load_weights({k: v for k, v in random_state_dict(args, seed=1).items() if not k.startswith("mtp.")})
    st = m.new_state(1)
    m(torch.randint(1, 512, (1, 21)), st)

    def nbytes(o) -> int:
        if isinstance(o, torch.Tensor):
            return o.numel() * o.element_size()
        if dataclasses.is_dataclass(o):
            return sum(nbytes(getattr(o, f.name)) for f in dataclasses.fields(o))
        return sum(nbytes(x) for x in o) if isinstance(o, list) else 0

    assert st.max_len == 128  # a growable state: the first multiple of 128 holding the prompt (dsv4.model)
    # the state's bytes are its layers' buffers (pos_buf, the positions, is not state: 8 bytes per row)
    assert state_bytes(args, st.max_len, dtype_bytes=4) == nbytes(st.layers) > 0


def test_docs_table_is_the_computed_one():
    text = (ROOT / "docs/multi_gpu.md").read_text()
    rows = re.findall(r"^\| (Flash|Pro) \| (bf16|quantized) \| (\d) \| ([\d.]+) \|.*\| ([\d.]+) \|$", text, re.M)
    want = {(n, m.resident, m.world_size): (m.weights / GiB, m.peak / GiB)
            for n in ("Flash", "Pro") for m in memory_table(_args(n.lower()))}
    assert len(rows) == len(want) == 16
    for n, plan, w, weights, peak in rows:
        exp = want[(n, plan, int(w))]
        assert (float(weights), float(peak)) == pytest.approx(exp, abs=0.005), (n, plan, w)


def test_errors():
    with pytest.raises(ValueError, match="resident='fp16'"):
        rank_memory(tiny_args(), 1, 0, "fp16")
    with pytest.raises(ValueError, match="n_routed_experts=256 is not divisible by world_size=3|n_heads"):
        rank_memory(_args("flash"), 3)
    with pytest.raises(ValueError, match="seq_len=-1"):
        state_bytes(tiny_args(), -1)


def test_load_bytes_count_the_mtp_block_when_it_is_loaded():
    """`load_model(..., mtp=True)` loads mtp.0: the plan counts exactly its inventory bytes (spec §11: Flash's MTP
    block is 1,575 tensors, ~3.59 GB on disk), in both weight modes."""
    from dsv4.formats import expected_tensors, inventory_bytes
    from dsv4.memory_plan import load_bytes
    a = _args("flash")
    mtp_disk = inventory_bytes(expected_tensors(a, include_mtp=True)) - inventory_bytes(expected_tensors(a))
    assert 3.5e9 < mtp_disk < 3.7e9
    q0 = load_bytes(a, a.n_layers, dtype_bytes=2, weights="quantized")
    q1 = load_bytes(a, a.n_layers, dtype_bytes=2, weights="quantized", include_mtp=True)
    assert q1 - q0 >= mtp_disk  # + the per-use dequantization temporary where the MTP's is the largest
    d0 = load_bytes(a, 2, dtype_bytes=2, weights="dequantized")
    d1 = load_bytes(a, 2, dtype_bytes=2, weights="dequantized", include_mtp=True)
    assert d1 > d0 + mtp_disk
