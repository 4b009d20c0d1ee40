"""The hard-stop merge gate behind `dsv4 gate --base REF [--report FILE]` (issue 5, item 5).

A change that touches a protected path (`[tool.dsv4.gate] protected` in pyproject.toml: the kernels, the
package, the tests and their pytest plumbing, CI) is allowed only with a green run of the `hardstop` tests for
the commit being merged. Without `--report` the gate runs them itself::

    TRITON_INTERPRET=1 python -m pytest -m hardstop tests/unit -q -p no:cacheprovider \\
        --json-report --json-report-file=<tmp>

and reads the report that the root conftest.py extends with `hardstop`, `git_commit` and `git_dirty`.

The expected set of hard-stop tests comes from the merge base, never from the run under test: the gate
collects `-m hardstop tests/unit` in a temporary worktree of the merge base of BASE and HEAD, and every one of
those node ids must have run and passed at HEAD. One that is missing (removed, renamed, deselected, ignored)
blocks: a maintainer must approve removing a hard-stop test (a merge past the required check).
Hard-stop tests new at HEAD must pass too.

What counts as changed: `git diff --no-renames --name-only BASE...HEAD` (the change since the merge base,
both sides of a rename) plus the working tree's uncommitted and untracked, non-ignored files. A report
vouches for a commit, not for a working tree: uncommitted changes under a protected path block, and so does
a report whose run saw any uncommitted or untracked file (`git_dirty`).

Protected patterns: the union of pyproject.toml's list in the working tree and at BASE, so a change cannot
unprotect a path in the same change that edits it. Glob semantics per path segment: `*`, `?`, `[...]` never
cross `/`; a whole segment `**` matches zero or more segments (`kernels/**` is everything under kernels/).

It fails closed: a missing, unreadable or non-JSON report, one without the hard-stop summary, with no
hard-stop test, missing a hard-stop test of the merge base, with a deselected hard-stop test or one that did
not pass (failed, errored, skipped, xfailed), with collection errors, from a run that stopped early, made
for another commit or from a dirty working tree blocks the change; so does a merge base whose hard-stop
tests cannot be collected.

Exit statuses of `run_gate`: 0 allowed, 3 blocked, 2 usage or git error (unknown ref, not a repository,
pyproject without the protected list).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

from rich.console import Console
from rich.panel import Panel
from rich.text import Text

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser under its PyPI name
    import tomli as tomllib

EXIT_ALLOWED = 0
EXIT_USAGE = 2
EXIT_BLOCKED = 3
HARD_STOP_RULE = "no kernel, mHC or residual change is authorized until these pass"
PYTEST_ARGS = ("-m", "hardstop", "tests/unit", "-q", "-p", "no:cacheprovider")
REMOVAL_RULE = "a maintainer must approve removing a hard-stop test"
# A pytest plugin the gate loads (-p) into the collect-only run at the merge base: it writes the selected
# node ids as JSON, which is robust to the base's verbosity options (unlike parsing `-q` output).
_COLLECT_PLUGIN = """\
import json
import os


def pytest_collection_finish(session):
    with open(os.environ["DSV4_GATE_COLLECTED"], "w") as f:
        json.dump([item.nodeid for item in session.items], f)
"""


class GateError(Exception):
    """Usage or git error (exit status 2): unknown ref, not a repository, bad pyproject."""


class BaseCollectionError(Exception):
    """The merge base's hard-stop tests could not be collected (the gate blocks: exit status 3)."""


@dataclass(frozen=True)
class GateDecision:
    """The gate's verdict.

    allowed: whether the change may merge. reason: one sentence saying why. protected_changes: changed
    paths matching a protected pattern. failing_tests: hard-stop node ids that did not pass, with their
    outcome (or `deselected`, `missing`) in parentheses. report_commit / head_commit: the commit the
    report was made for and HEAD (None when not looked at).
    """

    allowed: bool
    reason: str
    protected_changes: list[str] = field(default_factory=list)
    failing_tests: list[str] = field(default_factory=list)
    report_commit: str | None = None
    head_commit: str | None = None


def _git_run(repo: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise GateError(f"could not run git {' '.join(args)} in {repo}: {e}") from None


def _git(repo: Path, *args: str) -> str:
    out = _git_run(repo, *args)
    if out.returncode != 0:
        raise GateError(f"git {' '.join(args)} failed in {repo}: {out.stderr.strip()}")
    return out.stdout


def repo_root(start: Path | None = None) -> Path:
    """The top directory of the git work tree holding `start` (default: the current directory).

    Raises GateError when `start` is not inside a git work tree.
    """
    start = Path.cwd() if start is None else Path(start)
    return Path(_git(start, "rev-parse", "--show-toplevel").strip())


def resolve_commit(repo: Path, ref: str) -> str:
    """The full commit id `ref` names in `repo`. Raises GateError naming `ref` when it names no commit."""
    out = _git_run(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}")
    if out.returncode != 0 or not out.stdout.strip():
        raise GateError(f"base ref {ref!r} names no commit in {repo} "
                        "(fetch it first, e.g. git fetch origin, and use origin/<branch>)")
    return out.stdout.strip()


def dirty_files(repo: Path) -> list[str]:
    """Repository-relative paths with uncommitted changes (staged or not) or untracked and not ignored.

    Both sides of a staged rename are listed.
    """
    out = _git(repo, "status", "--porcelain=v1", "-z", "--untracked-files=all")
    entries = out.split("\0")
    files: list[str] = []
    i = 0
    while i < len(entries):
        entry = entries[i]
        i += 1
        if not entry:
            continue
        status, path = entry[:2], entry[3:]
        files.append(path)
        if "R" in status or "C" in status:  # -z: the source path follows as its own entry
            files.append(entries[i])
            i += 1
    return sorted(set(files))


def changed_files(base: str, repo: Path | None = None) -> list[str]:
    """Paths changed since the merge base of `base` and HEAD, plus uncommitted and untracked files.

    Committed part: `git diff --no-renames --name-only base...HEAD` (a rename counts as its old and new
    path). Raises GateError naming `base` when it names no commit, or when it shares no history with HEAD.
    """
    repo = repo_root(repo)
    resolve_commit(repo, base)
    committed = _git(repo, "diff", "--no-renames", "--name-only", "-z", f"{base}...HEAD", "--").split("\0")
    return sorted({p for p in committed if p} | set(dirty_files(repo)))


def _patterns_from_toml(text: str, where: str) -> list[str]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise GateError(f"{where}: not valid TOML: {e}") from None
    pats = data.get("tool", {}).get("dsv4", {}).get("gate", {}).get("protected")
    if not isinstance(pats, list) or not pats:
        raise GateError(f"{where}: [tool.dsv4.gate] protected must be a non-empty list of path patterns, "
                        f"got {pats!r}")
    for p in pats:
        if not isinstance(p, str) or not p or p.startswith(("/", "./")) or "\\" in p:
            raise GateError(f"{where}: [tool.dsv4.gate] protected entry {p!r} is not a repository-relative "
                            "pattern (expected e.g. 'kernels/**' or 'dsv4/model.py')")
    return list(pats)


def protected_patterns(repo: Path | None = None, base: str | None = None) -> list[str]:
    """The protected path patterns from `repo`/pyproject.toml, `[tool.dsv4.gate] protected`.

    With `base`, the union with the list in pyproject.toml at that commit (when the file and the section
    exist there), so a change cannot drop a protection it relies on. Raises GateError naming the file and
    key when the working tree's list is missing, empty or malformed.
    """
    repo = repo_root(repo)
    path = repo / "pyproject.toml"
    try:
        text = path.read_text()
    except OSError as e:
        raise GateError(f"{path}: cannot read the protected path list: {e}") from None
    pats = _patterns_from_toml(text, str(path))
    if base is not None:
        shown = _git_run(repo, "show", f"{resolve_commit(repo, base)}:pyproject.toml")
        if shown.returncode == 0 and "[tool.dsv4.gate]" in shown.stdout:
            pats += [p for p in _patterns_from_toml(shown.stdout, f"{base}:pyproject.toml") if p not in pats]
    return pats


def _match_segments(pat: list[str], path: list[str]) -> bool:
    if not pat:
        return not path
    if pat[0] == "**":
        return any(_match_segments(pat[1:], path[k:]) for k in range(len(path) + 1))
    return bool(path) and fnmatchcase(path[0], pat[0]) and _match_segments(pat[1:], path[1:])


def match_protected(files: list[str], patterns: list[str]) -> list[str]:
    """The `files` (repository-relative, `/`-separated) matching any of `patterns`, in input order.

    Glob semantics per segment (`*`, `?`, `[...]` stay inside one segment; `**` as a whole segment matches
    zero or more segments); case-sensitive.
    """
    pats = [p.split("/") for p in patterns]
    return [f for f in files if any(_match_segments(p, f.split("/")) for p in pats)]


def merge_base(repo: Path, base: str) -> str:
    """The merge base of `base` and HEAD in `repo`. Raises GateError when they share no history."""
    out = _git_run(repo, "merge-base", resolve_commit(repo, base), "HEAD")
    if out.returncode != 0 or not out.stdout.strip():
        raise GateError(f"base ref {base!r} shares no history with HEAD in {repo}")
    return out.stdout.strip()


def collect_hardstop_ids(repo: Path, commit: str) -> list[str]:
    """The hard-stop unit test node ids of `commit`: `pytest --collect-only -m hardstop tests/unit` run in a
    temporary `git worktree` of that commit (removed afterwards), with its own conftest and pytest config.

    Empty when `commit` has no tests/unit directory. Raises BaseCollectionError, with the tail of pytest's
    output, when collection fails (import or collection errors, a pytest exit status other than 0 or 5).
    """
    if _git_run(repo, "cat-file", "-e", f"{commit}:tests/unit").returncode != 0:
        return []
    with tempfile.TemporaryDirectory(prefix="dsv4-gate-base-") as tmp:
        tree, out_file = Path(tmp) / "tree", Path(tmp) / "collected.json"
        (Path(tmp) / "dsv4_gate_collect.py").write_text(_COLLECT_PLUGIN)
        _git(repo, "worktree", "add", "--detach", "--quiet", str(tree), commit)
        try:
            env = {**os.environ, "TRITON_INTERPRET": "1", "DSV4_GATE_COLLECTED": str(out_file),
                   "PYTHONPATH": os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))}
            cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "hardstop", "tests/unit",
                   "-p", "no:cacheprovider", "-p", "dsv4_gate_collect"]
            try:
                proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise BaseCollectionError(f"collecting the hard-stop tests of base {commit[:12]} failed: {e}")
            if proc.returncode not in (0, 5) or not out_file.exists():  # 5: no test selected
                tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
                raise BaseCollectionError(f"collecting the hard-stop tests of base {commit[:12]} failed "
                                          f"(pytest exit status {proc.returncode}):\n{tail}")
            ids = json.loads(out_file.read_text())
        finally:
            _git_run(repo, "worktree", "remove", "--force", str(tree))
            _git_run(repo, "worktree", "prune")
    return sorted(ids)


def load_report(path: Path) -> dict:
    """Parse a pytest-json-report file. Raises ValueError saying why it is missing, unreadable or not JSON."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"report {path} is missing or unreadable: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"report {path} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"report {path} is not a pytest-json-report object (top level is {type(data).__name__})")
    return data


def report_shape_problem(report) -> str | None:
    """Why `report` is not shaped like a pytest-json-report with the hard-stop summary (a field of the wrong JSON
    type, named by its path, e.g. `hardstop.tests[0]` or `tests[3].nodeid`); None when every field the gate reads
    has its type. Absent fields are left to `judge_report` (each has its own reason)."""
    def kind(v) -> str:
        return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
                int: "a number", float: "a number"}.get(type(v), type(v).__name__)

    if not isinstance(report, dict):
        return f"the top level is {kind(report)}, expected an object"
    hs = report.get("hardstop")
    if isinstance(hs, dict):
        for key in ("tests", "failed", "deselected"):
            v = hs.get(key)
            if isinstance(v, list):
                for i, item in enumerate(v):
                    if not isinstance(item, str):
                        return f"hardstop.{key}[{i}] is {kind(item)}, expected a test id string"
    elif hs is not None:
        return f"hardstop is {kind(hs)}, expected an object"
    for key in ("tests", "collectors"):
        v = report.get(key)
        if v is None:
            continue
        if not isinstance(v, list):
            return f"{key} is {kind(v)}, expected an array"
        for i, item in enumerate(v):
            if not isinstance(item, dict):
                return f"{key}[{i}] is {kind(item)}, expected an object"
            nodeid = item.get("nodeid")
            if nodeid is not None and not isinstance(nodeid, str):
                return f"{key}[{i}].nodeid is {kind(nodeid)}, expected a string"
    for key in ("git_commit",):
        v = report.get(key)
        if v is not None and not isinstance(v, str):
            return f"{key} is {kind(v)}, expected a string"
    files = report.get("git_dirty_files")
    if files is not None and not isinstance(files, list):
        return f"git_dirty_files is {kind(files)}, expected an array"
    summary = report.get("summary")
    if summary is not None:
        if not isinstance(summary, dict):
            return f"summary is {kind(summary)}, expected an object"
        for key in ("collected", "total", "deselected"):
            v = summary.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                return f"summary.{key} is {kind(v)}, expected an integer"
    return None


def judge_report(report: dict, head_commit: str, expected: list[str] = ()) -> tuple[str | None, list[str]]:
    """Check a pytest-json-report dict as a green hard-stop run for `head_commit` from a clean tree.

    `expected`: the hard-stop node ids of the merge base; each must have run and passed. Returns (problem,
    failing_tests): problem is None when the run is green, else a sentence saying why not; failing_tests are
    hard-stop node ids that did not pass, each with its outcome (or `deselected`, `missing`) in parentheses.
    """
    shape = report_shape_problem(report)
    if shape is not None:  # fail closed with the field named, never a TypeError traceback
        return f"the report is not a pytest-json-report of the expected shape: {shape}", []
    hs = report.get("hardstop")
    if not isinstance(hs, dict) or not all(isinstance(hs.get(k), list) for k in ("tests", "failed", "deselected")):
        return ("the report has no hard-stop summary (run pytest from the repository root, whose conftest.py "
                "adds it, with --json-report)"), []
    commit = report.get("git_commit")
    if not isinstance(commit, str) or not commit:
        return ("the report names no git commit (it was not made inside the repository, or HEAD moved during "
                "the run)"), []
    if commit != head_commit:
        return f"the report is stale: it was made for commit {commit}, HEAD is {head_commit}", []
    dirty = report.get("git_dirty")
    if dirty is not False:
        if dirty is not True:
            return "the report does not say whether the working tree was clean (git_dirty missing)", []
        files = report.get("git_dirty_files")
        files = files if isinstance(files, list) else ["?"]
        shown = ", ".join(map(str, files[:10])) + (" ..." if len(files) > 10 else "")
        return (f"the report was made from a working tree with uncommitted or untracked files ({shown}): it "
                f"does not vouch for commit {commit}"), []
    ran = set(hs["tests"])
    outcomes = {t.get("nodeid"): t.get("outcome") for t in report.get("tests", []) if isinstance(t, dict)}
    deselected = [f"{n} (deselected)" for n in hs["deselected"]]
    missing = [f"{n} (missing: a hard-stop test of the base that did not run)" for n in expected
               if n not in ran and n not in hs["deselected"]]
    failing = [f"{n} (failed)" for n in hs["failed"]]
    failing += [f"{n} ({outcomes.get(n, 'no result in report')})" for n in hs["tests"]
                if n not in hs["failed"] and outcomes.get(n) != "passed"]
    if deselected or missing:
        return (f"{len(deselected) + len(missing)} hard-stop test(s) did not run (removed, renamed or deselected); "
                f"{REMOVAL_RULE}"), deselected + missing + failing
    if not hs["tests"]:
        return "no hard-stop test ran in the reported run", []
    if failing:
        return f"{len(failing)} hard-stop test(s) did not pass", failing
    if hs.get("passed") is not True:
        return "the report's hard-stop summary does not say passed", []
    broken = [c.get("nodeid") for c in report.get("collectors", []) if isinstance(c, dict) and c.get("outcome") == "failed"]
    if broken:
        return f"collection errors in {', '.join(map(str, broken))}: hard-stop tests there never ran", []
    exitcode = report.get("exitcode")
    if exitcode not in (0, 1):
        return f"the reported pytest run ended with exit status {exitcode} (interrupted or unusable)", []
    s = report.get("summary", {})
    if isinstance(s, dict) and isinstance(s.get("collected"), int):
        ran_n, selected = s.get("total", 0), s["collected"] - s.get("deselected", 0)
        if ran_n < selected:
            return f"the reported run stopped early: {ran_n} of {selected} selected tests ran", []
    return None, []


def shard_files(files: list[tuple[str, int]], jobs: int) -> list[list[str]]:
    """Split test files [(path, weight)] into `jobs` groups of about equal total weight (greedy, heaviest first;
    a file is never split, so its module fixtures run once). Deterministic; empty groups dropped."""
    groups: list[tuple[int, list[str]]] = [(0, []) for _ in range(max(1, jobs))]
    for path, w in sorted(files, key=lambda f: (-f[1], f[0])):
        i = min(range(len(groups)), key=lambda k: (groups[k][0], k))
        groups[i] = (groups[i][0] + w, groups[i][1] + [path])
    return [sorted(g) for _, g in groups if g]


def merge_reports(reports: list[dict]) -> dict:
    """One pytest-json-report dict from the reports of runs over disjoint sets of test files (`run_hardstop_tests`
    with jobs > 1): tests, collectors and the hard-stop lists concatenated; `hardstop.passed` only if every run's
    is True; `git_commit` kept only when every run names the same one (else None: the judge calls it unnamed);
    `git_dirty` True if any run saw a dirty tree (None if any did not say); the summary counts summed; the exit
    status the worst (the largest). Judged by `judge_report` exactly as one run's report."""
    def first(key):
        vals = {r.get(key) for r in reports}
        return vals.pop() if len(vals) == 1 else None

    dirty = [r.get("git_dirty") for r in reports]
    out = {"tests": [t for r in reports for t in r.get("tests", [])],
           "collectors": [c for r in reports for c in r.get("collectors", [])],
           "git_commit": first("git_commit"),
           "git_dirty": None if any(d is None for d in dirty) else any(dirty),
           "git_dirty_files": sorted({f for r in reports for f in (r.get("git_dirty_files") or [])}),
           "exitcode": max((r.get("exitcode", 2) for r in reports), default=2),
           "summary": {k: sum(int((r.get("summary") or {}).get(k, 0) or 0) for r in reports)
                       for k in ("collected", "total", "deselected", "passed", "failed")}}
    hs = [r.get("hardstop") if isinstance(r.get("hardstop"), dict) else {} for r in reports]
    out["hardstop"] = {k: [n for h in hs for n in (h.get(k) or [])] for k in ("tests", "failed", "deselected")}
    out["hardstop"]["passed"] = bool(reports) and all(h.get("passed") is True for h in hs)
    return out


# Seconds of each unit test file's hard-stop tests in one process on 2 cores (measured at 71dd336, pytest
# --durations; 535 s in all): the weights `shard_files` balances. A balancing hint only: a stale entry makes the
# shards uneven, never a test skipped. Files not listed weigh 1 s.
HARDSTOP_SECONDS = {"test_gemm_moe_kernels.py": 87, "test_graph_decode.py": 86, "test_bf16_backend.py": 57,
                    "test_backend.py": 39, "test_indexer_kernels.py": 36, "test_resident_quant.py": 35,
                    "test_synth_source.py": 27, "test_append.py": 22, "test_kernel_launchers.py": 17,
                    "test_model.py": 16, "test_gate_bypass.py": 16, "test_diagnose.py": 15, "test_mhc_kernels.py": 13,
                    "test_parallel.py": 13, "test_fast_paths.py": 8, "test_kernel_edges.py": 8, "test_final_norm.py": 7,
                    "test_fp32_linear.py": 4, "test_attention_kernels.py": 4, "test_compressor_kernel.py": 4,
                    "test_gate.py": 4, "test_rope_kernel.py": 3, "test_chat_template.py": 3, "test_hardstop_banner.py": 2}


def _unit_test_files(repo: Path) -> list[tuple[str, int]]:
    """The unit test files, each weighted by `HARDSTOP_SECONDS`."""
    return [(p.relative_to(repo).as_posix(), HARDSTOP_SECONDS.get(p.name, 1))
            for p in sorted((repo / "tests" / "unit").glob("test_*.py"))]


def gate_jobs() -> int:
    """The hard-stop run's process count: $DSV4_GATE_JOBS when set (an integer >= 1, ASCII digits), else
    min(2, CPU count). Raises GateError naming the variable and its value otherwise (a typo must not silently run
    the whole gate in one process, nor end in a traceback)."""
    raw = os.environ.get("DSV4_GATE_JOBS")
    if raw is None or raw == "":
        return min(2, os.cpu_count() or 1)
    s = raw.strip()
    if not (s.isascii() and s.isdigit()) or int(s) < 1:
        raise GateError(f"DSV4_GATE_JOBS={raw!r}: expected an integer >= 1 (pytest processes for the hard-stop run), "
                        "or unset for min(2, CPUs)")
    return int(s)


def run_hardstop_tests(repo: Path, report_file: Path, jobs: int | None = None) -> int:
    """Run the hard-stop unit tests in `repo` (output streams to the terminal), writing a JSON report to
    `report_file`; returns pytest's exit status (the worst over the runs). jobs (default: $DSV4_GATE_JOBS, else
    min(2, CPU count)): that many pytest processes at once, each over a disjoint set of whole test files
    (`shard_files`, weighted by `HARDSTOP_SECONDS`), their reports merged (`merge_reports`); jobs 1 runs
    `pytest -m hardstop tests/unit`."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    if jobs is None:
        jobs = gate_jobs()
    if jobs <= 1:
        cmd = [sys.executable, "-m", "pytest", *PYTEST_ARGS, "--json-report", f"--json-report-file={report_file}"]
        _console().print(f"dsv4 gate: running TRITON_INTERPRET=1 python {' '.join(cmd[1:])}", markup=False,
                         soft_wrap=True)
        sys.stdout.flush()
        return subprocess.run(cmd, cwd=repo, env=env).returncode
    groups = shard_files(_unit_test_files(repo), jobs)
    args = [a for a in PYTEST_ARGS if a != "tests/unit"]
    procs, files = [], []
    for i, g in enumerate(groups):
        f = Path(f"{report_file}.shard{i}")
        files.append(f)
        cmd = [sys.executable, "-m", "pytest", *args, *g, "--json-report", f"--json-report-file={f}"]
        _console().print(f"dsv4 gate: shard {i + 1}/{len(groups)}: TRITON_INTERPRET=1 python -m pytest "
                         f"{' '.join(args)} ({len(g)} files of tests/unit) --json-report", markup=False, soft_wrap=True)
        log = open(f"{f}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    sys.stdout.flush()
    status = 0
    for (proc, log), f in zip(procs, files):
        status = max(status, proc.wait())
        log.close()
        print(Path(f"{f}.log").read_text(encoding="utf-8", errors="replace")[-4000:], end="")
    reports = []
    for f in files:
        try:
            reports.append(load_report(f))
        except ValueError:
            return status or 2  # a shard wrote no readable report: the merged report is not written (fails closed)
    report_file.write_text(json.dumps(merge_reports(reports)), encoding="utf-8")
    return status


def evaluate(base: str, report: Path | None = None, repo: Path | None = None,
             runner=run_hardstop_tests, collector=collect_hardstop_ids) -> GateDecision:
    """Decide whether the change from `base` to HEAD (plus the working tree) may merge.

    `report`: a pytest-json-report file of a hard-stop run; None runs the tests via `runner(repo, file)`.
    `collector(repo, commit)` gives the merge base's hard-stop node ids. Both are used only when a protected
    path changed. Raises GateError on usage or git errors.
    """
    repo = repo_root(repo)
    if runner is run_hardstop_tests and report is None:
        gate_jobs()  # a bad $DSV4_GATE_JOBS is a usage error before any git or pytest work
    changed = changed_files(base, repo)
    patterns = protected_patterns(repo, base)
    protected = match_protected(changed, patterns)
    if not protected:
        return GateDecision(True, f"no protected path changed since {base} ({len(changed)} file(s) changed)")
    head = resolve_commit(repo, "HEAD")
    dirty = match_protected(dirty_files(repo), patterns)
    if dirty:
        return GateDecision(False, "protected files have uncommitted changes (a hard-stop report vouches for "
                                   f"a commit, not a working tree): {', '.join(dirty)}", protected, [], None, head)
    base_commit = merge_base(repo, base)
    try:
        expected = collector(repo, base_commit)
    except BaseCollectionError as e:
        return GateDecision(False, str(e), protected, [], None, head)
    with tempfile.TemporaryDirectory(prefix="dsv4-gate-") as tmp:
        if report is None:
            report = Path(tmp) / "hardstop.json"
            status = runner(repo, report)
            if not report.exists():
                return GateDecision(False, f"the hard-stop run (pytest exit status {status}) wrote no report",
                                    protected, [], None, head)
        try:
            data = load_report(report)
        except ValueError as e:
            return GateDecision(False, str(e), protected, [], None, head)
    problem, failing = judge_report(data, head, expected)
    commit = data.get("git_commit") if isinstance(data.get("git_commit"), str) else None
    if problem:
        return GateDecision(False, problem, protected, failing, commit, head)
    n = len(data["hardstop"]["tests"])
    return GateDecision(True, f"green hard-stop run for HEAD {head[:12]} ({n} test(s) passed, including all "
                              f"{len(expected)} of merge base {base_commit[:12]})", protected, [], commit, head)


def _console(stderr: bool = False) -> Console:
    # CI logs are not terminals: rich would wrap at 80 columns and split test ids; use 160 unless told.
    stream = sys.stderr if stderr else sys.stdout
    wide = None if stream.isatty() or "COLUMNS" in os.environ else 160
    return Console(stderr=stderr, highlight=False, width=wide, soft_wrap=False)


def render(decision: GateDecision, console: Console | None = None) -> None:
    """Print the decision: a green ALLOWED line, or a red BLOCKED panel naming the tests and the rule."""
    console = console or _console()
    if decision.allowed:
        console.print(Text(f"dsv4 gate: ALLOWED: {decision.reason}", style="bold green"))
        return
    body = Text()
    body.append(f"{decision.reason}.\n", style="bold")
    if decision.failing_tests:
        body.append("Failing hard-stop tests:\n")
        for t in decision.failing_tests:
            body.append(f"  {t}\n", style="bold red")
    body.append("Protected paths changed:\n")
    for p in decision.protected_changes:
        body.append(f"  {p}\n")
    if decision.head_commit:
        body.append(f"HEAD {decision.head_commit}")
        body.append(f", report made for {decision.report_commit}\n" if decision.report_commit else "\n")
    body.append(f"Rule: {HARD_STOP_RULE}.", style="bold red")
    console.print(Panel(body, title="BLOCKED by dsv4 gate: HARD STOP", border_style="bold red", expand=False))


def run_gate(base: str, report: Path | None) -> int:
    """`dsv4 gate`: evaluate, print, and return the exit status (0 allowed, 3 blocked, 2 usage/git error)."""
    try:
        decision = evaluate(base, report)
    except GateError as e:
        _console(stderr=True).print(Text(f"dsv4 gate: error: {e}", style="bold red"))
        return EXIT_USAGE
    render(decision)
    return EXIT_ALLOWED if decision.allowed else EXIT_BLOCKED
