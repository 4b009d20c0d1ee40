"""Tensor + expert parallel model (dsv4.parallel) on CPU: world size 2 (gloo, launched by torchrun) against
world size 1, the rank loader against the full loader, and the sharding table.

Tolerance for world-size-2 vs world-size-1 fp32 logits (magnitude ~4): atol 2e-5, rtol 1e-5. The two runs do
the same maths; only the summation order differs where partial sums meet (wo_b over groups, indexer scores over
heads, MoE over experts), which is O(1e-7) relative per reduction through 4 blocks (measured max |diff| ~2e-6).
Ranks must agree bitwise (all-reduce / all-gather hand every rank the same tensor).

This file is also the rank worker: `torchrun --nproc_per_node 2 tests/unit/test_parallel.py OUT CKPT`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dsv4.checkpoint import expected_tensors, load_checkpoint
from dsv4.config import ModelArgs
from dsv4.model import Transformer
from dsv4.parallel import (Comm, ParallelTransformer, attention_args, build_model, comm_from_env,
                           load_parallel_model, load_rank_state_dict, read_plan, shard_rule, shard_state_dict)
from dsv4.testing import greedy_logits, torchrun_workers, assert_close, assert_equal, save_rank_result
from dsv4.tiny import random_state_dict, tiny_args

pytestmark = pytest.mark.hardstop  # tensor/expert parallel model equals world size 1

VOCAB, SEED, PROMPT_LEN, DECODE = 512, 3, 40, 3  # 40 tokens: 10 CSA entries > index_topk 4, window 8 wrapped
ATOL, RTOL = 2e-5, 1e-5  # see module docstring
CKPT_PROMPT = [0, 128803, 3085, 344, 270, 6102, 294, 8760, 33, 128804, 128821]
ROOT = Path(__file__).resolve().parents[2]


def _small():
    args = tiny_args(vocab_size=VOCAB)
    sd = {k: v for k, v in random_state_dict(args, seed=SEED).items() if not k.startswith("mtp.")}
    ids = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(SEED))
    return args, sd, ids


def _run(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Prefill logits at every position, then DECODE greedy steps' logits."""
    return greedy_logits(model, ids, DECODE)


def _worker(out: str, ckpt: str) -> None:
    """One rank: the random-weight run, the checkpoint run and the final-norm check, saved to OUT.<rank>."""
    from dsv4.final_norm import final_norm_check

    torch.set_num_threads(1)
    comm, dev = comm_from_env("cpu")
    args, sd, ids = _small()
    m = build_model(args, comm)
    m.load_weights(shard_state_dict(sd, args, comm))
    res = {"type": type(m).__name__, "small": _run(m, ids)}
    m = load_parallel_model(ckpt, comm)
    res["ckpt"] = _run(m, torch.tensor([CKPT_PROMPT]))
    res["final_norm"] = final_norm_check(m, CKPT_PROMPT, decode_steps=2).to_dict()
    save_rank_result(res, out, comm.rank)


@pytest.fixture(scope="module")
def world2(tmp_path_factory, tiny_ckpt):
    return torchrun_workers(__file__, tmp_path_factory.mktemp("par"), tiny_ckpt, cwd=ROOT)


@pytest.fixture(scope="module")
def world1(tiny_ckpt):
    from dsv4.generate import load_model

    args, sd, ids = _small()
    m = Transformer(args)
    m.load_weights(sd)
    ck, _ = load_model(tiny_ckpt, progress=False)
    return {"small": _run(m, ids), "ckpt": _run(ck, torch.tensor([CKPT_PROMPT])), "model": m, "ids": ids}


@pytest.mark.parametrize("run", ["small", "ckpt"])
def test_world2_logits_equal_world1(world1, world2, run):
    assert all(w["type"] == "ParallelTransformer" for w in world2)
    for step, (ref, got) in enumerate(zip(world1[run], world2[0][run])):
        assert ref.abs().max() > 1.0, "degenerate logits would make the comparison meaningless"
        assert_close(got, ref, f"{run} logits step {step}", atol=ATOL, rtol=RTOL)
        assert torch.equal(got.argmax(-1), ref.argmax(-1)), f"{run}: greedy token differs at step {step}"
        assert_equal(world2[1][run][step], got, f"{run} rank 1 vs rank 0 logits step {step}")


def test_both_routings_and_both_expert_halves_are_exercised(world1):
    """Layer 0 is hash-routed, layers 1-3 score-routed, and each layer sends tokens to experts of both ranks."""
    m, seen = world1["model"], {}
    hooks = [layer.ffn.gate.register_forward_hook(lambda mod, a, o, i=i: seen.setdefault(i, []).append(o[1]))
             for i, layer in enumerate(m.layers)]
    try:
        m(world1["ids"], m.new_state(1))
    finally:
        for h in hooks:
            h.remove()
    assert [layer.ffn.gate.hash for layer in m.layers] == [True, False, False, False]
    for i, ids in seen.items():
        ids = torch.cat(ids).flatten()
        assert (ids < 4).any() and (ids >= 4).any(), f"layer {i} routes to one rank's experts only"


def test_final_norm_check_runs_distributed(world2):
    for rank, w in enumerate(world2):
        r = w["final_norm"]
        assert r["passed"], (rank, r["verdict"], r["chain_problems"])
        assert r["chain_ok"] and r["logits_match_model"] and r["norm_calls"] == 3
    assert world2[0]["final_norm"]["comparisons"] == world2[1]["final_norm"]["comparisons"]


class _NoReduction(Comm):
    """A rank that skips the sums (negative control): all-gather repeats its own part."""

    def all_reduce(self, t):
        return t

    def all_gather(self, t, dim):
        return torch.cat([t] * self.world_size, dim)


def test_negative_missing_reductions_are_caught(world1):
    args, sd, ids = _small()
    m = ParallelTransformer(args, _NoReduction(0, 2))
    m.load_weights(shard_state_dict(sd, args, Comm(0, 2)))
    got = m(ids, m.new_state(1), all_logits=True)
    with pytest.raises(AssertionError, match="outside"):
        assert_close(got, world1["small"][0], "no-reduction logits", atol=ATOL, rtol=RTOL)


def test_world_size_1_is_the_plain_model_and_parallel_class_agrees(world1):
    args, sd, ids = _small()
    assert type(build_model(args, Comm())) is Transformer
    m = ParallelTransformer(args, Comm())
    m.load_weights(sd)
    assert_equal(m(ids, m.new_state(1), all_logits=True), world1["small"][0], "ParallelTransformer(W=1) logits")
    idx = ParallelTransformer(args, Comm(1, 2)).layers[1].attn.indexer  # 2 of the 4 indexer heads
    assert idx.n_heads == 2 and idx.weight_scale == args.index_head_dim ** -0.5 * 4 ** -0.5  # global head count


def test_load_parallel_model_at_world_size_1_is_the_plain_loaded_model(tiny_ckpt):
    from dsv4.generate import load_model

    m = load_parallel_model(tiny_ckpt, Comm())
    ref, _ = load_model(tiny_ckpt, progress=False)
    assert type(m) is Transformer
    for k, v in ref.state_dict().items():
        assert_equal(m.state_dict()[k], v, k)


def test_rank_loader_reads_exactly_its_part(tiny_ckpt):
    """Rank slices equal the full loader's tensors sliced (exact: FP8 blocks that span ranks included: the tiny
    indexer wq_b has 64 rows per rank, wo_a 32 rows, wo_b 32 columns, all inside one 128-block)."""
    args, full = load_checkpoint(tiny_ckpt, progress=False)
    parts = [load_rank_state_dict(tiny_ckpt, Comm(r, 2))[1] for r in range(2)]
    for r, sd in enumerate(parts):
        ref = shard_state_dict(full, args, Comm(r, 2))
        assert sorted(sd) == sorted(ref)
        for k in sd:
            assert_equal(sd[k], ref[k], f"rank {r} {k}")
    for k in ("layers.1.attn.indexer.wq_b.weight", "layers.1.attn.wo_b.weight", "head.weight"):
        dim = shard_rule(k)[1]
        assert_equal(torch.cat([p[k] for p in parts], dim), full[k], f"{k} reassembled")
    e0 = {k for k in parts[0] if ".experts." in k}
    e1 = {k for k in parts[1] if ".experts." in k}
    assert e0.isdisjoint(e1) and len(e0 | e1) == len([k for k in full if ".experts." in k])
    assert "layers.0.ffn.experts.3.w1.weight" in e0 and "layers.0.ffn.experts.4.w1.weight" in e1


def test_shard_rule_on_the_flash_inventory():
    args = ModelArgs.from_hf_config(ROOT / "fixtures/configs/deepseek_v4_flash.config.json")
    names = [n for n in expected_tensors(args, include_mtp=True) if not n.endswith(".scale")]
    kinds = {n: shard_rule(n) for n in names}
    assert {n for n, k in kinds.items() if k == ("split", 0) and n.startswith("layers.2.")} == {
        f"layers.2.attn.{t}" for t in ("wq_b.weight", "wo_a.weight", "attn_sink", "indexer.wq_b.weight",
                                       "indexer.weights_proj.weight")}
    assert kinds["embed.weight"] == kinds["head.weight"] == ("split", 0)
    assert kinds["layers.5.attn.wo_b.weight"] == ("split", 1) and shard_rule("layers.5.attn.wo_b.scale")[1] == 1
    assert kinds["layers.7.ffn.experts.200.w2.weight"] == ("expert", 200)
    for n in ("layers.0.ffn.shared_experts.w1.weight", "layers.0.ffn.gate.tid2eid", "layers.3.attn.wq_a.weight",
              "layers.3.attn.compressor.wkv.weight", "layers.2.attn.indexer.compressor.wgate.weight", "norm.weight"):
        assert kinds[n] == ("replicated", None), n
    plans = [read_plan(args.with_layers(2), Comm(r, 8), [n for n in names if n.startswith("layers.0.")])
             for r in range(8)]
    assert plans[3]["layers.0.attn.wq_b.weight"] == (0, 3 * 4096, 4096)
    assert plans[7]["layers.0.attn.wo_b.weight"] == (1, 7 * 1024, 1024)
    assert sum(len([k for k in p if ".experts." in k]) for p in plans) == 256 * 3
    assert "layers.0.ffn.experts.31.w1.weight" in plans[0] and "layers.0.ffn.experts.32.w1.weight" not in plans[0]


def _workers_left_open(root: Path) -> list[str]:
    """Files under tests/ and benchmarks/ (and dsv4/cli.py) that join a process group (`comm_from_env(`) but
    never leave it (`leave_process_group` / `save_rank_result` / the CLI's `_close_process_group`)."""
    files = [*root.glob("tests/**/*.py"), *root.glob("benchmarks/**/*.py"), root / "dsv4/cli.py"]
    leave = ("leave_process_group()", "save_rank_result(", "_close_process_group()")
    open_ = []
    for f in files:
        src = f.read_text()
        calls = [ln for ln in src.splitlines() if "comm_from_env(" in ln and "def comm_from_env" not in ln
                 and "comm_from_env(\"cpu\", {" not in ln]  # the env-dict calls never join a group
        if calls and not any(x in src for x in leave):
            open_.append(str(f.relative_to(root)))
    return open_


def test_every_torchrun_worker_leaves_the_process_group(tmp_path):
    """A rank worker that exits with its gloo/NCCL group open can abort at interpreter exit after its work is
    done (SIGABRT, "terminate called without an active exception"): the CPU world-size-2 tests failed that way
    in about half of the runs on CI's 2 cores. Every entry point that joins a group must leave it."""
    assert _workers_left_open(ROOT) == []
    # negative case: the scan sees a worker that joins and never leaves
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/w.py").write_text('comm, dev = comm_from_env("cpu")\ntorch.save(res, out)\n')
    (tmp_path / "dsv4").mkdir()
    (tmp_path / "dsv4/cli.py").write_text("_close_process_group()\n")
    assert _workers_left_open(tmp_path) == ["tests/w.py"]


def test_errors():
    with pytest.raises(ValueError, match=r"ModelArgs.n_heads=4 is not divisible by world_size=3"):
        attention_args(tiny_args(vocab_size=VOCAB), 3)
    with pytest.raises(ValueError, match=r"Comm.rank=2: expected an integer in \[0, 2\)"):
        Comm(2, 2)
    with pytest.raises(ValueError, match=r"\$RANK='x'"):
        comm_from_env("cpu", {"WORLD_SIZE": "2", "RANK": "x", "LOCAL_RANK": "0"})
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        Comm(0, 2).all_reduce(torch.ones(2))
    assert comm_from_env("cpu", {}) == (Comm(), "cpu")


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])


class _PeerComm:
    """Stand-in for the world-size-2 all-reduce of one rank: records the partial it is given (`record`) or adds
    the recorded peer partial to it in the partial's own dtype, as NCCL / gloo sum in the tensor's dtype."""

    def __init__(self, peer: torch.Tensor | None = None):
        self.peer, self.seen = peer, None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.seen = t
        return t if self.peer is None else t + self.peer.to(t.dtype)


@torch.no_grad()
def test_row_parallel_partials_are_summed_before_the_bf16_rounding(seed):
    """wo_b at world size 2 in bf16: the two ranks' partial products are summed in fp32 and rounded once, as at
    world size 1 (`RowParallelLinear`). Edge values: each rank's partial is +-256 * s plus a small term, so the
    sum is the small terms alone; a rank that rounded its partial to bf16 before the all-reduce (2^-9 relative,
    i.e. 0.5 at 256) would lose them. Every value is a power of two or a bf16 number, so the fp32 sum is exact and
    the expected output is one bf16 rounding of it (bitwise)."""
    from dsv4.model import _Sim
    from dsv4.parallel import RowParallelLinear

    g = torch.Generator().manual_seed(seed)
    out = 8
    s = 2.0 ** torch.randint(-2, 3, (3, 1), generator=g).float()             # shared channel scale per token
    t, u = (2.0 ** torch.randint(-2, 3, (3, 1), generator=g).float() for _ in range(2))
    delta, eta = ((torch.rand(out, generator=g) * 0.5 + 0.01).bfloat16().float() for _ in range(2))
    w = [torch.stack([torch.full((out,), 256.0), delta], 1), torch.stack([torch.full((out,), -256.0), eta], 1)]
    x = [torch.cat([s, t], 1).bfloat16(), torch.cat([s, u], 1).bfloat16()]
    lins = []
    for r in range(2):
        lin = RowParallelLinear(2, out, _Sim(False), torch.bfloat16, Comm(r, 2))
        lin.weight.copy_(w[r])
        lins.append(lin)
    lins[1].comm = _PeerComm()
    lins[1](x[1])
    assert lins[1].comm.seen.dtype == torch.float32, "a rank's partial must reach the all-reduce in fp32"
    lins[0].comm = _PeerComm(peer=lins[1].comm.seen)
    got = lins[0](x[0])
    want = (t * delta + u * eta).bfloat16()  # exact in fp32: the +-256 s terms cancel
    assert got.dtype == torch.bfloat16
    assert_equal(got, want, "world-2 wo_b output")
    # negative control: partials rounded to bf16 before the sum lose the small terms
    rounded = (256 * s + t * delta).bfloat16() + (-256 * s + u * eta).bfloat16()
    assert not torch.equal(rounded.bfloat16(), want)
