"""Tensor + expert parallel DeepSeek-V4 on torch.distributed (reference spec §11 "official convert.py").

Layout (the official `convert.py` sharding, world size W, rank r):
    dim 0 / W   embed.weight, head.weight (vocab rows r*V/W ..), attn.wq_b, attn.wo_a, attn.attn_sink
                (main heads r*h/W .., i.e. output groups r*G/W ..), attn.indexer.wq_b, attn.indexer.weights_proj
                (indexer heads r*H_I/W ..); FP8 `.scale`s follow their weight's rows (a 128-row block that
                spans two ranks is read by both)
    dim 1 / W   attn.wo_b (its input channels = the rank's output groups)
    expert      ffn.experts.E.* lives on rank E // (E_total / W) only
    replicated  everything else (wq_a, wkv, norms, compressors, gate, shared expert, hc_*)

Reductions (each an all-reduce SUM in fp32, or an all-gather):
    embed       each rank looks up its vocab rows, zeros elsewhere  -> all-reduce (exact: one non-zero term)
    attention   wo_b of the rank's groups gives a partial [b, s, d]  -> all-reduce before the bf16 cast
    indexer     per-rank partial scores over its heads             -> all-reduce BEFORE the top-k (spec §7.5)
    MoE         routed experts of the rank                         -> all-reduce, then + shared expert
    head        logits of the rank's vocab rows                    -> all-gather along V
Every rank ends a forward with the same full logits `[b, V]`, so greedy and seeded sampling agree across ranks
without a broadcast. World size 1 is the plain `dsv4.model.Transformer` (`build_model`).

No module-level mutable state: rank, world size and process group travel in a `Comm` argument. The process
group is created by the caller (`comm_from_env` under torchrun). The modules reuse the reference classes of
`dsv4.model` (same names, same maths) with local sizes; only the points above differ.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsv4 import quant
from dsv4.checkpoint import Source, open_for_load, open_source
from dsv4.config import ModelArgs, layers_from_env
from dsv4.formats import check_bf16_exact, check_dequantized_range, check_loaded_values, expected_tensors
from dsv4.launch import launch_from_env
from dsv4.model import (Attention, Block, Expert, Gate, Indexer, Linear, MoE, RMSNorm, Transformer, _Sim, gate_held,
                        held_bf16_names)
from dsv4.resident import WEIGHTS

__all__ = ["Comm", "comm_from_env", "leave_process_group", "attention_args", "shard_rule", "shard_tensor", "shard_state_dict",
           "expert_range", "check_quantized_split", "ParallelTransformer", "build_model", "read_plan",
           "load_rank_state_dict", "load_parallel_model", "load_distributed_model"]


# ----------------------------------------------------------------------------------------------- comm
@dataclass(frozen=True)
class Comm:
    """Who this process is in a tensor/expert-parallel model, and the only place collectives are called.

    rank in [0, world_size); `group` a torch.distributed ProcessGroup (None: the default group). With
    world_size 1 every collective is the identity and no process group is needed. The group is checked
    at the first collective: RuntimeError when torch.distributed is not initialised or its rank / world size
    differ from these.
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if not (isinstance(self.world_size, int) and self.world_size >= 1):
            raise ValueError(f"Comm.world_size={self.world_size!r}: expected an integer >= 1")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world_size):
            raise ValueError(f"Comm.rank={self.rank!r}: expected an integer in [0, {self.world_size})")

    def _check(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError(f"Comm(rank={self.rank}, world_size={self.world_size}): torch.distributed is not "
                               "initialised (launch with torchrun and call comm_from_env)")
        r, w = dist.get_rank(self.group), dist.get_world_size(self.group)
        if (r, w) != (self.rank, self.world_size):
            raise RuntimeError(f"Comm(rank={self.rank}, world_size={self.world_size}) does not match the process "
                               f"group (rank {r}, world size {w})")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over ranks in place and return it (identity at world size 1)."""
        if self.world_size > 1:
            self._check()
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's `t` (same shape on all ranks) along `dim`, rank order."""
        if self.world_size == 1:
            return t
        self._check()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim)


def comm_from_env(device: str = "cuda", environ: dict[str, str] | None = None) -> tuple[Comm, str]:
    """The torchrun launch: read RANK / WORLD_SIZE / LOCAL_RANK, initialise the default process group (NCCL for
    CUDA, gloo for CPU) and pick this rank's device. None of them set (or WORLD_SIZE=1): (Comm(), device).

    Returns (comm, device string, e.g. "cuda:3"). Raises `dsv4.launch.LaunchEnvError` (a ValueError) for a
    malformed or inconsistent variable (`dsv4.launch.launch_from_env`: the one place they are read), RuntimeError
    when a CUDA launch sees fewer GPUs than local ranks.
    """
    launch = launch_from_env(os.environ if environ is None else environ)
    if not launch.distributed:
        return Comm(), device
    ws, rank, local = launch.world_size, launch.rank, launch.local_rank
    if device.startswith("cuda"):
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} CUDA devices are visible")
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=rank, world_size=ws)
    return Comm(rank, ws), device


def leave_process_group() -> None:
    """Leave the default process group cleanly at the end of a torchrun process: barrier, then
    `destroy_process_group()`. A no-op when no group is initialised (world size 1).

    Every torchrun entry point of dsv4 (the CLI, the test and benchmark rank workers) ends with this: a gloo or
    NCCL group still open at interpreter exit has its communication threads destroyed while joinable, and the
    process may abort with "terminate called without an active exception" (SIGABRT) after its work is done; this
    failed the CPU world-size-2 tests in about half of the runs on a 2-core machine
    (tests/unit/test_parallel.py::test_every_torchrun_worker_leaves_the_process_group pins the rule).
    """
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- layout
def attention_args(args: ModelArgs, world_size: int) -> ModelArgs:
    """`args` with the per-rank attention sizes: n_heads / W, o_groups / W, index_n_heads / W.

    Raises ValueError naming the field when W does not divide n_heads, o_groups, index_n_heads,
    n_routed_experts or vocab_size (the official convert.py asserts the same).
    """
    for name in ("n_heads", "o_groups", "index_n_heads", "n_routed_experts", "vocab_size"):
        if getattr(args, name) % world_size:
            raise ValueError(f"ModelArgs.{name}={getattr(args, name)} is not divisible by world_size={world_size}")
    w = world_size
    return dataclasses.replace(args, n_heads=args.n_heads // w, o_groups=args.o_groups // w,
                               index_n_heads=args.index_n_heads // w)


def expert_range(args: ModelArgs, comm: Comm) -> range:
    """Global ids of the routed experts held by `comm.rank`: a contiguous E/W block."""
    n = args.n_routed_experts // comm.world_size
    return range(comm.rank * n, (comm.rank + 1) * n)


_DIM0 = re.compile(r"^(embed\.weight|head\.weight|.*\.attn\.(wq_b|wo_a|indexer\.wq_b)\.(weight|scale)"
                   r"|.*\.attn\.attn_sink|.*\.attn\.indexer\.weights_proj\.weight)$")
_DIM1 = re.compile(r"^.*\.attn\.wo_b\.(weight|scale)$")
_EXPERT = re.compile(r"^.*\.ffn\.experts\.(\d+)\.")


def shard_rule(name: str) -> tuple[str, int | None]:
    """How official tensor `name` is distributed: ("split", 0 | 1), ("expert", E) or ("replicated", None)."""
    if _DIM0.match(name):
        return "split", 0
    if _DIM1.match(name):
        return "split", 1
    m = _EXPERT.match(name)
    if m:
        return "expert", int(m.group(1))
    return "replicated", None


def _split_range(size: int, comm: Comm, name: str) -> tuple[int, int]:
    if size % comm.world_size:
        raise ValueError(f"{name}: dimension {size} is not divisible by world_size={comm.world_size}")
    n = size // comm.world_size
    return comm.rank * n, n


def check_quantized_split(args: ModelArgs, world_size: int) -> None:
    """Weights resident quantized (`weights="quantized"`): every split FP8 tensor must be cut on a 128-row /
    128-column block boundary, so that each rank holds whole 128x128 blocks and exactly their ue8m0 scales.

    Raises ValueError naming the first tensor, its split dimension and the world size when a rank's part
    (size / W) is not a multiple of 128. The published Flash and Pro shapes are aligned at W = 2, 4, 8.
    """
    if world_size == 1:
        return
    b = quant.FP8_BLOCK
    for name, (shape, dt) in expected_tensors(args).items():
        kind, dim = shard_rule(name)
        if kind == "split" and dt == "F8_E4M3" and (shape[dim] // world_size) % b:
            raise ValueError(f"{name}: weights='quantized' keeps FP8 {b}x{b} blocks whole, but world_size="
                             f"{world_size} splits its dim {dim} of {shape[dim]} into {shape[dim] // world_size} "
                             f"per rank, not a multiple of {b} (load it with weights='dequantized', or use a world "
                             f"size whose parts are multiples of {b})")


def shard_tensor(name: str, t: torch.Tensor, args: ModelArgs, comm: Comm) -> torch.Tensor | None:
    """This rank's part of the FULL-PRECISION official tensor `name` (a view), or None if the rank does not
    hold it (another rank's expert). Not for `.scale` tensors (blocks may span ranks: see `read_plan`)."""
    kind, arg = shard_rule(name)
    if kind == "expert":
        return t if arg in expert_range(args, comm) else None
    if kind == "split":
        start, n = _split_range(t.shape[arg], comm, name)
        return t.narrow(arg, start, n)
    return t


def shard_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs, comm: Comm) -> dict[str, torch.Tensor]:
    """The state dict of rank `comm.rank` from a full dequantized official-name one (no `.scale` entries)."""
    out = {}
    for k, v in sd.items():
        if k.endswith(".scale"):
            raise ValueError(f"{k}: shard_state_dict takes dequantized weights (no .scale); use load_rank_state_dict")
        part = shard_tensor(k, v, args, comm)
        if part is not None:
            out[k] = part.clone()
    return out


# ----------------------------------------------------------------------------------------------- modules
class VocabParallelEmbedding(nn.Module):
    """`embed` of rank r: weight `[V/W, d]` holding vocab rows r*V/W ..; lookups outside are zero, then summed
    over ranks. ids [b, s] int64 -> [b, s, d] in the weight dtype."""

    def __init__(self, vocab: int, dim: int, comm: Comm, dtype: torch.dtype):
        super().__init__()
        self.comm, self.start = comm, comm.rank * (vocab // comm.world_size)
        self.weight = nn.Parameter(torch.empty(vocab // comm.world_size, dim, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        y = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0)
        return self.comm.all_reduce(y)


class VocabParallelHead(Linear):
    """`head` of rank r: weight `[V/W, d]` (fp32, or bf16 as on disk with weights="quantized": `Linear` fmt
    "bf16"); x [b, s, d] -> all-gathered logits [b, s, V] fp32."""

    def __init__(self, dim: int, vocab: int, sim: _Sim, comm: Comm):
        super().__init__(dim, vocab // comm.world_size, sim, quantized=False, fp32=True)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(super().forward(x), -1)


class RowParallelLinear(Linear):
    """`wo_b` of rank r: weight `[d, G/W * o_lora]` (input channels of the rank's groups). The partial products
    are summed over ranks in fp32, then cast to x.dtype (one rounding, as at world size 1)."""

    def __init__(self, in_features: int, out_features: int, sim: _Sim, dtype: torch.dtype, comm: Comm):
        super().__init__(in_features, out_features, sim, quantized=True, dtype=dtype)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = self.sim.act(x)
        return self.comm.all_reduce(xq.float() @ self.dequantized_weight().float().T).to(x.dtype)


class ParallelIndexer(Indexer):
    """Indexer of rank r: its H_I/W heads. The head-weight scale uses the GLOBAL head count
    (d_I^-0.5 * H_I^-0.5) and the partial scores are summed over ranks before the top-k (spec §7.5)."""

    def __init__(self, local: ModelArgs, sim: _Sim, inv_freq: torch.Tensor, dtype: torch.dtype, comm: Comm,
                 total_heads: int):
        super().__init__(local, sim, inv_freq, dtype)
        self.comm, self.weight_scale = comm, self.head_dim ** -0.5 * total_heads ** -0.5

    def reduce_scores(self, scores: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(scores.float())


def parallel_attention(args: ModelArgs, layer_id: int, sim: _Sim, dtype: torch.dtype, comm: Comm) -> Attention:
    """The reference `Attention` at the rank's sizes (`attention_args`) with `wo_b` row-parallel and the indexer
    head-parallel; its forward is the reference one."""
    local = attention_args(args, comm.world_size)
    attn = Attention(local, layer_id, sim, dtype)
    attn.wo_b = RowParallelLinear(local.o_groups * local.o_lora_rank, args.dim, sim, dtype, comm)
    if attn.indexer is not None:
        attn.indexer = ParallelIndexer(local, sim, attn.inv_freq, dtype, comm, args.index_n_heads)
    return attn


class ParallelMoE(MoE):
    """MoE of rank r (spec §8): the replicated gate routes every token; the rank runs only its experts
    (`expert_range`; other slots of `experts` are None, so state-dict names keep the global expert id); the
    fp32 partial sums are all-reduced, then the (replicated) shared expert is added. x [b, s, d] -> same."""

    def __init__(self, args: ModelArgs, layer_id: int, sim: _Sim, dtype: torch.dtype, comm: Comm):
        nn.Module.__init__(self)
        self.comm, self.local = comm, expert_range(args, comm)
        self.gate = Gate(args, layer_id, gate_held(sim), sim.ops.fp32_linear, sim.ops.route)
        self.experts = nn.ModuleList(Expert(args.dim, args.moe_inter_dim, args.swiglu_limit, sim, dtype)
                                     if e in self.local else None for e in range(args.n_routed_experts))
        self.shared_experts = Expert(args.dim, args.n_shared_experts * args.moe_inter_dim, args.swiglu_limit,
                                     sim, dtype)
        self.routed = sim.ops.moe_routed  # the backend's `moe_routed` (as `MoE`)
        self.init_routed(args, sim)  # as `MoE`: limit, inter width, numerics; never stacked (experts are None)

    def reduce_routed(self, y: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(y)


class ParallelBlock(Block):
    """`Block` (forward inherited) whose attention and MoE are the rank's parallel versions. Built here, not by
    `Block.__init__`, so that no rank ever allocates another rank's experts."""

    def __init__(self, args: ModelArgs, layer_id: int, sim: _Sim, dtype: torch.dtype, comm: Comm):
        nn.Module.__init__(self)
        self.args, self.layer_id = args, layer_id
        self.attn_norm = RMSNorm(args.dim, args.norm_eps, sim)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, sim)
        self.attn = parallel_attention(args, layer_id, sim, dtype, comm)
        self.ffn = ParallelMoE(args, layer_id, sim, dtype, comm)
        n, hcd = (2 + args.hc_mult) * args.hc_mult, args.hc_mult * args.dim
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(n, hcd, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(n, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.zeros(3, dtype=torch.float32)))


class ParallelTransformer(Transformer):
    """Rank `comm.rank` of a W-way tensor + expert parallel DeepSeek-V4 (layout in the module docstring).

    Same interface as `Transformer` (forward, new_state, final_logits, load_weights with the rank's state dict
    from `load_rank_state_dict` / `shard_state_dict`); every rank must call forward with the same input_ids and
    gets the same full logits `[b, V]` fp32. The decode state (window ring, compressed entries) is replicated.

    Raises ValueError: unsupported dtype or backend, or W not dividing n_heads, o_groups, index_n_heads,
        n_routed_experts, vocab_size.
    """

    def __init__(self, args: ModelArgs, comm: Comm, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", backend: str = "reference", weights: str = "dequantized"):
        attention_args(args, comm.world_size)  # divisibility check, before any allocation
        if weights == "quantized":
            check_quantized_split(args, comm.world_size)
        self._comm = comm  # read by the factories below, which Transformer.__init__ calls
        super().__init__(args, dtype=dtype, device=device, backend=backend, weights=weights)
        self.comm = comm

    def _make_embed(self, args: ModelArgs, dtype: torch.dtype) -> nn.Module:
        return VocabParallelEmbedding(args.vocab_size, args.dim, self._comm, dtype)

    def _make_block(self, args: ModelArgs, layer_id: int, sim: _Sim, dtype: torch.dtype) -> nn.Module:
        return ParallelBlock(args, layer_id, sim, dtype, self._comm)

    def _make_head(self, args: ModelArgs, sim: _Sim) -> nn.Module:
        return VocabParallelHead(args.dim, args.vocab_size, sim, self._comm)


def build_model(args: ModelArgs, comm: Comm, *, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", backend: str = "reference",
                weights: str = "dequantized") -> Transformer:
    """`Transformer` at world size 1 (the plain model), else `ParallelTransformer` for `comm.rank`; `weights` as
    in `Transformer` (quantized needs `check_quantized_split`)."""
    if comm.world_size == 1:
        return Transformer(args, dtype=dtype, device=device, backend=backend, weights=weights)
    return ParallelTransformer(args, comm, dtype=dtype, device=device, backend=backend, weights=weights)


# ----------------------------------------------------------------------------------------------- loading
def read_plan(args: ModelArgs, comm: Comm, names: list[str]) -> dict[str, tuple[int, int, int] | None]:
    """What rank `comm.rank` reads of each official tensor: name -> (dim, start, length) for a split tensor,
    None for a whole one (every tensor at world size 1); another rank's experts are absent. Shapes come from
    `expected_tensors` (the on-disk [out, in] of FP8 weights; split tensors are never FP4). A split `.scale` (only with weights="quantized")
    gets the 128-blocks of its weight's part: (dim, start / 128, length / 128); ValueError naming the tensor and
    the world size when that part is not block-aligned (`check_quantized_split`)."""
    inv = expected_tensors(args, include_mtp=any(n.startswith("mtp.") for n in names))
    b = quant.FP8_BLOCK
    plan: dict[str, tuple[int, int, int] | None] = {}
    for name in names:
        kind, arg = shard_rule(name)
        if kind == "expert" and arg not in expert_range(args, comm):
            continue
        if kind == "split" and comm.world_size == 1:  # the whole tensor (no block alignment needed)
            plan[name] = None
        elif kind == "split" and name.endswith(".scale"):
            weight = name.removesuffix(".scale") + ".weight"
            start, n = _split_range(inv[weight][0][arg], comm, weight)
            if start % b or n % b:
                raise ValueError(f"{weight}: weights='quantized' keeps FP8 {b}x{b} blocks whole, but rank "
                                 f"{comm.rank} of world_size={comm.world_size} owns {start}..{start + n} of dim "
                                 f"{arg}, not {b}-block aligned")
            plan[name] = (arg, start // b, n // b)
        elif kind == "split":
            start, n = _split_range(inv[name][0][arg], comm, name)
            plan[name] = (arg, start, n)
        else:
            plan[name] = None
    return plan


def _open_for(path: str | Path | Source, comm: Comm, n_layers: int | None, weights: str):
    """(source, args, read plan) of rank `comm.rank`, validated (`dsv4.checkpoint.open_for_load`: the load path of
    every world size); `.scale` planned only for "quantized"."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}: expected one of {WEIGHTS}")
    src = path if isinstance(path, Source) else open_source(path)
    args = src.args if n_layers is None else src.args.with_layers(n_layers)
    attention_args(args, comm.world_size)
    src, args, names = open_for_load(src, n_layers=n_layers, quantized=weights == "quantized")
    if weights == "quantized":
        check_quantized_split(args, comm.world_size)
    return src, args, read_plan(args, comm, names)


def load_rank_state_dict(path: str | Path, comm: Comm, *, n_layers: int | None = None,
                         dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                         weights: str = "dequantized") -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Rank `comm.rank`'s state dict from a checkpoint directory, reading only what it owns (`read_plan`: its
    rows / columns of split tensors through safetensors slices, its experts, the replicated tensors).
    weights="dequantized": FP8/FP4 dequantized to `dtype`, no `.scale`; "quantized": codes + `.scale` as stored
    (the rank's whole 128-blocks). Validation and dtype rules are those of `dsv4.checkpoint.load_checkpoint`
    (main layers < n_layers, no MTP). Raises what `Checkpoint` / `Checkpoint.validate` raise, ValueError for an
    indivisible layout or (quantized) a split that is not 128-block aligned, CheckpointError for quantized on a
    bf16 checkpoint.
    """
    src, args, plan = _open_for(path, comm, n_layers, weights)
    raw = weights == "quantized"
    return args, {name: src.load(name, part, dtype=dtype, device=device, raw=raw) for name, part in plan.items()}


def load_parallel_model(path: str | Path, comm: Comm, *, n_layers: int | None = None,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        backend: str = "reference", weights: str = "dequantized") -> Transformer:
    """`build_model` + the rank's weights streamed into it one tensor at a time (peak host memory: one tensor).
    `weights` as in `Transformer` / `load_rank_state_dict`. Raises RuntimeError listing names the model and the
    read plan disagree on, or a stored code whose dtype differs from the model's buffer; ValueError for a value
    that is NaN / inf as loaded (the checks of `Transformer.load_weights`); plus what the loaders raise."""
    src, args, plan = _open_for(path, comm, n_layers, weights)
    model = build_model(args, comm, dtype=dtype, device=device, backend=backend, weights=weights)
    own = model.state_dict()
    if set(own) != set(plan):
        raise RuntimeError(f"rank {comm.rank}: model and read plan disagree: only in model "
                           f"{sorted(set(own) - set(plan))[:5]}, only in plan {sorted(set(plan) - set(own))[:5]}")
    raw = weights == "quantized"
    held_bf16 = held_bf16_names(model)
    with torch.no_grad():
        for name, part in plan.items():
            t = src.load(name, part, dtype=dtype if own[name].is_floating_point() else torch.float32,
                         device=device, raw=raw)
            if tuple(t.shape) != tuple(own[name].shape):
                raise RuntimeError(f"{name}: rank {comm.rank} read shape {tuple(t.shape)}, model has "
                                   f"{tuple(own[name].shape)}")
            if t.dtype in _TORCH_CODES and t.dtype != own[name].dtype:
                raise RuntimeError(f"{name}: rank {comm.rank} read {t.dtype}, model holds {own[name].dtype} "
                                   "(on-disk codes are never cast)")
            if name in held_bf16:
                check_bf16_exact(name, t)  # as `Transformer.load_weights`
            v = t.to(own[name].dtype)
            check_loaded_values(name, v, t, args.n_routed_experts)  # as `Transformer.load_weights`
            own[name].copy_(v)
        for mod_name, mod in model.named_modules():
            if isinstance(mod, Linear) and mod.fmt in ("fp8", "fp4"):
                check_dequantized_range(f"{mod_name}.weight", mod.codes, mod._buffers["scale"])
    return model.eval()


_TORCH_CODES = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8)


def load_distributed_model(ckpt: str | Path, comm: Comm, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                           backend: str = "reference", weights: str = "dequantized") -> tuple[Transformer, int]:
    """`dsv4.generate.load_model` for a torchrun launch: the rank's model honouring TEST_LAYERS; returns (model,
    effective main-layer count). At world size 1 this is the plain model loaded the same way. `weights` as in
    `Transformer`."""
    src = open_source(ckpt)
    n = layers_from_env(src.args.n_layers)
    return load_parallel_model(src, comm, n_layers=n, dtype=dtype, device=device, backend=backend,
                               weights=weights), n
