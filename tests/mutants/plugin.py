"""pytest plugin: apply the mutant named by `$DSV4_MUTANT` for the whole session and record outcomes.

    DSV4_MUTANT=window_129 DSV4_MUTANT_REPORT=/tmp/r.json \\
        python -m pytest -p tests.mutants.plugin -p no:cacheprovider tests/unit/test_model.py::...

The patch is applied in `pytest_configure`, before any test module is imported, so `from m import f` in a
test module sees the mutant too; it is undone in `pytest_unconfigure`. With `$DSV4_MUTANT` unset or empty
nothing is patched (the clean control run). `$DSV4_MUTANT_REPORT`, when set, receives JSON
`{"mutant": name | null, "outcomes": {nodeid: "passed" | "failed" | "skipped" | "error"}, "exceptions": {nodeid:
exception type name of a failed body}}`, where "failed" means the test body failed and "error" a setup/teardown
failure. An unknown name is a usage error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ENV, REPORT_ENV = "DSV4_MUTANT", "DSV4_MUTANT_REPORT"

_state: dict = {"mp": None, "mutant": None, "outcomes": {}, "exceptions": {}}


def pytest_configure(config):
    name = os.environ.get(ENV, "")
    if not name:
        return
    from tests.mutants.catalogue import MUTANTS

    if name not in MUTANTS:
        raise pytest.UsageError(f"${ENV}={name!r}: unknown mutant; known: {', '.join(MUTANTS)}")
    mp = pytest.MonkeyPatch()
    MUTANTS[name].apply(mp)
    _state.update(mp=mp, mutant=name)


def pytest_report_header(config):
    return f"dsv4 mutant: {_state['mutant'] or 'none (clean run)'}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Record the exception type of a failed test body (tests/unit/test_mutants.py refuses kills by exceptions
    that say the patch no longer fits the code, e.g. a TypeError from a wrapper's stale signature)."""
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" and rep.failed and call.excinfo is not None:
        _state["exceptions"][rep.nodeid] = call.excinfo.type.__name__


def pytest_runtest_logreport(report):
    out = _state["outcomes"]
    if report.when == "call":
        out[report.nodeid] = report.outcome
    elif report.failed and out.get(report.nodeid) != "failed":  # setup / teardown error
        out[report.nodeid] = "error"
    elif report.when == "setup" and report.skipped:
        out[report.nodeid] = "skipped"


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).write_text(json.dumps({"mutant": _state["mutant"], "outcomes": _state["outcomes"],
                                          "exceptions": _state["exceptions"]}, indent=1))


def pytest_unconfigure(config):
    if _state["mp"] is not None:
        _state["mp"].undo()
        _state["mp"] = None
