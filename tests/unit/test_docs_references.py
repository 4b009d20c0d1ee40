"""Every test that the documentation names exists: docs/differences.md ("pinned by"), docs/mutants.md,
docs/public_bugs.md, README.md and benchmarks/RESULTS.md cite tests as `path.py::test_name` (a following
`::other` reuses that path). A renamed or deleted test would leave a difference, a mutant or a public bug
documented as pinned by nothing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["docs/differences.md", "docs/mutants.md", "docs/public_bugs.md", "README.md", "benchmarks/RESULTS.md"]
REF = re.compile(r"((?:tests/(?:unit|gpu)/)?test_\w+\.py)?::(test_\w+)")


def cited_tests(text: str) -> list[tuple[str, str]]:
    """(file name, test name) of each `file.py::test` / `::test` citation, in order; `::test` takes the file of
    the citation before it on the same line."""
    out = []
    for line in text.splitlines():
        last = None
        for m in REF.finditer(line):
            last = m.group(1) or last
            if last is not None:
                out.append((Path(last).name, m.group(2)))
    return out


def defined_tests(root: Path) -> dict[str, set[str]]:
    """File name -> names of the module-level functions in tests/unit and tests/gpu."""
    out: dict[str, set[str]] = {}
    for f in [*root.glob("tests/unit/test_*.py"), *root.glob("tests/gpu/test_*.py")]:
        names = {n.name for n in ast.parse(f.read_text()).body if isinstance(n, ast.FunctionDef)}
        out.setdefault(f.name, set()).update(names)
    return out


def missing(root: Path, docs: list[str]) -> list[str]:
    defined = defined_tests(root)
    bad = []
    for doc in docs:
        for file, name in cited_tests((root / doc).read_text()):
            if name not in defined.get(file, set()):
                bad.append(f"{doc}: {file}::{name}")
    return bad


def test_every_cited_test_exists():
    cites = sum(len(cited_tests((ROOT / d).read_text())) for d in DOCS)
    assert cites >= 40, f"only {cites} citations found: the parser no longer reads the docs"
    assert missing(ROOT, DOCS) == []


def test_a_renamed_test_is_reported(tmp_path):
    """Negative case: a citation of a test that is not defined is reported, with the doc that cites it."""
    (tmp_path / "tests/unit").mkdir(parents=True)
    (tmp_path / "tests/unit/test_a.py").write_text("def test_here():\n    pass\n")
    (tmp_path / "doc.md").write_text("pinned by `test_a.py::test_here`, `::test_gone` and test_b.py::test_x\n")
    assert missing(tmp_path, ["doc.md"]) == ["doc.md: test_a.py::test_gone", "doc.md: test_b.py::test_x"]


def gpu_hardstop_files(root: Path) -> set[str]:
    """tests/gpu files whose tests are marked `hardstop` (module `pytestmark` or a decorator)."""
    return {f.name for f in root.glob("tests/gpu/test_*.py") if "mark.hardstop" in f.read_text()}


def listed_gpu_hardstops(text: str) -> set[str]:
    """The test files named in the README's GPU hard-stop sentence ("GPU hard stops ... A failing one ends")."""
    part = text.split("GPU hard stops (", 1)[1].split("A failing one ends", 1)[0]
    return set(re.findall(r"test_\w+\.py", part))


def test_readme_lists_every_gpu_hard_stop_file():
    """The README's list of GPU hard-stop files is the set of tests/gpu files marked hardstop (a user runs
    `pytest tests/gpu -m hardstop` from it; a file left out of the list is a hard stop nobody is told about)."""
    listed, marked = listed_gpu_hardstops((ROOT / "README.md").read_text()), gpu_hardstop_files(ROOT)
    assert listed == marked, f"README lists {sorted(listed - marked)} not marked; marked {sorted(marked - listed)} not listed"


def test_a_gpu_hard_stop_left_out_is_reported():
    text = (ROOT / "README.md").read_text()
    assert listed_gpu_hardstops(text.replace("`test_speculative.py` (MTP", "(MTP")) != gpu_hardstop_files(ROOT)


def test_gate_help_lists_every_gpu_hard_stop_file():
    """`dsv4 gate --help` names the GPU hard-stop files it does not run: the same set as the tests/gpu files marked
    hardstop."""
    from dsv4.cli import build_parser
    gate = next(a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "gate")[1]
    part = gate.description.split("files:", 1)[1]
    listed = {n + ".py" for n in re.findall(r"test_\w+", part)}
    marked = gpu_hardstop_files(ROOT)
    assert listed == marked, f"gate --help lists {sorted(listed - marked)} not marked; marked {sorted(marked - listed)} not listed"
