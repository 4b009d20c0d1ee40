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
