"""The router after its logits in one launch (spec §8.1-4): scores, biased top-k or hash ids, gather, normalise,
route_scale.

Reading order (STYLE §1): the reference, the kernel, the launcher. `route_ref` is the executable spec (the
reference backend's `route` entry; `dsv4.model.Gate.forward` calls the backend's entry on the fp32 logits of its
`fp32_linear`). In torch the official maths is 8-9 launches per layer on a GPU (softplus, sqrt, + bias, top-k
(1-2), gather, sum, div, x route_scale; hash layers 6: no bias / top-k, the tid2eid lookup stays in `Gate`);
`route` is one Triton launch: one program per row, the E expert scores of the row in registers.

The maths, as the reference states it (every rule below is the reference's, and the kernel's):
  1. scores s = sqrt(softplus(l)) ("sqrtsoftplus", softplus threshold 20 as torch's), sigmoid(l) or softmax(l)
     over the row, computed in fp64 from the fp32 logits and rounded once to fp32. The official code computes
     them in fp32, whose exp / log1p differ between CPU, CUDA and Triton by an ulp or so; computed in fp64 and
     rounded, every device and both backends get the correctly rounded fp32 score (except when the fp64 value
     lies within a few fp64 ulps of an fp32 rounding boundary: about 1e-8 per score); against the official fp32
     value: <= 1 ulp for sqrtsoftplus, <= 2 for sigmoid, softmax within fp32 softmax's own error (~20 ulps).
     docs/differences.md M8.
  2. ids: hash layers take `hash_ids` (= tid2eid[token], spec §8.3) as given. Other layers take the top-k of
     the fp32 sum s + bias (bias selects only), in the rule of `kernels.indexer.indexer_topk_ref` (which this
     function calls): larger first, equal values toward the LOWER expert index (what CUDA's torch.topk was
     measured to do, §7 step 7; CPU torch.topk breaks ties arbitrarily), -0.0 equal to +0.0, NaN below every
     value; the ids in pick order.
  3. weights: w_j = s[id_j] (unbiased); unless softmax, w_j / (((w_0 + w_1) + w_2) + ...) (the sum left to
     right in pick order, fp32: one stated order, the same at every batch size); then x fp32(route_scale).

Kernel vs reference: ids bitwise equal; weights bitwise equal. Why: the scores are the same fp64 formula rounded
to fp32 (the kernel's log1p is Goldberg's log(u) * e / (u - 1), u = 1 + e, accurate to a few fp64 ulps like
torch's fp64 log1p; the fp32 rounding of both agrees but for the ~1e-8 boundary case of 1.); from there every
step is one correctly rounded IEEE fp32 operation applied in the same order in both (the bias add, the
comparisons of the top-k, the left-to-right sum, `div_rn`, the scale multiply; no FMA can form: no multiply feeds
an add), and the gather is exact. Softmax rows: the fp64 sum over the row has another order (a difference of
~1e-16 relative before the fp32 rounding), so they are bitwise equal except the same ~1e-8 boundary case.
tests/unit/test_router_kernel.py checks bitwise equality (interpreter), tests/gpu/test_router_kernel.py on CUDA.

No host sync (CUDA-graph capturable). A hash id outside [0, E) (the loader refuses such a tid2eid,
`dsv4.formats`) gives NaN for the whole row's weights, never a silent 0; the reference raises there (CPU) or
asserts (CUDA).

Blackwell (sm_100): nothing changes. The kernel has no tensor-core or TMA work (a row of E <= 512 values in
registers, fp64 exp / log / sqrt through libdevice, warp reductions); it builds for sm_90 and sm_100 alike
(`kernels.targets`), and its cost is the launch. The one thing to watch is fp64 throughput: B200 keeps a large
fp64 rate, but parts with a cut fp64 unit (B300-class) run the ~50 fp64 operations per score at a small fraction
of it: still about a microsecond per decode step, some tens of microseconds for a 4k-token prefill.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the references stay importable without it; launching raises
    triton = None
    tl = None

from kernels.indexer import indexer_topk_ref
from kernels.launch import check_layout
from kernels.launch import fail as _fail

__all__ = ["route_ref", "route", "SCORE_FUNCS", "MAX_EXPERTS", "MAX_TOPK"]

SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")  # `dsv4.config` ModelArgs.score_func
MAX_EXPERTS = 512  # one program holds the row (DeepSeek-V4: 256 Flash, 384 Pro)
MAX_TOPK = 16      # the picks are unrolled (DeepSeek-V4: 6)


def _scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """Step 1 of the module docstring: fp64 score of the fp32 logits, rounded once to fp32. [N, E] fp32."""
    x = logits.double()
    if score_func == "softmax":
        s = x.softmax(-1)
    elif score_func == "sigmoid":
        s = x.sigmoid()
    else:
        s = F.softplus(x).sqrt()
    return s.float()


def _check(op: str, logits, bias, hash_ids, topk, score_func, route_scale) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dtype != torch.float32 or logits.dim() != 2:
        _fail(op, "logits", f"{getattr(logits, 'dtype', type(logits))} shape {tuple(getattr(logits, 'shape', ()))}",
              "a float32 tensor [N, E]")
    n, e = logits.shape
    if not 1 <= e <= MAX_EXPERTS:
        _fail(op, "logits", f"{e} experts (shape {tuple(logits.shape)})", f"1..{MAX_EXPERTS} experts")
    if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= min(e, MAX_TOPK):
        _fail(op, "topk", repr(topk), f"an int in 1..{min(e, MAX_TOPK)}")
    if score_func not in SCORE_FUNCS:
        _fail(op, "score_func", repr(score_func), f"one of {SCORE_FUNCS}")
    if isinstance(route_scale, bool) or not isinstance(route_scale, (int, float)) or \
            not 0 < float(route_scale) < float("inf"):
        _fail(op, "route_scale", repr(route_scale), "a finite number > 0")
    if (bias is None) == (hash_ids is None):
        _fail(op, "bias / hash_ids", f"{'both' if bias is not None else 'neither'} given",
              "exactly one: bias (score layers) or hash_ids (hash layers)")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32 or
                             tuple(bias.shape) != (e,) or bias.device != logits.device):
        _fail(op, "bias", f"{getattr(bias, 'dtype', type(bias))} shape {tuple(getattr(bias, 'shape', ()))} on "
              f"{getattr(bias, 'device', '?')}", f"float32 [{e}] on {logits.device}")
    if hash_ids is not None and (not isinstance(hash_ids, torch.Tensor) or hash_ids.dtype != torch.int64 or
                                 tuple(hash_ids.shape) != (n, topk) or hash_ids.device != logits.device):
        _fail(op, "hash_ids", f"{getattr(hash_ids, 'dtype', type(hash_ids))} shape "
              f"{tuple(getattr(hash_ids, 'shape', ()))} on {getattr(hash_ids, 'device', '?')}",
              f"int64 [{n}, {topk}] on {logits.device}")


def route_ref(logits: torch.Tensor, bias: torch.Tensor | None, hash_ids: torch.Tensor | None, topk: int,
              score_func: str, route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The router after its logits (spec §8.2-4; the reference backend's `route` entry; maths: module docstring).

    Args:
        logits: [N, E] float32, the gate's fp32 logits (E <= MAX_EXPERTS).
        bias: [E] float32 (`Gate.bias`, selection only) on score layers, None on hash layers.
        hash_ids: [N, topk] int64 in [0, E) (`tid2eid[input_ids]`) on hash layers, None on score layers.
        topk: experts per token, 1..min(E, MAX_TOPK) (n_activated_experts).
        score_func: one of SCORE_FUNCS.
        route_scale: finite > 0, applied as its fp32 rounding (1.5 Flash, 2.5 Pro: exact).
    Returns:
        (weights [N, topk] float32, ids [N, topk] int64); score layers list the ids in pick order (largest
        biased score first), hash layers return `hash_ids` itself.
    Raises:
        ValueError naming the wrong argument (dtype, shape, device, range, both or neither of bias / hash_ids);
        a hash id outside [0, E) is a ValueError too (checked on the host, except while a CUDA graph is being
        captured, where the gather's own device-side error remains).
    """
    _check("route_ref", logits, bias, hash_ids, topk, score_func, route_scale)
    if hash_ids is not None and hash_ids.numel() and not (logits.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = int(hash_ids.min()), int(hash_ids.max())
        if lo < 0 or hi >= logits.shape[1]:
            _fail("route_ref", "hash_ids", f"ids in [{lo}, {hi}]", f"ids in [0, {logits.shape[1]})")
    s = _scores(logits, score_func)
    ids = hash_ids if hash_ids is not None else indexer_topk_ref((s + bias)[None], topk)[0]
    w = s.gather(1, ids)
    if score_func != "softmax":
        tot = w[:, 0].clone()
        for j in range(1, topk):  # left to right, in pick order (module docstring, step 3)
            tot = tot + w[:, j]
        w = w / tot[:, None]
    return w * route_scale, ids  # torch multiplies an fp32 tensor by the scalar's fp32 rounding (CPU and CUDA)


if triton is not None:  # the kernels exist only where triton is installed (it is optional)

    @triton.jit
    def _route_kernel(l_ptr, b_ptr, h_ptr, w_ptr, ids_ptr, E, route_scale,
                      K: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, SCORE: tl.constexpr, HASH: tl.constexpr):
        """Row `program_id(0)` of logits [N, E]: weights / ids [N, K] (`route_ref`). SCORE: 0 sqrtsoftplus,
        1 sigmoid, 2 softmax; HASH: ids from h_ptr [N, K] (b_ptr unused) else the biased top-k (b_ptr [E]).
        No argument depends on N (the grid is the row count): one build per (E, K, SCORE, HASH)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BE)
        valid = offs < E
        x = tl.load(l_ptr + row * E + offs, mask=valid, other=0.0).to(tl.float64)
        if SCORE == 2:  # softmax over the row
            xm = tl.where(valid, x, float("-inf"))
            ex = tl.exp(xm - tl.max(xm, 0))
            s64 = ex / tl.sum(ex, 0)
        elif SCORE == 1:  # sigmoid
            s64 = 1.0 / (1.0 + tl.exp(-x))
        else:  # sqrt(softplus(x)), torch's threshold 20; log1p(e) = log(u) * e / (u - 1), u = 1 + e (Goldberg)
            e = tl.exp(tl.where(x > 20.0, 20.0, x))  # no inf in the branch not taken (NaN stays NaN)
            u = 1.0 + e
            lp = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
            s64 = tl.sqrt(tl.where(x > 20.0, x, lp))  # fp64: sqrt.rn.f64 (checked in the PTX)
        s = s64.to(tl.float32)
        if not HASH:
            key = s + tl.load(b_ptr + offs, mask=valid, other=0.0)
            picked = offs >= E  # padding lanes are never candidates
        slot = tl.arange(0, KP)
        wv = tl.zeros([KP], dtype=tl.float32)
        iv = tl.zeros([KP], dtype=tl.int64)
        tot = 0.0
        for j in tl.static_range(K):
            if HASH:
                idx = tl.load(h_ptr + row * K + j)
            else:  # the largest non-NaN key left, lowest index among equals; only NaN left: its lowest index
                avail = ~picked
                fin = avail & (key == key)
                m = tl.max(tl.where(fin, key, float("-inf")), 0)
                cand = fin & (key == m)
                cand = tl.where(tl.max(cand.to(tl.int32), 0) > 0, cand, avail)
                idx = tl.min(tl.where(cand, offs, BE), 0).to(tl.int64)
                picked = picked | (offs == idx)
            wj = tl.sum(tl.where(offs == idx, s, 0.0), 0)  # exact gather (one term; scores are >= +0 or NaN)
            wj = tl.where((idx >= 0) & (idx < E), wj, float("nan"))  # a bad hash id poisons the row
            if j == 0:
                tot = wj
            else:
                tot = tot + wj  # left to right in pick order, as route_ref
            wv = tl.where(slot == j, wj, wv)
            iv = tl.where(slot == j, idx, iv)
        if SCORE != 2:
            wv = tl.math.div_rn(wv, tl.zeros([KP], dtype=tl.float32) + tot)
        kmask = slot < K
        tl.store(w_ptr + row * K + slot, wv * route_scale, mask=kmask)
        tl.store(ids_ptr + row * K + slot, iv, mask=kmask)


def route(logits: torch.Tensor, bias: torch.Tensor | None, hash_ids: torch.Tensor | None, topk: int,
          score_func: str, route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_ref` in one Triton launch (the triton backend's `route` entry; module docstring): ids and weights
    bitwise equal to the reference; no host sync (CUDA-graph capturable).

    Args: as `route_ref`; logits (and bias / hash_ids) contiguous, on CUDA (CPU under TRITON_INTERPRET=1).
    Returns: (weights [N, topk] float32, ids [N, topk] int64), new tensors (hash rows: a copy of hash_ids).
    Raises: ValueError naming the wrong argument (as `route_ref`, and layout / device); RuntimeError without
        triton. A hash id outside [0, E) is not raised (no sync): that row's weights are NaN.
    """
    op = "route"
    _check(op, logits, bias, hash_ids, topk, score_func, route_scale)
    extra = {"bias": bias} if bias is not None else {"hash_ids": hash_ids}
    check_layout(op, {"logits": logits, **extra})
    n, e = logits.shape
    w = torch.empty(n, topk, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, topk, dtype=torch.int64, device=logits.device)
    if n:
        be = max(16, triton.next_power_of_2(e))
        other = bias if bias is not None else hash_ids
        _route_kernel[(n,)](logits, other, other, w, ids, e, float(route_scale),
                            K=topk, KP=max(2, triton.next_power_of_2(topk)), BE=be,
                            SCORE=SCORE_FUNCS.index(score_func), HASH=hash_ids is not None,
                            num_warps=max(1, min(4, be // 128)))
    return w, ids
