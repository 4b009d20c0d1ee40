"""Per-rank GPU memory of the tensor + expert parallel model (dsv4.parallel), computed from the tensor inventory.

Two residency plans (bytes per tensor; "logical" = the dequantized [out, in] element count):
    "bf16"       what `ParallelTransformer(dtype=torch.bfloat16)` holds today: every FP8/FP4 linear dequantized to
                 bf16 (2 B/element), the fp32-compute linears (head, router gate, compressor wkv/wgate) and all
                 norms, hc_*, attn_sink, ape, gate.bias in fp32 (4 B), embed bf16, tid2eid int64, no scales.
    "quantized"  weights kept in their on-disk precision (FP8 e4m3 1 B + ue8m0 scale per 128x128 block; FP4 0.5 B +
                 ue8m0 per 32), dequantized per use; attn.wo_a FP8 too (the official convert.py dequantizes it at convert time; we keep the on-disk codes);
                 the fp32-compute linears (head, router gate, compressor wkv/wgate) BF16 as on disk (2 B), computed
                 in fp32; everything else as in "bf16". Adds a transient `dequant_temp`: the largest per-use
                 temporary of the reference path, i.e. the max of a bf16 dequantization of an FP8/FP4 weight
                 (2 B/element) and the fp32 upcast of a bf16-held fp32 linear (4 B/element; for Flash/Pro the head's
                 [V/W, dim] x 4 B dominates). The triton backend's decode (M <= 64 rows, `kernels.fp32_linear`)
                 reads the bf16 head / router / compressor weights directly and makes no such upcast.
Distribution (dsv4.parallel.shard_rule): split tensors / W, routed experts E / W per rank, the rest replicated.
MTP blocks are not counted (the model never runs them) unless `include_mtp`. The decode state (`state_bytes`) is
replicated on every rank and comes on top, as do activations (a prefill of s tokens needs O(s * hc * d)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dsv4.checkpoint import DTYPE_BYTES, expected_tensors
from dsv4.config import LimitError, ModelArgs
from dsv4.parallel import Comm, attention_args, expert_range, shard_rule

__all__ = ["RankMemory", "rank_memory", "state_bytes", "memory_table", "RESIDENCY", "GiB", "DeviceMemoryError",
           "available_bytes", "load_bytes", "check_fits", "MAX_BATCH", "LimitError", "ServingPlan", "max_context",
           "check_serving", "max_new_tokens", "check_context"]

RESIDENCY = ("bf16", "quantized")
GiB = 2 ** 30
_FP32_LINEARS = ("head.weight", ".ffn.gate.weight", ".compressor.wkv.weight", ".compressor.wgate.weight")


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds: `weights` in all, split into `replicated`, `split` (vocab / head shards) and `experts`;
    `dequant_temp` the largest per-use temporary ("quantized" only, else 0; the module docstring says which);
    `peak` = weights + temp."""

    world_size: int
    rank: int
    resident: str
    replicated: int
    split: int
    experts: int
    dequant_temp: int
    by_dtype: dict[str, int] = field(default_factory=dict)

    @property
    def weights(self) -> int:
        return self.replicated + self.split + self.experts

    @property
    def peak(self) -> int:
        return self.weights + self.dequant_temp


def _logical(name: str, shape: tuple[int, ...], dt: str) -> int:
    """Dequantized element count of an on-disk tensor (FP4 I8 [out, in/2] holds out*in elements)."""
    return math.prod(shape) * (2 if dt == "I8" else 1)


def _resident(name: str, shape: tuple[int, ...], dt: str, resident: str) -> tuple[int, str]:
    """(bytes, held dtype) of one tensor under a plan; `.scale` tensors cost 0 in the bf16 plan."""
    quantized = dt in ("F8_E4M3", "I8")
    if name.endswith(".scale"):
        keep = resident == "quantized"
        return (math.prod(shape) * DTYPE_BYTES[dt], dt) if keep else (0, "none")
    if quantized and resident == "quantized":
        return math.prod(shape) * DTYPE_BYTES[dt], dt
    if resident == "quantized" and dt == "BF16" and name.endswith(_FP32_LINEARS):
        return 2 * math.prod(shape), "BF16"  # held as on disk, computed in fp32
    if dt == "I64":
        return math.prod(shape) * 8, "I64"
    n = _logical(name, shape, dt)
    if quantized or name == "embed.weight" or (dt == "BF16" and name.endswith(".weight")
                                                 and not name.endswith("norm.weight")
                                                 and not name.endswith(_FP32_LINEARS)):
        return 2 * n, "BF16"
    return 4 * n, "F32"


def rank_memory(args: ModelArgs, world_size: int, rank: int = 0, resident: str = "quantized", *,
                include_mtp: bool = False, inventory: dict | None = None) -> RankMemory:
    """Bytes rank `rank` of `world_size` holds for `args` under plan `resident` (see the module docstring).

    `inventory` (name -> (shape, safetensors dtype)) defaults to `expected_tensors(args, include_mtp=...)`; pass
    a real checkpoint's headers to plan from the files. Raises ValueError for an unknown plan or a world size
    that does not divide heads / groups / experts / vocab.
    """
    if resident not in RESIDENCY:
        raise ValueError(f"resident={resident!r}: expected one of {RESIDENCY}")
    attention_args(args, world_size)
    comm = Comm(rank, world_size)
    inv = inventory if inventory is not None else expected_tensors(args, include_mtp=include_mtp)
    mine = expert_range(args, comm)
    acc = {"replicated": 0, "split": 0, "experts": 0}
    by_dtype: dict[str, int] = {}
    temp = 0
    for name, (shape, dt) in inv.items():
        if not include_mtp and name.startswith("mtp."):
            continue
        kind, arg = shard_rule(name)
        if kind == "expert" and arg not in mine:
            continue
        nbytes, held = _resident(name, shape, dt, resident)
        if kind == "split":
            nbytes //= world_size
        acc["experts" if kind == "expert" else kind] += nbytes
        by_dtype[held] = by_dtype.get(held, 0) + nbytes
        if resident == "quantized" and dt in ("F8_E4M3", "I8") and name.endswith(".weight"):
            temp = max(temp, 2 * _logical(name, shape, dt) // (world_size if kind == "split" else 1))
        if resident == "quantized" and dt == "BF16" and name.endswith(_FP32_LINEARS):  # fp32 upcast per use
            temp = max(temp, 4 * math.prod(shape) // (world_size if kind == "split" else 1))
    return RankMemory(world_size, rank, resident, acc["replicated"], acc["split"], acc["experts"], temp,
                      {k: v for k, v in sorted(by_dtype.items()) if v})


def state_bytes(args: ModelArgs, seq_len: int, batch: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of one `DecodeState` preallocated for `seq_len` tokens (its max_len; a growable state holds the next
    multiple of 128 at least twice its previous size, `Transformer._reserve`) (model dtype `dtype_bytes`; compressor
    buffers fp32):
    per layer the window ring [b, window, hd]; ratio r > 0 adds entries [b, seq/r, hd] and the compressor's kv and
    score [b, c*r, c*hd] fp32 (c = 2 iff r = 4); r = 4 adds indexer keys [b, seq/4, d_I] and their compressor
    [b, 8, 2*d_I] fp32 x2. Replicated on every rank."""
    if seq_len < 0 or batch < 1:
        raise ValueError(f"seq_len={seq_len}, batch={batch}: expected seq_len >= 0 and batch >= 1")
    total = 0
    for layer in range(args.n_layers):
        r = args.ratio(layer)
        total += batch * args.window_size * args.head_dim * dtype_bytes
        if r:
            c = 2 if r == 4 else 1
            total += batch * (seq_len // r) * args.head_dim * dtype_bytes + 2 * batch * c * r * c * args.head_dim * 4
        if r == 4:
            total += batch * (seq_len // 4) * args.index_head_dim * dtype_bytes
            total += 2 * batch * 8 * 2 * args.index_head_dim * 4
    return total


def memory_table(args: ModelArgs, world_sizes: tuple[int, ...] = (1, 2, 4, 8),
                 residencies: tuple[str, ...] = RESIDENCY) -> list[RankMemory]:
    """`rank_memory` of rank 0 for every (plan, world size); every rank holds the same bytes (E and V divide)."""
    inv = expected_tensors(args)
    return [rank_memory(args, w, 0, r, inventory=inv) for r in residencies for w in world_sizes]


# ---------------------------------------------------------------- the plan checked before a load

class DeviceMemoryError(ValueError):
    """The device cannot hold the model's weights by the memory plan; the message has the numbers (what the plan
    needs, what the device has available, where that number comes from) and what to change."""

def _cgroup_room() -> int | None:
    """Bytes this process's cgroup (v2) may still allocate (memory.max - memory.current), None without a limit."""
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int(open("/sys/fs/cgroup/memory.current").read().strip()))
    except (OSError, ValueError):
        return None


def available_bytes(device: str) -> tuple[int, str] | None:
    """(bytes the device can still give a new allocation, where the number comes from), or None when it cannot
    be told (then nothing is refused). CPU: psutil's available memory if psutil is installed, else /proc/meminfo
    MemAvailable + SwapFree, capped by a cgroup v2 limit; CUDA: `torch.cuda.mem_get_info` (free bytes)."""

    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info(dev.index if dev.index is not None else torch.cuda.current_device())
        return int(free), f"free on {dev} (torch.cuda.mem_get_info)"
    if dev.type != "cpu":
        return None
    room, where = None, ""
    try:
        import psutil  # an optional dependency: psutil (not in pyproject.toml; /proc/meminfo below without it)

        vm, sw = psutil.virtual_memory(), psutil.swap_memory()
        room, where = int(vm.available + sw.free), "available RAM + free swap (psutil)"
    except ImportError:
        try:
            info = {}
            for line in open("/proc/meminfo"):
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
            room, where = info["MemAvailable"] + info.get("SwapFree", 0), "MemAvailable + SwapFree (/proc/meminfo)"
        except (OSError, KeyError, ValueError, IndexError):
            return None
    cg = _cgroup_room()
    if cg is not None and cg < room:
        room, where = cg, "room under the cgroup limit (/sys/fs/cgroup/memory.max - memory.current)"
    return room, where


def load_bytes(args: ModelArgs, n_layers: int, *, dtype_bytes: int, weights: str, world_size: int = 1,
               include_mtp: bool = False) -> int:
    """Bytes of weights one rank holds after loading the first `n_layers` main layers of `args` (and the MTP
    blocks with include_mtp: `load_model(..., mtp=True)`):
    `rank_memory` of the "bf16" plan for weights="dequantized" (its bf16-held tensors at `dtype_bytes` each:
    fp32 doubles them), of the "quantized" plan otherwise, with its per-use temporary. A lower bound of the
    load's peak (the loader also holds activations, the decode state and, briefly, a tensor being converted)."""
    inv = expected_tensors(args, n_layers, include_mtp)
    plan = rank_memory(args, world_size, 0, "bf16" if weights == "dequantized" else "quantized", inventory=inv,
                       include_mtp=include_mtp)
    if weights == "dequantized":
        bf16 = plan.by_dtype.get("BF16", 0)
        return plan.weights - bf16 + bf16 * dtype_bytes // 2
    return plan.peak


def check_fits(args: ModelArgs, n_layers: int, *, device: str, dtype_bytes: int, weights: str,
               world_size: int = 1, what: str = "the model", include_mtp: bool = False) -> None:
    """Refuse a load that cannot fit before any weight is read or generated (a `synth:flash` load on CPU once
    ran 159 s and then died with a raw allocator error). Raises DeviceMemoryError naming the plan's bytes, the
    device's available bytes and what would fit; does nothing when the available memory cannot be told or the
    world size does not divide the model (the loader says why)."""
    room = available_bytes(device)
    if room is None:
        return
    try:
        need = load_bytes(args, n_layers, dtype_bytes=dtype_bytes, weights=weights, world_size=world_size,
                          include_mtp=include_mtp)
    except ValueError:
        return
    free, where = room
    if need <= free:
        return
    per_layer = None
    if n_layers > 1:
        one = load_bytes(args, 1, dtype_bytes=dtype_bytes, weights=weights, world_size=world_size)
        per_layer = (need - one) / (n_layers - 1)
    hint = []
    if per_layer and free > need - (n_layers - 1) * per_layer:
        fit = int((free - (need - (n_layers - 1) * per_layer)) // per_layer) + 1
        hint.append(f"about {max(1, min(fit, n_layers - 1))} layer(s) would fit (TEST_LAYERS=N)")
    if weights == "dequantized":
        hint.append("--weights quantized keeps FP8/FP4 weights as on disk")
    if dtype_bytes > 2:
        hint.append("--dtype bf16 halves the dequantized weights")
    if world_size == 1:
        hint.append("more GPUs (torchrun) split the weights")
    raise DeviceMemoryError(
        f"{what} does not fit on {device}: by the memory plan (dsv4.memory_plan, {n_layers} main layer(s), weights "
        f"{weights}, {dtype_bytes} B per dequantized element, world size {world_size}) its weights alone need "
        f"{need / GiB:.2f} GiB, and {device} has {free / GiB:.2f} GiB available ({where}); refused before "
        f"reading any weight" + (f". Options: {'; '.join(hint)}" if hint else ""))


# ---------------------------------------------------------------- serving limits (issue 24 item 4)

MAX_BATCH = 64  # rows of one decode state: the batch sizes the gate runs the kernels at (1..64)


# LimitError (a request over a stated serving limit) is defined in dsv4.config, re-exported here


@dataclass(frozen=True)
class ServingPlan:
    """What a batch of `batch` rows of up to `max_len` tokens each costs and may use: `max_batch` (MAX_BATCH),
    `max_context` (tokens per row: original_seq_len x rope_factor, the YaRN-extended context, 1,048,576 for the
    released models), `row_bytes` / `state_bytes` (one row's / the whole decode state's bytes, `state_bytes`),
    `available` (bytes the device can still give, None when it cannot be told) and where that number comes from."""

    batch: int
    max_len: int
    max_batch: int
    max_context: int
    row_bytes: int
    state_bytes: int
    available: int | None
    where: str


def max_context(args: ModelArgs) -> int:
    """Tokens one row may hold: original_seq_len x rope_factor (YaRN, spec §5.2; = max_position_embeddings)."""
    return args.max_context


def max_new_tokens(args: ModelArgs, prompt_tokens: int, *, overhead: int = 0, grain: int = 1) -> int:
    """The most tokens a row may generate after a prompt of `prompt_tokens` tokens: the model's context
    (`max_context`), rounded down to a multiple of `grain` where the decode state is held in blocks of `grain`
    tokens (the speculative decoders' state: `dsv4.model.STATE_GRAIN`), minus the prompt and `overhead` (tokens the
    row holds beyond prompt + generated, e.g. the k + 1 of one speculative verify step). Less than 1 when the prompt
    alone leaves no room. Raises ValueError for a negative count or a grain below 1."""
    if min(prompt_tokens, overhead) < 0 or grain < 1:
        raise ValueError(f"prompt_tokens={prompt_tokens}, overhead={overhead}, grain={grain}: expected counts >= 0 "
                         "and a grain >= 1")
    return max_context(args) // grain * grain - prompt_tokens - overhead


def check_context(args: ModelArgs, *, prompt_tokens: int, value: int, option: str, prompt_label: str = "the prompt",
                  overhead: int = 0, overhead_why: str = "", grain: int = 1) -> None:
    """Refuse, before any model work, a row of `prompt_tokens` + `value` (+ `overhead`) tokens that does not fit the
    model's context (`max_new_tokens`: the same rule as `dsv4.generate.generate`, prompt + generated tokens <=
    original_seq_len x rope_factor). `value` is what the user asked for under the name `option` (`--max-tokens`,
    `--continue-tokens`, ...); `overhead` tokens are added to it for the reason `overhead_why`.

    Raises LimitError with every number: `{prompt_label} (P tokens) + {option} N [+ overhead (why)] = total tokens
    exceed the model's context of C tokens per row (...)`, then the largest `{option}` that fits this prompt, or,
    when none does, how many prompt tokens fit at all."""
    fits = max_new_tokens(args, prompt_tokens, overhead=overhead, grain=grain)
    if value <= fits:
        return
    ctx = max_context(args)
    room = ctx // grain * grain
    where = (f"the model's context of {ctx} tokens per row (original_seq_len {args.original_seq_len} x rope_factor "
             f"{args.rope_factor})")
    if room < ctx:
        where += f", of which a decode state held in blocks of {grain} tokens can use {room}"
    extra = f" + {overhead} ({overhead_why})" if overhead else ""
    hint = (f"{option} {fits} or less fits this prompt" if fits >= 1 else
            f"the prompt alone leaves no room for {option} 1: at most {room - overhead - 1} prompt tokens fit, "
            "shorten it")
    raise LimitError(f"{prompt_label} ({prompt_tokens} tokens) + {option} {value}{extra} = "
                     f"{prompt_tokens + value + overhead} tokens exceed {where}; {hint}")


def check_serving(args: ModelArgs, *, batch: int, max_len: int, device: str | torch.device, dtype_bytes: int,
                  ) -> ServingPlan:
    """Check a batch of `batch` rows, each needing up to `max_len` tokens (prompt + generated), against the
    serving limits before any work: LimitError naming the limit (batch > MAX_BATCH, max_len > the model's context
    per row, the decode state larger than what `device` has available) with the numbers; the plan otherwise.
    `args` is the loaded model's (its layer count: TEST_LAYERS applied). The weights are already resident, so
    the device's available bytes are what the state may take (activations need a margin beyond it)."""
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise LimitError(f"batch={batch!r}: expected an int >= 1")
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        raise LimitError(f"max_len={max_len!r}: expected an int >= 1 (tokens per row)")
    if not isinstance(args, ModelArgs):
        raise LimitError(f"args: expected the loaded model's ModelArgs, got {type(args).__name__}")
    if isinstance(dtype_bytes, bool) or dtype_bytes not in (2, 4):
        raise LimitError(f"dtype_bytes={dtype_bytes!r}: expected 2 (bf16) or 4 (fp32), the model dtype's bytes")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise LimitError(f"device={device!r}: not a torch device ({e})") from None
    if batch > MAX_BATCH:
        raise LimitError(f"batch {batch} exceeds MAX_BATCH={MAX_BATCH} rows per decode state "
                         "(dsv4.memory_plan.MAX_BATCH: the batch sizes the kernels are gated at); pass max_batch <= "
                         f"{MAX_BATCH} and the rest of the requests wait for a free row")
    ctx = max_context(args)
    if max_len > ctx:
        raise LimitError(f"a row needs {max_len} tokens (max_len: prompt + max_tokens, as the caller sized the decode "
                         f"state), over the model's context of {ctx} tokens per row (original_seq_len "
                         f"{args.original_seq_len} x rope_factor {args.rope_factor}); shorten the prompt or lower "
                         "max_tokens")
    held = -(-max_len // 128) * 128  # a state holds a multiple of 128 tokens (dsv4.model.STATE_GRAIN)
    row = state_bytes(args, held, 1, dtype_bytes)
    total = state_bytes(args, held, batch, dtype_bytes)
    room = available_bytes(str(device))
    free, where = room if room is not None else (None, "unknown")
    if free is not None and total > free:
        fit = max(0, free // row)
        raise LimitError(f"the decode state of {batch} row(s) x {max_len} tokens needs {total / GiB:.3f} GiB "
                         f"({row / GiB:.4f} GiB per row, dsv4.memory_plan.state_bytes), and {device} has "
                         f"{free / GiB:.3f} GiB available ({where}); about {fit} row(s) of this length would fit")
    return ServingPlan(batch, max_len, MAX_BATCH, ctx, row, total, free, where)
