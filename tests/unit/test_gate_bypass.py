"""`dsv4 gate` end to end, and the bypasses a hostile tester found, each reproduced and now BLOCKED.

Each test uses a throwaway repository holding a copy of our root conftest.py and two trivial hard-stop
tests (gate_support.TRIVIAL_TEST: they pass while kernels/add.py and dsv4/model.py hold their base values).
The gate runs for real: it collects the hard-stop tests of the merge base in a temporary worktree and runs
them at HEAD, each a pytest subprocess of about a second.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4 import gate
from dsv4.gate import collect_hardstop_ids, evaluate, run_gate
from tests.unit.gate_support import (HS_TEST, HS_TESTS, PYPROJECT, TRIVIAL_TEST, add_pytest_plumbing, commit, git,
                                     make_repo, never_run)

pytestmark = pytest.mark.hardstop  # the gate itself: a change must not weaken it and pass in the same step

DESELECTING_CONFTEST = {  # tests/unit/conftest.py bodies that drop the hard-stop test of kernels/add.py
    "hook": """\
def pytest_collection_modifyitems(config, items):
    dropped = [i for i in items if "kernel" in i.nodeid]
    items[:] = [i for i in items if i not in dropped]
    config.hook.pytest_deselected(items=dropped)
""",
    "silent": """\
def pytest_collection_modifyitems(config, items):
    items[:] = [i for i in items if "kernel" not in i.nodeid]
""",
}


@pytest.fixture
def repo(tmp_path: Path, monkeypatch) -> Path:
    r = make_repo(tmp_path)
    add_pytest_plumbing(r, monkeypatch)
    return r


def pytest_report(repo: Path, out: Path) -> dict:
    """Run the gate's hard-stop command by hand in `repo`, writing the JSON report to `out`; return it."""
    subprocess.run([sys.executable, "-m", "pytest", *gate.PYTEST_ARGS, "--json-report", f"--json-report-file={out}"],
                   cwd=repo, capture_output=True, check=False)
    return json.loads(out.read_text())


def test_collect_hardstop_ids_at_a_commit_leaves_no_worktree(repo: Path):
    base = git(repo, "rev-parse", "HEAD")
    commit(repo, {"tests/unit/test_hs.py": None}, "drop the hard-stop tests")
    assert collect_hardstop_ids(repo, base) == HS_TESTS  # the file is gone at HEAD, not at base
    assert git(repo, "worktree", "list").count("\n") == 0  # only the main worktree
    assert collect_hardstop_ids(repo, git(repo, "rev-parse", "HEAD~2")) == []  # no tests/unit there


def test_end_to_end_red_then_green_then_stale(repo: Path, tmp_path: Path, capsys):
    commit(repo, {"kernels/add.py": "X = 2\n"}, "break the kernel")
    assert run_gate("base", None) == gate.EXIT_BLOCKED
    out = capsys.readouterr().out
    assert "HARD STOP" in out and f"{HS_TEST} (failed)" in out and gate.HARD_STOP_RULE in out
    assert "test_unrelated_failure_does_not_count (" not in out

    # A legitimate protected change (kernel, test file, conftest) with every base hard-stop test green.
    head = commit(repo, {"kernels/add.py": "X = 1\n", "kernels/extra.py": "Z = 0\n",
                         "tests/unit/test_hs.py": TRIVIAL_TEST + "\n\ndef test_more():\n    pass\n",
                         "tests/unit/conftest.py": "# nothing yet\n"}, "fix the kernel, add a test")
    assert run_gate("base", None) == 0
    said = " ".join(capsys.readouterr().out.split())  # the console wraps at the terminal's (or COLUMNS') width
    assert f"green hard-stop run for HEAD {head[:12]} (2 test(s) passed, including all 2" in said

    rep = tmp_path / "hs.json"
    assert pytest_report(repo, rep)["git_commit"] == head
    assert evaluate("base", rep, repo, runner=never_run).allowed
    commit(repo, {"kernels/extra.py": "Z = 1\n"}, "later")
    assert "stale" in evaluate("base", rep, repo, runner=never_run).reason


@pytest.mark.parametrize("route", ["hook", "silent", "addopts"])
def test_bypass_1_deselecting_a_hardstop_test_is_blocked(repo: Path, capsys, route: str):
    """A new tests/unit/conftest.py (or pyproject addopts) hides the red hard-stop test of a broken kernel."""
    if route == "addopts":
        change = {"pyproject.toml": PYPROJECT.replace('"--strict-markers"', f'"--strict-markers --deselect {HS_TEST}"')}
    else:
        change = {"tests/unit/conftest.py": DESELECTING_CONFTEST[route]}
    commit(repo, {"kernels/add.py": "X = 2\n", **change}, f"break the kernel, hide its test ({route})")
    d = evaluate("base", None, repo)
    assert not d.allowed and gate.REMOVAL_RULE in d.reason, d
    hidden = f"{HS_TEST} (deselected)" if route != "silent" else \
        f"{HS_TEST} (missing: a hard-stop test of the base that did not run)"
    assert d.failing_tests == [hidden], d
    assert run_gate("base", None) == gate.EXIT_BLOCKED
    assert HS_TEST in capsys.readouterr().out


def test_renamed_hardstop_test_is_blocked_naming_the_old_id(repo: Path):
    commit(repo, {"tests/unit/test_hs.py": TRIVIAL_TEST.replace("def test_kernel_value", "def test_kernel_v2")},
           "rename a hard-stop test")
    d = evaluate("base", None, repo)
    assert not d.allowed and gate.REMOVAL_RULE in d.reason, d
    assert d.failing_tests == [f"{HS_TEST} (missing: a hard-stop test of the base that did not run)"]


def test_bypass_2_report_made_from_a_dirty_tree_is_blocked(repo: Path, capsys):
    """Commit the broken model, restore the good one uncommitted, make a green report, check the file out."""
    broken = commit(repo, {"dsv4/model.py": "M = 2\n"}, "break the model")
    (repo / "dsv4/model.py").write_text("M = 1\n")
    rep = repo / "dirty.json"  # untracked, inside the repository: the conftest leaves the report itself out
    report = pytest_report(repo, rep)
    assert report["hardstop"]["passed"] is True and report["git_commit"] == broken
    assert report["git_dirty"] is True and report["git_dirty_files"] == ["dsv4/model.py"]
    git(repo, "checkout", "--", "dsv4/model.py")
    d = evaluate("base", rep, repo, runner=never_run)
    assert not d.allowed and "uncommitted or untracked files (dsv4/model.py)" in d.reason, d
    assert run_gate("base", rep) == gate.EXIT_BLOCKED
    assert "BLOCKED" in capsys.readouterr().out

    rep.unlink()  # the same steps with the tree clean: the model is red
    assert pytest_report(repo, rep)["git_dirty"] is False
    rep.unlink()
    assert evaluate("base", None, repo).failing_tests == ["tests/unit/test_hs.py::test_model_value (failed)"]
