"""The root conftest.py's HARD STOP banner and JSON hard-stop summary (issue 5, item 5).

Each case runs pytest in a subprocess on a tmp directory holding a copy of our root conftest.py and a small
test file, so the hooks run exactly as in a real session (one session per process, as the conftest assumes).
Plugin autoloading is off and only pytest-json-report is loaded, to keep each run well under a second.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.hardstop  # the report fields `dsv4 gate` trusts: a change must not weaken them

ROOT = Path(__file__).resolve().parents[2]
RULE = "no kernel, mHC or residual change is authorized until these pass"
INI = """\
[tool.pytest.ini_options]
addopts = "--strict-markers"
markers = ["hardstop: decisive test", "gpu: cuda", "slow: slow", "mutants: mutants"]
"""
MIXED = """\
import pytest


@pytest.fixture
def broken():
    raise RuntimeError("setup broke")


@pytest.mark.hardstop
def test_hs_fails():
    assert 1 + 1 == 3


@pytest.mark.hardstop
def test_hs_passes():
    assert 1 + 1 == 2


@pytest.mark.hardstop
def test_hs_skips():
    pytest.skip("no device")


@pytest.mark.hardstop
def test_hs_setup_error(broken):
    pass


@pytest.mark.hardstop
@pytest.mark.parametrize("n", [1, 2])
def test_hs_param(n):
    assert n == 1


def test_plain_fails():
    assert False
"""
GREEN = """\
import pytest


@pytest.mark.hardstop
def test_hs_passes():
    assert 1 + 1 == 2


def test_plain_fails():
    assert False
"""
MOVES_HEAD = """\
import subprocess


def test_commits_during_the_run():
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "moved"], check=True)
"""


def run_pytest(where: Path, test_src: str, git: bool, args: tuple[str, ...] = (),
               dirty: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, dict, str | None]:
    """Run pytest with our conftest on `test_src` in `where` (committed to a fresh git repository when `git`,
    then `dirty` files written uncommitted); return the process, the JSON report and HEAD."""
    where.mkdir()
    shutil.copy(ROOT / "conftest.py", where / "conftest.py")
    (where / "pyproject.toml").write_text(INI)
    (where / "test_x.py").write_text(test_src)
    (where / ".gitignore").write_text("__pycache__/\n")
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTEST_PLUGINS": "pytest_jsonreport.plugin",
           "GIT_CEILING_DIRECTORIES": str(where.parent), "COLUMNS": "200"}
    head = None
    if git:
        g = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false"]
        subprocess.run([*g, "init", "-q"], cwd=where, check=True)
        subprocess.run([*g, "add", "-A"], cwd=where, check=True)
        subprocess.run([*g, "commit", "-q", "-m", "x"], cwd=where, check=True)
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, check=True, capture_output=True,
                              text=True).stdout.strip()
    for name, text in (dirty or {}).items():
        (where / name).write_text(text)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--json-report",
                           "--json-report-file=report.json", *args], cwd=where, env=env, capture_output=True,
                          text=True)
    report = json.loads((where / "report.json").read_text())
    return proc, report, head


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return run_pytest(tmp_path_factory.mktemp("banner") / "mixed", MIXED, git=True)


@pytest.fixture(scope="module")
def green(tmp_path_factory):
    return run_pytest(tmp_path_factory.mktemp("banner") / "green", GREEN, git=False)


@pytest.fixture(scope="module")
def dirty_deselected(tmp_path_factory):
    """GREEN committed, then edited and a note added uncommitted; a stale report.json from an earlier run
    lies in the tree; `-k` deselects the hard-stop test and a plain one."""
    dirty = {"test_x.py": GREEN + "\n\ndef test_plain_passes():\n    pass\n", "notes.txt": "scratch\n",
             "report.json": "{}"}
    return run_pytest(tmp_path_factory.mktemp("banner") / "dirty", GREEN, git=True, dirty=dirty,
                      args=("-k", "not test_hs_passes and not test_plain_fails"))


def banner_lines(out: str) -> list[str]:
    """The lines between the two HARD STOP separators (empty when there is no banner)."""
    lines = out.splitlines()
    seps = [i for i, line in enumerate(lines) if line.startswith("#") and " HARD STOP " in line]
    assert len(seps) in (0, 2), out
    return lines[seps[0] + 1:seps[1]] if seps else []


def test_failing_hardstop_tests_get_the_banner_with_names_and_rule(mixed):
    proc, _, _ = mixed
    assert proc.returncode == 1, proc.stdout
    assert banner_lines(proc.stdout) == [
        "  FAILED hard-stop test: test_x.py::test_hs_fails",
        "  FAILED hard-stop test: test_x.py::test_hs_param[2]",
        "  FAILED hard-stop test: test_x.py::test_hs_setup_error",
        f"  Rule: {RULE}.",
    ]


def test_json_report_hardstop_summary_and_commit(mixed):
    _, report, head = mixed
    assert report["hardstop"] == {
        "tests": ["test_x.py::test_hs_fails", "test_x.py::test_hs_param[1]", "test_x.py::test_hs_param[2]",
                  "test_x.py::test_hs_passes", "test_x.py::test_hs_setup_error", "test_x.py::test_hs_skips"],
        "failed": ["test_x.py::test_hs_fails", "test_x.py::test_hs_param[2]", "test_x.py::test_hs_setup_error"],
        "deselected": [],
        "passed": False,
        "rule": RULE,
    }
    assert head and report["git_commit"] == head
    assert report["git_dirty"] is False and report["git_dirty_files"] == []  # __pycache__/ is ignored
    outcomes = {t["nodeid"]: t["outcome"] for t in report["tests"]}
    assert outcomes["test_x.py::test_hs_skips"] == "skipped"  # what `dsv4 gate` cross-checks: skipped is not green
    assert outcomes["test_x.py::test_hs_setup_error"] == "error"


def test_passing_hardstop_and_failing_plain_test_give_no_banner(green):
    proc, report, _ = green
    assert proc.returncode == 1, proc.stdout  # test_plain_fails did fail ...
    assert "test_plain_fails" in proc.stdout
    assert "HARD STOP" not in proc.stdout and banner_lines(proc.stdout) == []  # ... but it is not a hard stop
    assert report["hardstop"] == {"tests": ["test_x.py::test_hs_passes"], "failed": [], "deselected": [],
                                  "passed": True, "rule": RULE}
    assert report["git_commit"] is None and report["git_dirty"] is None  # outside a git repository


def test_dirty_tree_and_deselected_hardstop_tests_are_recorded(dirty_deselected):
    proc, report, head = dirty_deselected
    assert proc.returncode == 0, proc.stdout  # only test_plain_passes ran
    assert report["git_commit"] == head
    assert report["git_dirty"] is True and report["git_dirty_files"] == ["notes.txt", "test_x.py"]  # not report.json
    assert report["hardstop"] == {"tests": [], "failed": [], "deselected": ["test_x.py::test_hs_passes"],
                                  "passed": False, "rule": RULE}


def test_head_moving_during_the_run_leaves_the_report_without_a_commit(tmp_path):
    proc, report, head = run_pytest(tmp_path / "moves", MOVES_HEAD, git=True)
    assert proc.returncode == 0, proc.stdout
    assert head and report["git_commit"] is None  # the start commit is not what the tree holds at the end
