"""Root pytest configuration: per-test seeds, the HARD STOP banner and the JSON report's hard-stop summary.

A failing test marked `hardstop` ends the run with a banner naming the tests and the rule. When
pytest-json-report is active (`--json-report`), the report gains what `dsv4 gate` reads:

- `hardstop`: `tests` (hard-stop node ids that ran), `failed`, `deselected` (hard-stop node ids deselected
  by `-k`, `--deselect` or a conftest hook), `passed`, `rule`;
- `git_commit`: HEAD when the session started, or None outside git or when HEAD moved during the run;
- `git_dirty`: whether tracked files had uncommitted changes or untracked, non-ignored files existed at the
  start or the end of the session (the report file itself excluded; None outside git), and
  `git_dirty_files`, the paths that made it dirty. A report vouches for a commit only when this is False.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
HARD_STOP_RULE = "no kernel, mHC or residual change is authorized until these pass"

# Per-session state (pytest runs one session per process).
_hardstop: dict[str, str] = {}  # nodeid -> outcome
_deselected: set[str] = set()  # deselected hard-stop node ids
_start: dict[str, object] = {}  # at session start: report (file path), commit, dirty


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # The CPU tests run tiny models: intra-op threading costs far more than it gains (measured 14x slower
    # per decode step with 2 threads on a loaded 2-core machine), so run torch single-threaded. Done once
    # torch is loaded (by the tests), not by importing it here: pytest runs that need no torch, such as the
    # gate's own subprocesses on throwaway repositories, then start in a fraction of a second.
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    if not _interpreter_patch and "triton.runtime.interpreter" in sys.modules:
        ti = sys.modules["triton.runtime.interpreter"]
        _interpreter_patch.append(_skip_nested_lang_patch(ti))
        _interpreter_patch.append(_memo_np_dtype(ti))
        _interpreter_patch.append(_rowwise_dot(ti))


_interpreter_patch: list[bool] = []  # once the patches below have run in this process: whether each applied


def _memo_np_dtype(ti) -> bool:
    """Test speed only, semantics unchanged: under TRITON_INTERPRET=1, the interpreter's `_get_np_dtype(tt_dtype)`
    (the numpy dtype a Triton dtype is held in, called by every cast, splat, load and binary op) rebuilds its table
    of 18 Triton dtypes -> numpy dtypes at every call (~6 us: ~10 % of a model-level interpreter test, 184,000
    calls in a 6-token prefill + one decode step of test_batch_invariant_model). Here the same function answers
    from a table filled by the original: a pointer type (or a block of pointers) -> uint64 as before, a block
    type -> its element type's entry (what the original looks up), a scalar type -> the original's answer for it,
    computed once (an unknown type still raises the original's KeyError, uncached). The module's callers look the
    name up at call time, so replacing the module attribute reaches all of them. Applied only where the
    interpreter has this function; otherwise nothing changes and the interpreter is merely slower. Returns whether
    applied."""
    original = getattr(ti, "_get_np_dtype", None)
    tl = getattr(ti, "tl", None)
    if original is None or tl is None or getattr(original, "_dsv4_memo", False):
        return False
    pointer_type, block_type, u64 = tl.pointer_type, tl.block_type, original(tl.pointer_type(tl.int8))
    table: dict = {}

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, pointer_type):
            return u64
        if isinstance(tt_dtype, block_type):
            if isinstance(tt_dtype.element_ty, pointer_type):
                return u64
            tt_dtype = tt_dtype.element_ty
        try:
            return table[tt_dtype]
        except KeyError:
            table[tt_dtype] = out = original(tt_dtype)
            return out

    get_np_dtype._dsv4_memo, get_np_dtype._dsv4_original = True, original
    ti._get_np_dtype = get_np_dtype
    return True


def _rowwise_dot(ti) -> bool:
    """Faithfulness, not speed: under TRITON_INTERPRET=1, `tl.dot` is `np.matmul` of the two tiles
    (`InterpreterBuilder.create_dot`), and numpy's BLAS may compute a row of the product differently depending on
    the row's place in the tile. Measured with numpy 2.4's OpenBLAS 0.3.31 (DYNAMIC_ARCH) on an AVX-512 AMD EPYC,
    single-threaded: in a [16, 64] x [64, 64] fp32 product the rows 0-5 and 6-15 of sixteen copies of one row
    differ in the last bits (two micro-kernels). A tensor core's dot computes each output row from its own row
    alone, so such an interpreter makes a batch-invariant kernel look variant (tests/unit/test_batch_invariant.py
    failed on that machine and passed on CI's). Here the product is computed one row at a time (a stacked
    [..., M, 1, K] x [..., 1, K, N] matmul: every row through the same 1-row routine, whatever its place and its
    neighbours), with the original's operand handling (fp8 tiles widened to fp16 first) and accumulator dtype.
    Applied only where the interpreter has this method and helper; otherwise nothing changes. Returns whether
    applied."""
    builder = getattr(ti, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    convert, tl, np_ = getattr(ti, "_convert_float", None), getattr(ti, "tl", None), getattr(ti, "np", None)
    if original is None or convert is None or tl is None or np_ is None or getattr(original, "_dsv4_rowwise", False):
        return False
    TensorHandle = ti.TensorHandle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
           (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):
            a_data = convert(a_data, a.dtype, tl.float16, None).view(np_.float16)
            b_data = convert(b_data, b.dtype, tl.float16, None).view(np_.float16)
        rows = np_.matmul(a_data[..., :, None, :], b_data[..., None, :, :], dtype=d.data.dtype)[..., 0, :]
        return TensorHandle(rows + d.data, d.dtype.scalar)

    create_dot._dsv4_rowwise, create_dot._dsv4_original = True, original
    builder.create_dot = create_dot
    return True


def _skip_nested_lang_patch(ti) -> bool:
    """Test speed only, semantics unchanged: under TRITON_INTERPRET=1, Triton's interpreter patches the
    `triton.language` modules when a kernel launches (`GridExecutor.__call__` -> `_patch_lang`, restored when the
    grid is done) and patches them AGAIN at every call of a nested `@triton.jit` helper inside the kernel
    (`InterpretedFunction.__call__`), each time walking the modules with `inspect.getmembers`: a third of the CPU
    time of a model-level interpreter test (profile of test_batch_invariant_model: 41 of 132 s), for nothing, since
    a nested call's patches find every builtin already patched (its scope is never restored either). Here the
    nested call skips the walk when the helper sees no language module the running launch has not patched (the
    first call of a triton.language.standard helper - tl.sum, tl.max, tl.zeros, which see `core` - patches `core`
    once per launch: ~1,500 walks of a model decode step at dim 128 before, 10 % of its time). Applied
    only where the interpreter has exactly these internals (triton 3.x: `_patch_lang`, `_LangPatchScope`,
    `GridExecutor`); otherwise nothing changes and the interpreter is merely slower. Returns whether applied."""
    names = ("_patch_lang", "_LangPatchScope", "GridExecutor", "tl")
    if not all(hasattr(ti, n) for n in names) or getattr(ti._patch_lang, "_dsv4_skip_nested", False):
        return False
    original, tl = ti._patch_lang, ti.tl
    patched: list = []  # the language modules the running launch patched (None until its own _patch_lang ran)

    def langs(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}  # both modules

    def patch_lang(fn):
        if patched and patched[-1] is not None and langs(fn) <= patched[-1]:
            return ti._LangPatchScope()  # nothing to restore: the launch's own scope restores the modules
        if patched and patched[-1] is None:  # the launch's own call (GridExecutor.__call__)
            patched[-1] = langs(fn)
        elif patched:  # a nested helper seeing a module the launch had not patched (triton.language.standard's
            patched[-1] |= langs(fn)  # tl.sum / tl.max / tl.zeros see `core`): its patches are never restored
        return original(fn)

    launch = ti.GridExecutor.__call__

    def grid_call(self, *args, **kwargs):
        patched.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    patch_lang._dsv4_skip_nested = True
    ti._patch_lang = patch_lang
    ti.GridExecutor.__call__ = grid_call
    return True


def _git(*args: str, cwd: Path = ROOT) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_commit(cwd: Path = ROOT) -> str | None:
    """The HEAD commit of the repository holding this file, or None outside git."""
    out = _git("rev-parse", "HEAD", cwd=cwd)
    return out.strip() or None if out else None


def git_dirty_files(cwd: Path = ROOT, exclude: Path | None = None) -> list[str] | None:
    """Repository-relative paths of tracked files with uncommitted changes (staged or not, both sides of a
    rename) and of untracked, non-ignored files; `exclude` (an absolute path) is left out. None outside git."""
    top = _git("rev-parse", "--show-toplevel", cwd=cwd)
    out = _git("status", "--porcelain=v1", "-z", "--untracked-files=all", cwd=cwd)
    if top is None or out is None:
        return None
    top_dir = Path(top.strip())
    entries = out.split("\0")
    files, i = [], 0
    while i < len(entries):
        entry, i = entries[i], i + 1
        if not entry:
            continue
        files.append(entry[3:])
        if "R" in entry[:2] or "C" in entry[:2]:  # -z: the source path follows as its own entry
            files.append(entries[i])
            i += 1
    skip = exclude.resolve() if exclude is not None else None
    return sorted({f for f in files if (top_dir / f).resolve() != skip})


def _report_file(config) -> Path | None:
    path = getattr(config.option, "json_report_file", None) if getattr(config.option, "json_report", False) else None
    return Path(config.invocation_params.dir, path).resolve() if path else None


def pytest_sessionstart(session):
    _start["report"] = _report_file(session.config)
    _start["commit"] = git_commit()
    _start["dirty"] = git_dirty_files(exclude=_start["report"])


def pytest_deselected(items):
    _deselected.update(item.nodeid for item in items if item.get_closest_marker("hardstop") is not None)


@pytest.fixture
def seed(request) -> int:
    """Deterministic seed derived from the test id; also seeds torch's global generator."""
    import torch

    from dsv4.testing import seed_for

    s = seed_for(request.node.nodeid)
    torch.manual_seed(s)
    return s


def pytest_runtest_logreport(report):
    if "hardstop" not in report.keywords:
        return
    if report.when == "call" or report.failed or (report.when == "setup" and report.skipped):
        prev = _hardstop.get(report.nodeid)
        if prev != "failed":
            _hardstop[report.nodeid] = report.outcome


def _failed_hardstops() -> list[str]:
    return sorted(n for n, o in _hardstop.items() if o == "failed")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    failed = _failed_hardstops()
    if not failed:
        return
    tr = terminalreporter
    tr.write_line("")
    tr.write_sep("#", "HARD STOP", red=True, bold=True)
    for n in failed:
        tr.write_line(f"  FAILED hard-stop test: {n}", red=True, bold=True)
    tr.write_line(f"  Rule: {HARD_STOP_RULE}.", red=True, bold=True)
    tr.write_sep("#", "HARD STOP", red=True, bold=True)


@pytest.hookimpl(optionalhook=True)
def pytest_json_modifyreport(json_report):
    failed = _failed_hardstops()
    json_report["hardstop"] = {
        "tests": sorted(_hardstop),
        "failed": failed,
        "deselected": sorted(_deselected),
        "passed": not failed and bool(_hardstop) and not _deselected,
        "rule": HARD_STOP_RULE,
    }
    start_commit, start_dirty = _start.get("commit"), _start.get("dirty")
    end_commit = git_commit()
    end_dirty = git_dirty_files(exclude=_start.get("report"))
    json_report["git_commit"] = start_commit if start_commit == end_commit else None
    if start_dirty is None or end_dirty is None:
        json_report["git_dirty"], json_report["git_dirty_files"] = None, []
    else:
        dirty = sorted(set(start_dirty) | set(end_dirty))
        json_report["git_dirty"], json_report["git_dirty_files"] = bool(dirty), dirty
