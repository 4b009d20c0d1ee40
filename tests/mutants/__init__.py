"""Seeded-bug mutants of dsv4 (issue 8): a tests-only package, never imported by product code.

`patches` holds the faults (each a function applying monkeypatches to a `pytest.MonkeyPatch`), `catalogue`
names them with the public failure class they stand for and the test(s) that must kill them, `plugin` applies
the mutant named by `$DSV4_MUTANT` at session start. `tests/unit/test_mutants.py` (`pytest -m mutants`) runs
every mutant's killing tests in a subprocess and fails if any mutant survives. Table: `docs/mutants.md`.
"""
