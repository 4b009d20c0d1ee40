"""Throwaway git repositories and pytest-json-report files for the `dsv4 gate` tests (test_gate*.py).

`make_repo` builds a repository whose first commit, tagged `base`, protects `kernels/**`, `dsv4/model.py`,
`tests/**` and `**/conftest.py`. `write_report` writes a report in the exact shape the root conftest.py plus
pytest-json-report produce. `add_pytest_plumbing` puts a copy of our root conftest.py and a trivial
hard-stop test file in a repository, so the gate's real pytest subprocesses (the run at HEAD, the
collection at the merge base) can be exercised in about a second each.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from dsv4 import gate

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = """\
[tool.pytest.ini_options]
addopts = "--strict-markers"
markers = ["hardstop: decisive test", "gpu: cuda", "slow: slow", "mutants: mutants"]

[tool.dsv4.gate]
protected = ["kernels/**", "dsv4/model.py", "tests/**", "**/conftest.py"]
"""
HS_TEST = "tests/unit/test_hs.py::test_kernel_value"
TRIVIAL_TEST = """\
import pytest
from pathlib import Path


@pytest.mark.hardstop
def test_kernel_value():
    assert Path("kernels/add.py").read_text() == "X = 1\\n", "kernels/add.py changed its value"


@pytest.mark.hardstop
def test_model_value():
    assert Path("dsv4/model.py").read_text() == "M = 1\\n", "dsv4/model.py changed its value"


def test_unrelated_failure_does_not_count():
    assert False
"""
HS_TESTS = ["tests/unit/test_hs.py::test_kernel_value", "tests/unit/test_hs.py::test_model_value"]


def git(repo: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(cmd, cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def commit(repo: Path, files: dict[str, str | None], msg: str = "change") -> str:
    """Write (or, for None, delete) `files`, commit everything, return the new HEAD."""
    for name, text in files.items():
        p = repo / name
        if text is None:
            p.unlink()
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", msg)
    return git(repo, "rev-parse", "HEAD")


def make_repo(where: Path) -> Path:
    """A repository in `where`/repo whose first commit is tagged `base`."""
    r = where / "repo"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    commit(r, {"pyproject.toml": PYPROJECT, ".gitignore": "__pycache__/\n", "kernels/add.py": "X = 1\n",
               "dsv4/model.py": "M = 1\n", "docs/notes.md": "notes\n"}, "base")
    git(r, "tag", "base")
    return r


def add_pytest_plumbing(repo: Path, monkeypatch) -> None:
    """Commit our root conftest.py and TRIVIAL_TEST into `repo`, re-tag `base` there, chdir into it, and make
    pytest subprocesses load only pytest-json-report (faster start; the gate's command line is unchanged)."""
    shutil.copy(ROOT / "conftest.py", repo / "conftest.py")
    commit(repo, {"tests/unit/test_hs.py": TRIVIAL_TEST}, "hard-stop tests")
    git(repo, "tag", "-f", "base")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTEST_PLUGINS", "pytest_jsonreport.plugin")
    monkeypatch.chdir(repo)


def write_report(path: Path, commit_id: str | None, outcomes: dict[str, str], **extra) -> Path:
    """A pytest-json-report file of a clean `-m hardstop` run whose tests had `outcomes`, in conftest's shape;
    `extra` replaces top-level keys."""
    failed = sorted(n for n, o in outcomes.items() if o == "failed")
    counts: dict[str, int] = {}
    for o in outcomes.values():
        counts[o] = counts.get(o, 0) + 1
    report = {
        "exitcode": 1 if failed else 0,
        "summary": {**counts, "total": len(outcomes), "collected": len(outcomes)},
        "collectors": [{"nodeid": "", "outcome": "passed", "result": []}],
        "tests": [{"nodeid": n, "outcome": o, "keywords": [n.split("::")[-1], "hardstop"]} for n, o in outcomes.items()],
        "hardstop": {"tests": sorted(outcomes), "failed": failed, "deselected": [],
                     "passed": not failed and bool(outcomes), "rule": gate.HARD_STOP_RULE},
        "git_commit": commit_id,
        "git_dirty": False,
        "git_dirty_files": [],
    }
    report.update(extra)
    path.write_text(json.dumps(report))
    return path


def never_run(repo, report_file):
    raise AssertionError("the gate ran the hard-stop tests although it did not need to")


def no_base_tests(repo, commit_id):
    return []
