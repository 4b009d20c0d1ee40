"""Root pytest configuration: per-test seeds, the HARD STOP banner and the JSON report's hard-stop summary.

A failing test marked `hardstop` ends the run with a banner naming the tests and the rule. When
pytest-json-report is active (`--json-report`), the report gains `hardstop` (tests, failures, passed) and
`git_commit`, which `dsv4 gate` reads.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
HARD_STOP_RULE = "no kernel, mHC or residual change is authorized until these pass"

_hardstop: dict[str, str] = {}

def pytest_configure(config):
    # The CPU tests run tiny models: intra-op threading costs far more than it gains (measured 14x slower
    # per decode step with 2 threads on a loaded 2-core machine), so run torch single-threaded.
    import torch

    torch.set_num_threads(1)
  # nodeid -> outcome; per-session (pytest runs one session per process)


def git_commit(cwd: Path = ROOT) -> str | None:
    """The HEAD commit of the repository holding this file, or None outside git."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


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
        "passed": not failed and bool(_hardstop),
        "rule": HARD_STOP_RULE,
    }
    json_report["git_commit"] = git_commit()
