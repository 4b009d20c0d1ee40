"""`dsv4 gate` on throwaway git repositories (issue 5, item 5).

Each test builds a repository in a tmp dir with a pyproject.toml protecting `kernels/**` and
`dsv4/model.py`, commits a change, and checks the decision. Reports are written in the exact shape the root
conftest.py plus pytest-json-report produce; `test_end_to_end_*` makes them for real by running pytest with
a copy of our root conftest.py on a trivial test file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4 import gate
from dsv4.gate import GateError, evaluate, match_protected, protected_patterns, run_gate

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = """\
[tool.pytest.ini_options]
addopts = "--strict-markers"
markers = ["hardstop: decisive test", "gpu: cuda", "slow: slow", "mutants: mutants"]

[tool.dsv4.gate]
protected = ["kernels/**", "dsv4/model.py"]
"""
HS_TEST = "tests/unit/test_hs.py::test_kernel_value"


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


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository whose first commit is tagged `base`."""
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    commit(r, {"pyproject.toml": PYPROJECT, ".gitignore": "__pycache__/\n", "kernels/add.py": "X = 1\n",
               "dsv4/model.py": "M = 1\n", "docs/notes.md": "notes\n"}, "base")
    git(r, "tag", "base")
    return r


def write_report(path: Path, commit_id: str | None, outcomes: dict[str, str], **extra) -> Path:
    """A pytest-json-report file of a `-m hardstop` run whose tests had `outcomes`, in conftest's shape."""
    failed = sorted(n for n, o in outcomes.items() if o == "failed")
    counts: dict[str, int] = {}
    for o in outcomes.values():
        counts[o] = counts.get(o, 0) + 1
    report = {
        "exitcode": 1 if failed else 0,
        "summary": {**counts, "total": len(outcomes), "collected": len(outcomes)},
        "collectors": [{"nodeid": "", "outcome": "passed", "result": []}],
        "tests": [{"nodeid": n, "outcome": o, "keywords": [n.split("::")[-1], "hardstop"]} for n, o in outcomes.items()],
        "hardstop": {"tests": sorted(outcomes), "failed": failed, "passed": not failed and bool(outcomes),
                     "rule": gate.HARD_STOP_RULE},
        "git_commit": commit_id,
    }
    report.update(extra)
    path.write_text(json.dumps(report))
    return path


def never_run(repo, report_file):
    raise AssertionError("the gate ran the hard-stop tests although it did not need to")


@pytest.mark.parametrize("path, pattern, expected", [
    ("kernels/add.py", "kernels/**", True),
    ("kernels/sub/deep/k.py", "kernels/**", True),
    ("dsv4/kernels/add.py", "kernels/**", False),
    ("kernelsx/add.py", "kernels/**", False),
    ("dsv4/model.py", "dsv4/*.py", True),
    ("dsv4/sub/model.py", "dsv4/*.py", False),
    ("dsv4/model.py", "dsv4/model.py", True),
    ("dsv4/model.pyc", "dsv4/model.py", False),
    ("Dsv4/model.py", "dsv4/model.py", False),
    ("attention.py", "**/attention.py", True),
    ("a/b/attention.py", "**/attention.py", True),
    ("dsv4/mhc_12.py", "dsv4/mhc?2.py", False),
    ("dsv4/x.py", "dsv4?x.py", False),
    ("dsv4/mhc_2.py", "dsv4/mhc?[0-9].py", True),
])
def test_match_protected_glob_semantics(path, pattern, expected):
    assert match_protected([path], [pattern]) == ([path] if expected else [])


def test_protected_patterns_read_and_validated(repo: Path):
    assert protected_patterns(repo) == ["kernels/**", "dsv4/model.py"]
    bad = {"protected = []": "non-empty list", 'protected = "kernels/**"': "non-empty list",
           'protected = ["/kernels/**"]': "'/kernels/**'", "protected = [3]": "3", "[oops": "not valid TOML"}
    for body, needle in bad.items():
        (repo / "pyproject.toml").write_text(f"[tool.dsv4.gate]\n{body}\n")
        with pytest.raises(GateError, match="pyproject.toml") as e:
            protected_patterns(repo)
        assert needle in str(e.value)
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    with pytest.raises(GateError, match=r"\[tool.dsv4.gate\] protected"):
        protected_patterns(repo)


def test_changed_files_committed_dirty_untracked_and_renames(repo: Path):
    commit(repo, {"docs/new.md": "n\n"})
    git(repo, "mv", "kernels/add.py", "moved.py")  # staged rename out of a protected path
    (repo / "docs/notes.md").write_text("edited\n")  # unstaged
    (repo / "scratch.txt").write_text("untracked\n")
    (repo / "__pycache__").mkdir()
    (repo / "__pycache__/x.pyc").write_text("ignored\n")
    assert gate.changed_files("base", repo) == ["docs/new.md", "docs/notes.md", "kernels/add.py", "moved.py",
                                                 "scratch.txt"]


def test_unknown_base_ref_is_a_usage_error(repo: Path, monkeypatch, capsys):
    with pytest.raises(GateError, match="'no-such-branch'"):
        gate.changed_files("no-such-branch", repo)
    monkeypatch.chdir(repo)
    assert run_gate("no-such-branch", None) == gate.EXIT_USAGE == 2
    assert "'no-such-branch' names no commit" in capsys.readouterr().err


def test_unprotected_change_allowed_without_a_report(repo: Path, monkeypatch, capsys):
    commit(repo, {"docs/notes.md": "more notes\n", "dsv4/cli.py": "C = 1\n"})
    d = evaluate("base", None, repo, runner=never_run)
    assert d.allowed and d.protected_changes == [], d
    monkeypatch.chdir(repo)
    monkeypatch.setattr(gate, "run_hardstop_tests", never_run)
    assert run_gate("base", None) == 0
    assert "ALLOWED" in capsys.readouterr().out


def test_protected_change_with_red_report_is_blocked(repo: Path, tmp_path: Path, monkeypatch, capsys):
    head = commit(repo, {"kernels/add.py": "X = 2\n"})
    rep = write_report(tmp_path / "r.json", head, {HS_TEST: "failed", "tests/unit/test_hs.py::test_ok": "passed"})
    monkeypatch.chdir(repo)
    assert run_gate("base", rep) == gate.EXIT_BLOCKED == 3
    out = capsys.readouterr().out
    assert "BLOCKED" in out and f"{HS_TEST} (failed)" in out and "kernels/add.py" in out
    assert gate.HARD_STOP_RULE in out and "test_ok" not in out


def test_protected_change_with_green_report_for_head_is_allowed(repo: Path, tmp_path: Path, monkeypatch, capsys):
    head = commit(repo, {"kernels/add.py": "X = 2\n", "dsv4/model.py": "M = 2\n"})
    rep = write_report(tmp_path / "r.json", head, {HS_TEST: "passed"})
    d = evaluate("base", rep, repo, runner=never_run)
    assert d.allowed and d.protected_changes == ["dsv4/model.py", "kernels/add.py"]
    assert d.report_commit == d.head_commit == head
    monkeypatch.chdir(repo)
    assert run_gate("base", rep) == 0
    assert "ALLOWED" in capsys.readouterr().out


def test_stale_report_is_blocked(repo: Path, tmp_path: Path):
    old = commit(repo, {"kernels/add.py": "X = 2\n"})
    rep = write_report(tmp_path / "r.json", old, {HS_TEST: "passed"})
    head = commit(repo, {"kernels/add.py": "X = 3\n"})
    d = evaluate("base", rep, repo, runner=never_run)
    assert not d.allowed and "stale" in d.reason and old in d.reason and head in d.reason


@pytest.mark.parametrize("case, needle", [
    ("missing", "missing or unreadable"),
    ("garbled", "not JSON"),
    ("list", "top level is list"),
    ("no_summary", "no hard-stop summary"),
    ("no_tests", "no hard-stop test ran"),
    ("skipped", f"{HS_TEST} (skipped)"),
    ("no_commit", "names no git commit"),
    ("not_in_tests", f"{HS_TEST} (no result in report)"),
    ("collection_error", "collection errors in tests/unit/test_broken.py"),
    ("stopped_early", "stopped early: 1 of 3"),
    ("interrupted", "exit status 2"),
])
def test_bad_reports_fail_closed(repo: Path, tmp_path: Path, case: str, needle: str):
    head = commit(repo, {"kernels/add.py": "X = 2\n"})
    p = tmp_path / "r.json"
    green = {HS_TEST: "passed"}
    if case == "garbled":
        p.write_text('{"hardstop": {"tests": [')
    elif case == "list":
        p.write_text("[]")
    elif case == "no_summary":
        write_report(p, head, green)
        p.write_text(json.dumps({k: v for k, v in json.loads(p.read_text()).items() if k != "hardstop"}))
    elif case == "no_tests":
        write_report(p, head, {})
    elif case == "skipped":
        write_report(p, head, {HS_TEST: "skipped"})
    elif case == "no_commit":
        write_report(p, None, green)
    elif case == "not_in_tests":
        write_report(p, head, green, tests=[])
    elif case == "collection_error":
        write_report(p, head, green, collectors=[{"nodeid": "tests/unit/test_broken.py", "outcome": "failed"}])
    elif case == "stopped_early":
        write_report(p, head, green, summary={"passed": 1, "total": 1, "collected": 5, "deselected": 2})
    elif case == "interrupted":
        write_report(p, head, green, exitcode=2)
    d = evaluate("base", p, repo, runner=never_run)
    assert not d.allowed, d
    assert needle in d.reason or needle in d.failing_tests, d


def test_uncommitted_protected_change_is_blocked_even_with_green_report(repo: Path, tmp_path: Path):
    head = commit(repo, {"kernels/add.py": "X = 2\n"})
    rep = write_report(tmp_path / "r.json", head, {HS_TEST: "passed"})
    assert evaluate("base", rep, repo, runner=never_run).allowed
    (repo / "kernels/new.py").write_text("Y = 1\n")  # untracked, under kernels/
    d = evaluate("base", rep, repo, runner=never_run)
    assert not d.allowed and "uncommitted" in d.reason and "kernels/new.py" in d.reason


def test_change_cannot_drop_its_own_protection(repo: Path):
    commit(repo, {"pyproject.toml": PYPROJECT.replace('"kernels/**", ', ""), "kernels/add.py": "X = 2\n"})
    assert protected_patterns(repo) == ["dsv4/model.py"]
    d = evaluate("base", repo / "absent.json", repo, runner=never_run)
    assert not d.allowed and d.protected_changes == ["kernels/add.py"], d


TRIVIAL_TEST = """\
import pytest
from pathlib import Path


@pytest.mark.hardstop
def test_kernel_value():
    assert Path("kernels/add.py").read_text() == "X = 1\\n", "kernels/add.py changed its value"


def test_unrelated_failure_does_not_count():
    assert False
"""


def test_end_to_end_conftest_report_gate(repo: Path, tmp_path: Path, monkeypatch, capsys):
    """Real chain: our root conftest.py in the repo, the gate runs pytest itself, reads its JSON report."""
    shutil.copy(ROOT / "conftest.py", repo / "conftest.py")
    commit(repo, {"tests/unit/test_hs.py": TRIVIAL_TEST}, "tests")
    git(repo, "tag", "-f", "base")
    # Faster startup: only the json-report plugin (the gate's command line is unchanged).
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTEST_PLUGINS", "pytest_jsonreport.plugin")
    monkeypatch.chdir(repo)

    commit(repo, {"kernels/add.py": "X = 2\n"}, "break the kernel")
    assert run_gate("base", None) == gate.EXIT_BLOCKED
    out = capsys.readouterr().out
    assert "HARD STOP" in out and f"{HS_TEST} (failed)" in out and gate.HARD_STOP_RULE in out
    assert "test_unrelated_failure_does_not_count (" not in out

    head = commit(repo, {"kernels/add.py": "X = 1\n", "kernels/extra.py": "Z = 0\n"}, "fix the kernel")
    assert run_gate("base", None) == 0
    assert f"green hard-stop run for HEAD {head[:12]}" in capsys.readouterr().out

    # The same report, made explicitly, is accepted for HEAD and refused once HEAD moves on.
    rep = tmp_path / "hs.json"
    subprocess.run([sys.executable, "-m", "pytest", *gate.PYTEST_ARGS, "--json-report",
                    f"--json-report-file={rep}"], cwd=repo, capture_output=True, check=False)
    assert json.loads(rep.read_text())["git_commit"] == head
    assert evaluate("base", rep, repo, runner=never_run).allowed
    commit(repo, {"kernels/extra.py": "Z = 1\n"}, "later")
    assert "stale" in evaluate("base", rep, repo, runner=never_run).reason
