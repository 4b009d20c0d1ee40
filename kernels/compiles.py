"""Counting Triton compilations (issue 29: a new prompt length must not recompile the kernels).

Triton builds one binary per *specialization* of a `@triton.jit` kernel: the value of every `tl.constexpr`
argument, the dtype of every tensor argument and, unless the kernel lists the argument in `do_not_specialize`,
for every int argument whether it equals 1 (then it becomes a constant) and whether it is divisible by 16 (and
for every pointer whether its address is 16-byte aligned). An int that varies with the prompt length, the
position or the batch therefore costs a new compile (1-3 s on an H200) at each new class of its value, unless
it is listed in `do_not_specialize`. Two tools here:

* `CompileLog` (GPU): a context manager that records every compile Triton does while it is active (an
  in-process cache miss of a JIT kernel: a real build, or a load of a binary from Triton's on-disk cache),
  through `triton.knobs.runtime.jit_cache_hook` / `jit_post_compile_hook` (Triton >= 3.4): kernel name,
  the specialization (`spec_string`) and the seconds it took. Under TRITON_INTERPRET=1 nothing is compiled and
  the hooks never run, so entering a `CompileLog` there is an error (a count of zero would mean nothing).
* `LaunchLog` (CPU, TRITON_INTERPRET=1): records for every kernel launch the specialization key the GPU would
  compile it under (`spec_key`: Triton 3.6's rules, mirrored in Python), so a CPU test can check that a sweep
  of lengths maps onto a fixed set of keys (`tests/unit/test_compile_specialization.py`); on the GPU
  `tests/gpu/test_compile_count.py` counts the real compiles.

The bounded set of builds per kernel (issue 29; what is left after `do_not_specialize`): constexprs from a
fixed set and model constants only, and the threshold choices `dsv4.warmup` probes:
  attention      `_sparse_decode_kernel` (>= 64 heads, every s) DV / warps by b*s (<= 16 query-head-block
                 programs: column split) x SPLIT (k-split while the programs fill less than a wave) x dtype;
                 `_sparse_attn_kernel` (fewer heads) SPLIT (k-split while the (query, head block) programs
                 fill less than two waves) x dtype;
  indexer        `_indexer_topk_kernel` BLOCK in TOPK_BLOCKS (or 4096 chunked) x KP in TOPK_SORT_WIDTHS x S == 1;
                 `_indexer_scores_kernel` / `_indexer_select_kernel` one per model width;
  mhc            `_hc_mix_kernel` per tile set (T < / >= 1024) and site kind; `_hc_finish_kernel`, `_hc_fused_kernel`
                 per site kind (hc_pre / hc_head); `_hc_post_kernel` BT 2 / 4 (T < 4); `_hc_post_pre_kernel` one;
  gemm / fp32_linear / moe   the decode GEMVs per row bucket (BM = next power of two of M <= 64) and launch
                 config, `_fp8_gemm_kernel` at DECODE_TILE (9..64 rows, `fp8_linear`'s default there), and
                 `_bf16w_gemv_kernel` by M's class (== 1, % 16) within a bucket (M <= 64: a finite
                 set, all of it warmed); the MoE paths by pair count (GEMV / 16x64 / 32x128 tiles);
  norm, quant, rope, compressor   one per model width (and call site); `_head_rms_kernel` per width x RoPE
                 (the q finish) x shared / per-row positions, `_kv_finish_kernel` per width x call site (kv, CSA /
                 HCA / indexer entry) x ring write (decode);
  moe epilogues  `_swiglu_joint_kernel`, `_sum_slots_kernel` one per width and slot count;
  attention      `_step_index_kernel` per layer kind x s == 1; indexer `_rotate_fp4_kernel` one per width;
  invariant      (the batch-invariant mode) `_hadamard_kernel` one per width (its head-RMS is norm's); its GEMVs
                 one per launch config and side (16-row tiles <= 64 rows, 64-row tiles above), M's class as above.
  router         `_route_kernel` one per (E, k, score function) x score / hash layer: no argument follows the
                 batch (the row count is only the grid).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch

from kernels.launch import interpreting

__all__ = ["CompileEvent", "CompileLog", "LaunchLog", "spec_key", "spec_string"]


@dataclass(frozen=True)
class CompileEvent:
    """One Triton compile: kernel `name` (module.qualname), its specialization `spec` (`spec_string`), and the
    wall seconds from the cache miss to the built kernel."""

    name: str
    spec: str
    seconds: float


def spec_string(arg_names: list[str], signature: dict, constants: dict, attrs: dict, options: str = "") -> str:
    """`name=value` for constexprs and ints specialized to 1, `name:type` for runtime arguments, `/16` where
    Triton assumes divisibility by 16 (ints) or 16-byte alignment (pointers); `options` appended (warps ...)."""
    consts = {k[0] if isinstance(k, tuple) else k: v for k, v in constants.items()}
    div = {k[0] if isinstance(k, tuple) else k for k, v in attrs.items() if any("divisibility" in a[0] for a in v)}
    parts = []
    for i, n in enumerate(arg_names):
        if i in consts or n in consts:
            v = consts.get(i, consts.get(n))
            parts.append(f"{n}={getattr(v, '__name__', v)!s}")
        else:
            parts.append(f"{n}:{signature.get(n, '?')}{'/16' if i in div else ''}")
    return ", ".join(parts) + (f" [{options}]" if options else "")


class CompileLog:
    """Context manager recording every Triton JIT compile while active (GPU only; module docstring).

    `events` lists `CompileEvent`s in order; `count`, `seconds`, `by_kernel()` summarise them. Hooks already
    installed are chained, not replaced, and restored on exit. Raises RuntimeError under TRITON_INTERPRET=1
    (nothing compiles there) or when the installed Triton has no `knobs.runtime.jit_post_compile_hook`.
    """

    def __init__(self):
        self.events: list[CompileEvent] = []
        self._t0: dict[tuple, float] = {}

    def __enter__(self) -> "CompileLog":
        if interpreting():
            raise RuntimeError("CompileLog: TRITON_INTERPRET=1 compiles nothing (the hooks never run); count "
                               "specializations with kernels.compiles.LaunchLog instead")
        import triton  # triton is an optional dependency: this module is importable without it
        rt = getattr(getattr(triton, "knobs", None), "runtime", None)
        if rt is None or not hasattr(rt, "jit_post_compile_hook") or not hasattr(rt, "jit_cache_hook"):
            raise RuntimeError(f"CompileLog: triton {triton.__version__} has no knobs.runtime.jit_cache_hook / "
                               "jit_post_compile_hook (needs triton >= 3.4)")
        self._rt = rt
        self._prev = (rt.jit_cache_hook, rt.jit_post_compile_hook)
        prev_cache, prev_post = self._prev

        def cache_hook(**kw):
            self._t0[_hook_id(kw)] = time.perf_counter()
            return prev_cache(**kw) if prev_cache is not None else False

        def post_hook(**kw):
            t1 = time.perf_counter()
            t0 = self._t0.pop(_hook_id(kw), t1)
            fn = kw["fn"]
            try:
                c = kw["compile"]
                opts = f"warps={c.get('num_warps')}, stages={c.get('num_stages')}"
                spec = spec_string(list(fn.jit_function.arg_names), c["signature"], c["constants"],
                                   (c.get("configs") or [{}])[0], opts)
            except Exception as e:  # a hook API this code does not know: the compile still counts, the spec says why
                spec = f"<specialization unreadable: {type(e).__name__}: {e}>"
            self.events.append(CompileEvent(f"{getattr(fn.module, '__name__', fn.module)}.{fn.name}", spec, t1 - t0))
            return prev_post(**kw) if prev_post is not None else None

        rt.jit_cache_hook, rt.jit_post_compile_hook = cache_hook, post_hook
        return self

    def __exit__(self, *exc) -> None:
        self._rt.jit_cache_hook, self._rt.jit_post_compile_hook = self._prev

    @property
    def count(self) -> int:
        return len(self.events)

    @property
    def seconds(self) -> float:
        return sum(e.seconds for e in self.events)

    def by_kernel(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.events:
            out[e.name] = out.get(e.name, 0) + 1
        return out

    def report(self, limit: int = 50) -> str:
        """One line per compile (at most `limit`): seconds, kernel, specialization."""
        lines = [f"{e.seconds:6.2f}s {e.name}({e.spec})" for e in self.events[:limit]]
        if len(self.events) > limit:
            lines.append(f"... {len(self.events) - limit} more")
        return "\n".join(lines)


def _hook_id(kw) -> tuple:
    fn = kw["fn"]
    return (fn.module, fn.name, str(kw["key"]))


# ------------------------------------------------------------------------------------------------------------
# The specialization key Triton 3.6 compiles a launch under, computed in Python (works under the interpreter)
# ------------------------------------------------------------------------------------------------------------

_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
if hasattr(torch, "float8_e8m0fnu"):
    _DTYPE[torch.float8_e8m0fnu] = "u8"


def _int_spec(v: int, dns: bool, dns_align: bool) -> tuple:
    """Triton 3.6 `specialize_impl` for an int: 1 -> constant (unless do_not_specialize), i32 / i64 by range,
    'D' when divisible by 16 (unless do_not_specialize or do_not_specialize_on_alignment)."""
    if v == 1 and not dns:
        return ("constexpr", 1)
    ty = "i32" if -2 ** 31 <= v < 2 ** 31 else ("u64" if v >= 2 ** 63 else "i64")
    if dns:
        return (ty, None)
    return (ty, "D" if v % 16 == 0 and not dns_align else "")


def spec_key(fn, arg_names: list[str], args: tuple, kwargs: dict, dns: set, dns_align: set,
             constexprs: set) -> tuple:
    """The part of Triton's compile-cache key a launch determines: per argument its constexpr value, dtype and
    alignment (tensors, 16 bytes), int class (`_int_spec`), or type; plus the launch options (num_warps ...)."""
    bound = dict(zip(arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k in arg_names})
    opts = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arg_names))
    key = []
    sig = inspect.signature(fn)
    for n in arg_names:
        if n not in bound:
            d = sig.parameters[n].default
            bound[n] = None if d is inspect.Parameter.empty else d
        v = bound[n]
        if n in constexprs:
            key.append((n, "constexpr", v))
        elif isinstance(v, torch.Tensor):
            key.append((n, "*" + _DTYPE.get(v.dtype, str(v.dtype)),
                        "D" if v.data_ptr() % 16 == 0 and n not in dns_align and n not in dns else ""))
        elif isinstance(v, bool):
            key.append((n, "i1"))
        elif isinstance(v, int):
            key.append((n,) + _int_spec(v, n in dns, n in dns_align))
        elif isinstance(v, float):
            key.append((n, "fp32"))
        elif v is None:
            key.append((n, "constexpr", None))
        else:
            key.append((n, type(v).__name__))
    return tuple(key) + (("options",) + opts,)


class LaunchLog:
    """Context manager (TRITON_INTERPRET=1): records the `spec_key` of every Triton kernel launch while active.

    `keys` maps kernel name -> set of keys seen; `new_since(snapshot)` lists (name, key) pairs not in an earlier
    `snapshot()`: on the GPU each of those is one compile. Raises RuntimeError outside the interpreter."""

    def __init__(self):
        self.keys: dict[str, set] = {}
        self.launches = 0

    def __enter__(self) -> "LaunchLog":
        if not interpreting():
            raise RuntimeError("LaunchLog: needs TRITON_INTERPRET=1 (on the GPU count compiles with CompileLog)")
        from triton.runtime.interpreter import InterpretedFunction  # triton is an optional dependency
        self._cls = InterpretedFunction
        self._orig = InterpretedFunction.run
        log = self

        def run(fn_self, *args, grid, warmup, **kwargs):
            if not warmup:
                log._record(fn_self, args, kwargs)
            return log._orig(fn_self, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run
        return self

    def __exit__(self, *exc) -> None:
        self._cls.run = self._orig

    def _record(self, f, args, kwargs) -> None:
        sig = inspect.signature(f.fn)
        names = list(sig.parameters)
        constexprs = {n for n, p in sig.parameters.items() if "constexpr" in str(p.annotation)}
        resolve = lambda xs: {names[x] if isinstance(x, int) else x for x in (xs or ())}  # noqa: E731
        key = spec_key(f.fn, names, args, kwargs, resolve(f.kwargs.get("do_not_specialize")),
                       resolve(f.kwargs.get("do_not_specialize_on_alignment")), constexprs)
        self.keys.setdefault(f"{f.fn.__module__}.{f.fn.__qualname__}", set()).add(key)
        self.launches += 1

    def snapshot(self) -> dict[str, frozenset]:
        return {k: frozenset(v) for k, v in self.keys.items()}

    def new_since(self, snap: dict[str, frozenset]) -> list[tuple[str, tuple]]:
        return [(n, k) for n, ks in self.keys.items() for k in ks if k not in snap.get(n, frozenset())]

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.keys.values())
