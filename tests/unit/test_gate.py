"""`dsv4 gate` on throwaway git repositories (issue 5, item 5): path matching, changed files and the checks
of a hard-stop report, on reports written in conftest's exact shape (gate_support.py). The real pytest chain
(our conftest, the gate's own runs at HEAD and at the merge base, the bypasses it closes) is in
test_gate_bypass.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4 import gate
from dsv4.gate import (BaseCollectionError, GateError, evaluate, match_protected, protected_patterns,
                       run_gate)
from tests.unit.gate_support import (HS_TEST, PYPROJECT, ROOT, commit, git, make_repo, never_run, no_base_tests,
                                     write_report)

pytestmark = pytest.mark.hardstop  # the gate itself: a change must not weaken it and pass in the same step


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path)


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
    assert protected_patterns(repo) == ["kernels/**", "dsv4/model.py", "tests/**", "**/conftest.py"]
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


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", "٣", " "])
def test_a_bad_gate_jobs_value_is_a_usage_error_before_any_work(repo: Path, monkeypatch, capsys, value):
    """$DSV4_GATE_JOBS was int()'d deep in the run: "abc" ended in a traceback (exit 1) after the git work, and 0
    or a negative value silently ran the whole hard-stop suite in one process. Now any value but an integer >= 1
    (or unset / empty: the default) is exit 2 naming the variable, before the git diff (control: the same run
    with a good value reaches the diff and reports the unknown base ref instead)."""
    commit(repo, {"kernels/add.py": "X = 2\n"})
    monkeypatch.chdir(repo)
    monkeypatch.setenv("DSV4_GATE_JOBS", value)
    assert run_gate("no-such-branch", None) == gate.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"DSV4_GATE_JOBS={value!r}: expected an integer >= 1" in err and "no-such-branch" not in err
    monkeypatch.setenv("DSV4_GATE_JOBS", "3")
    assert gate.gate_jobs() == 3
    assert run_gate("no-such-branch", None) == gate.EXIT_USAGE
    assert "'no-such-branch' names no commit" in capsys.readouterr().err
    monkeypatch.setenv("DSV4_GATE_JOBS", "")
    assert gate.gate_jobs() == min(2, __import__("os").cpu_count() or 1)


def test_unprotected_change_allowed_without_a_report(repo: Path, monkeypatch, capsys):
    commit(repo, {"docs/notes.md": "more notes\n", "dsv4/cli.py": "C = 1\n"})
    d = evaluate("base", None, repo, runner=never_run, collector=no_base_tests)
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
    d = evaluate("base", rep, repo, runner=never_run, collector=no_base_tests)
    assert d.allowed and d.protected_changes == ["dsv4/model.py", "kernels/add.py"]
    assert d.report_commit == d.head_commit == head
    monkeypatch.chdir(repo)
    assert run_gate("base", rep) == 0
    assert "ALLOWED" in capsys.readouterr().out


def test_stale_report_is_blocked(repo: Path, tmp_path: Path):
    old = commit(repo, {"kernels/add.py": "X = 2\n"})
    rep = write_report(tmp_path / "r.json", old, {HS_TEST: "passed"})
    head = commit(repo, {"kernels/add.py": "X = 3\n"})
    d = evaluate("base", rep, repo, runner=never_run, collector=no_base_tests)
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
    d = evaluate("base", p, repo, runner=never_run, collector=no_base_tests)
    assert not d.allowed, d
    assert needle in d.reason or needle in d.failing_tests, d


def test_uncommitted_protected_change_is_blocked_even_with_green_report(repo: Path, tmp_path: Path):
    head = commit(repo, {"kernels/add.py": "X = 2\n"})
    rep = write_report(tmp_path / "r.json", head, {HS_TEST: "passed"})
    assert evaluate("base", rep, repo, runner=never_run, collector=no_base_tests).allowed
    (repo / "kernels/new.py").write_text("Y = 1\n")  # untracked, under kernels/
    d = evaluate("base", rep, repo, runner=never_run, collector=no_base_tests)
    assert not d.allowed and "uncommitted" in d.reason and "kernels/new.py" in d.reason


def test_change_cannot_drop_its_own_protection(repo: Path):
    commit(repo, {"pyproject.toml": PYPROJECT.replace('"kernels/**", ', ""), "kernels/add.py": "X = 2\n"})
    assert protected_patterns(repo) == ["dsv4/model.py", "tests/**", "**/conftest.py"]
    d = evaluate("base", repo / "absent.json", repo, runner=never_run, collector=no_base_tests)
    assert not d.allowed and d.protected_changes == ["kernels/add.py"], d


@pytest.mark.parametrize("path", [
    "conftest.py", "tests/conftest.py", "tests/unit/conftest.py", "tests/gpu/conftest.py", "kernels/conftest.py",
    "tests/unit/test_generate_gate.py", "tests/unit/test_diagnose.py", "tests/unit/test_hardstop_banner.py",
    "tests/unit/test_gate.py", "tests/unit/test_final_norm.py", "tests/unit/test_brand_new.py",
    "tests/mutants/patches.py", "dsv4/diagnose.py", "dsv4/tokenizer.py", "dsv4/generate.py", "dsv4/resident.py",
    "dsv4/testing.py", "dsv4/model.py", "kernels/mhc.py", "pyproject.toml", "pytest.ini", "tox.ini", "setup.cfg",
    "fixtures/golden/dsv4_prompts.json", ".ci/run", ".github/workflows/gate.yml",
])
def test_repository_protects_everything_that_decides_a_hard_stop(path: str):
    """Our own pyproject.toml: every path the hostile tester changed unnoticed, and its neighbours."""
    assert match_protected([path], protected_patterns(ROOT)) == [path]


@pytest.mark.parametrize("path", ["README.md", "docs/mutants.md", "benchmarks/bench_mhc.py", "benchmarks/RESULTS.md"])
def test_repository_leaves_docs_and_benchmarks_unprotected(path: str):
    assert match_protected([path], protected_patterns(ROOT)) == []


def test_base_hardstop_test_missing_at_head_is_blocked_naming_it(repo: Path, tmp_path: Path):
    head = commit(repo, {"kernels/add.py": "X = 2\n"})
    gone = "tests/unit/test_hs.py::test_removed"
    rep = write_report(tmp_path / "r.json", head, {HS_TEST: "passed"})
    d = evaluate("base", rep, repo, runner=never_run, collector=lambda r, c: [HS_TEST, gone])
    assert not d.allowed and gate.REMOVAL_RULE in d.reason, d
    assert d.failing_tests == [f"{gone} (missing: a hard-stop test of the base that did not run)"]
    d = evaluate("base", rep, repo, runner=never_run, collector=lambda r, c: [HS_TEST])
    assert d.allowed and "including all 1 of merge base" in d.reason, d


def test_collector_sees_the_merge_base_not_the_tag(repo: Path, tmp_path: Path):
    fork = git(repo, "rev-parse", "HEAD")
    git(repo, "checkout", "-q", "-b", "side")
    head = commit(repo, {"kernels/add.py": "X = 2\n"})
    git(repo, "checkout", "-q", "main")
    commit(repo, {"docs/notes.md": "later on main\n"})
    git(repo, "tag", "-f", "base")
    git(repo, "checkout", "-q", "side")
    seen = []
    rep = write_report(tmp_path / "r.json", head, {HS_TEST: "passed"})
    assert evaluate("base", rep, repo, runner=never_run, collector=lambda r, c: seen.append(c) or []).allowed
    assert seen == [fork]


@pytest.mark.parametrize("case, needle", [
    ("deselected", f"{HS_TEST} (deselected)"),
    ("dirty", "uncommitted or untracked files (dsv4/model.py, notes.txt)"),
    ("dirty_unknown", "git_dirty missing"),
    ("new_test_fails", "tests/unit/test_new.py::test_new (failed)"),
])
def test_reports_that_do_not_vouch_for_a_clean_complete_run_are_blocked(repo: Path, tmp_path: Path, case, needle):
    head = commit(repo, {"kernels/add.py": "X = 2\n"})
    p = tmp_path / "r.json"
    green = {HS_TEST: "passed"}
    if case == "deselected":
        write_report(p, head, {}, hardstop={"tests": [], "failed": [], "deselected": [HS_TEST], "passed": False})
    elif case == "dirty":
        write_report(p, head, green, git_dirty=True, git_dirty_files=["dsv4/model.py", "notes.txt"])
    elif case == "dirty_unknown":
        write_report(p, head, green, git_dirty=None)
    elif case == "new_test_fails":
        write_report(p, head, {**green, "tests/unit/test_new.py::test_new": "failed"})
    d = evaluate("base", p, repo, runner=never_run, collector=lambda r, c: [HS_TEST])
    assert not d.allowed, d
    assert needle in d.reason or needle in d.failing_tests, d


def test_base_that_cannot_be_collected_blocks(repo: Path, tmp_path: Path):
    head = commit(repo, {"kernels/add.py": "X = 2\n"})
    rep = write_report(tmp_path / "r.json", head, {HS_TEST: "passed"})

    def broken(r, c):
        raise BaseCollectionError(f"collecting the hard-stop tests of base {c[:12]} failed (pytest exit status 2)")

    d = evaluate("base", rep, repo, runner=never_run, collector=broken)
    assert not d.allowed and "exit status 2" in d.reason, d


# ------------------------------------------------------------------------------------- sharded hard-stop runs
def test_shard_files_balance_whole_files_deterministically():
    files = [("a.py", 90), ("b.py", 50), ("c.py", 40), ("d.py", 10), ("e.py", 10)]
    groups = gate.shard_files(files, 2)
    assert groups == gate.shard_files(list(reversed(files)), 2)  # order of discovery does not matter
    assert sorted(p for g in groups for p in g) == [p for p, _ in files]  # every file once, none split
    load = sorted(sum(dict(files)[p] for p in g) for g in groups)
    assert load == [100, 100]
    assert gate.shard_files(files, 1) == [sorted(p for p, _ in files)]
    assert len(gate.shard_files(files[:1], 4)) == 1  # empty groups dropped


def _shard(tmp_path, name, commit_id, outcomes, **extra):
    return json.loads(write_report(tmp_path / name, commit_id, outcomes, **extra).read_text())


def test_merged_shard_reports_are_judged_as_one_run(tmp_path):
    """Two shards over disjoint files: green + green is green and names every test; a red, a stale, a dirty or
    a missing shard test blocks exactly as in one run (the merge never turns a failure into a pass)."""
    a, b = "tests/unit/test_a.py::test_x", "tests/unit/test_b.py::test_y"
    head = "c" * 40
    green = gate.merge_reports([_shard(tmp_path, "1", head, {a: "passed"}), _shard(tmp_path, "2", head, {b: "passed"})])
    assert gate.judge_report(green, head, [a, b]) == (None, [])
    assert sorted(green["hardstop"]["tests"]) == [a, b] and green["summary"]["total"] == 2
    red = gate.merge_reports([_shard(tmp_path, "1", head, {a: "passed"}), _shard(tmp_path, "2", head, {b: "failed"})])
    problem, failing = gate.judge_report(red, head, [a, b])
    assert problem == "1 hard-stop test(s) did not pass" and failing == [f"{b} (failed)"]
    stale = gate.merge_reports([_shard(tmp_path, "1", head, {a: "passed"}),
                                _shard(tmp_path, "2", "d" * 40, {b: "passed"})])
    assert "names no git commit" in gate.judge_report(stale, head, [a, b])[0]
    dirty = gate.merge_reports([_shard(tmp_path, "1", head, {a: "passed"}),
                                _shard(tmp_path, "2", head, {b: "passed"}, git_dirty=True, git_dirty_files=["x.py"])])
    assert "uncommitted or untracked files (x.py)" in gate.judge_report(dirty, head, [a, b])[0]
    one = gate.merge_reports([_shard(tmp_path, "1", head, {a: "passed"})])
    problem, failing = gate.judge_report(one, head, [a, b])
    assert "did not run" in problem and failing == [f"{b} (missing: a hard-stop test of the base that did not run)"]
    assert gate.merge_reports([])["hardstop"]["passed"] is False
