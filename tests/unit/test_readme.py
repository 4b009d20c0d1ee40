"""The README tells the truth (issue 28 item 1): its synopses match the argument parsers, its set-up commands are
the ones CI runs as written, the pin it states is CI's, its Python example runs, and no unmeasured number or
placeholder is left in it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")
COMMANDS = ("diagnose", "generate", "make-tiny", "make-checkpoint", "gate")


def _synopses() -> dict[str, list[str]]:
    """command -> synopsis spans of the README: a backticked `dsv4 COMMAND ...` with at least one `[`."""
    out: dict[str, list[str]] = {}
    for m in re.finditer(r"`dsv4 (" + "|".join(COMMANDS) + r") ([^`]*\[[^`]*)`", README):
        out.setdefault(m.group(1), []).append(" ".join(m.group(2).split()))
    return out


def _parse_synopsis(text: str) -> tuple[dict[str, bool], list[str], dict[str, list[str]]]:
    """({option: required}, positionals, {option: shown choices}) of one synopsis: `[--a X]` optional,
    `--b X` required, `[--c|--d]` two optional flags, `--e x|y` shows choices, a bare word a positional."""
    options, positionals, choices = {}, [], {}

    def option(words: list[str], required: bool) -> None:
        options[words[0]] = required
        if len(words) > 1 and "|" in words[1]:
            choices[words[0]] = words[1].split("|")

    tokens = re.findall(r"\[[^\]]*\]|\S+", text)
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t.startswith("["):
            inner = t[1:-1]
            if all(a.startswith("--") and " " not in a for a in inner.split("|")):
                for a in inner.split("|"):
                    options[a] = False
            else:
                option(inner.split(), False)
        elif t.startswith("--"):
            words = [t]
            if i + 1 < len(tokens) and not tokens[i + 1].startswith(("-", "[")):
                words.append(tokens[i + 1])
                i += 1
            option(words, True)
        else:
            positionals.append(t)
        i += 1
    return options, positionals, choices


@pytest.mark.parametrize("command", COMMANDS)
def test_synopsis_matches_the_parser(command):
    found = _synopses().get(command, [])
    assert len(found) == 1, f"README: expected one synopsis of `dsv4 {command}`, found {found}"
    options, positionals, choices = _parse_synopsis(found[0])
    parser = build_parser().dsv4_subparsers[command]
    want_opts, want_pos, want_choices = {}, [], {}
    for a in parser._actions:
        if not a.option_strings:
            want_pos.append(a.dest)
            continue
        if "--help" in a.option_strings:
            continue
        for o in a.option_strings:
            want_opts[o] = bool(a.required)
            if a.choices:
                want_choices[o] = sorted(a.choices)
    assert options == want_opts, f"README synopsis of `dsv4 {command}`: {found[0]}"
    assert len(positionals) == len(want_pos)
    for o, shown in choices.items():
        if o in want_choices:  # --device shows examples (cpu|cuda), not choices
            assert sorted(shown) == want_choices[o], (command, o, shown)


def test_readme_names_version_and_the_cpu_speed_of_make_checkpoint():
    assert "`dsv4 --version`" in README
    assert "0.01 GB/s" in README and "30 minutes" in README


def test_no_placeholders_or_stale_counts():
    assert not re.search(r"@[A-Z]+@", README)
    assert "about 1,050 tests" not in README and "takes about 3 minutes" not in README


def _ci_readme_commands() -> list[str]:
    script = (REPO / ".ci" / "run").read_text()
    func = re.search(r"^readme_commands\(\) \{.*?^\}$", script, re.S | re.M).group(0)
    p = subprocess.run(["bash", "-c", f"{func}\nreadme_commands"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


def test_ci_runs_the_readme_set_up_commands_as_written():
    section = README.split("\n## Set up and run", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    written = [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert written == ['python3 -m venv .venv && .venv/bin/pip install -e ".[test,triton]" && .venv/bin/dsv4 diagnose',
                       "TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/unit -q -n auto"]
    assert _ci_readme_commands() == written
    script = (REPO / ".ci" / "run").read_text()
    assert 'mapfile -t commands < <(readme_commands)' in script and 'bash -o pipefail -c "$cmd"' in script


def test_the_pin_the_readme_states_is_cis():
    pin = re.search(r'^TORCH_PIN="torch==([0-9.]+)"$', (REPO / ".ci" / "run").read_text(), re.M).group(1)
    assert f"**torch {pin}, CPU build**" in README
    pyproject = (REPO / "pyproject.toml").read_text()
    for dep in ("torch>=", "transformers>=", "triton>="):
        rng = re.search(rf'"({re.escape(dep)}[^"]*)"', pyproject).group(1)
        assert f"`{rng}`" in README, rng


def test_python_api_example_runs_on_the_tiny_checkpoint(tiny_ckpt, tmp_path):
    m = re.search(r"```python\n(.*?)```", README, re.S)
    assert m and "load_model" in m.group(1) and "prompt_ids" in m.group(1) and "generate(" in m.group(1)
    shutil.copytree(tiny_ckpt, tmp_path / "tiny")  # `dsv4 make-tiny tiny`
    p = subprocess.run([sys.executable, "-c", m.group(1)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split()[0] in ("eos", "max_tokens")
