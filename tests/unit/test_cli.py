"""The `dsv4` command line as a new user meets it: a stray `TEST_LAYERS=2` argument is named as an
environment variable, argument errors come before torch is imported, `--backend triton` where it cannot run
fails before any weight is read and names the flag, the progress bar goes to stderr, `--help` describes every
option and the exit codes, and every error line reads `dsv4 COMMAND: error: ...`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dsv4.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]


def _exit(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, capsys.readouterr()


@pytest.mark.parametrize("argv,command", [
    (["diagnose", "TEST_LAYERS=2"], "diagnose"),
    (["diagnose", "--decode-steps", "1", "TEST_LAYERS=2", "--dtype", "fp32"], "diagnose"),
    (["TEST_LAYERS=2", "diagnose"], "diagnose"),
    (["generate", "--prompt", "x", "DSV4_CKPT=/ckpt"], "generate"),
])
def test_stray_environment_assignment_gets_the_hint(argv, command, capsys):
    code, cap = _exit(argv, capsys)
    assign = next(a for a in argv if "=" in a)
    err = cap.err.strip().splitlines()[-1]
    assert code == 2 and err.startswith(f"dsv4 {command}: error: {assign!r} is an environment variable")
    assert f"`{assign} dsv4 {command}`" in err and "unrecognized" not in err


def test_other_unknown_arguments_stay_unrecognized(capsys):
    code, cap = _exit(["diagnose", "extra", "--decode-step", "2"], capsys)
    assert code == 2 and "dsv4 diagnose: error: unrecognized arguments: extra --decode-step 2" in cap.err


_PROBE = """
import sys
from dsv4.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    print("PROBE", e.code, "torch" in sys.modules)
"""


@pytest.mark.parametrize("argv", [["diagnose", "TEST_LAYERS=2"], ["diagnose", "--device", "bogus"],
                                  ["diagnose", "--decode-steps", "0"], ["generate"], ["diagnose", "--help"],
                                  ["gate"], ["make-tiny"], ["frobnicate"]])
def test_argument_errors_come_before_torch_is_imported(argv):
    p = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, cwd=REPO,
                       env={**__import__("os").environ, "PYTHONPATH": str(REPO)}, timeout=120)
    _, code, torch_loaded = p.stdout.splitlines()[-1].split()
    assert code in ("0", "2") and torch_loaded == "False", p.stderr


def test_triton_backend_on_cpu_without_interpreter_fails_before_any_weight(tiny_ckpt, capsys, monkeypatch):
    import dsv4.checkpoint
    import dsv4.tiny

    def no_weights(*a, **k):
        raise AssertionError("a weight was read or written")

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(dsv4.checkpoint, "load_checkpoint", no_weights)
    monkeypatch.setattr(dsv4.tiny, "make_tiny", no_weights)
    for argv in (["diagnose", "--backend", "triton"], ["diagnose", "--ckpt", str(tiny_ckpt), "--backend", "triton"],
                 ["generate", "--ckpt", str(tiny_ckpt), "--prompt", "x", "--backend", "triton"]):
        code, cap = _exit(argv, capsys)
        err = cap.err.strip().splitlines()[-1]
        assert code == 2 and err.startswith(f"dsv4 {argv[0]}: error: --backend triton needs --device cuda"), err
        assert "TRITON_INTERPRET=1" in err and "--backend reference" in err and "backend='" not in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_cuda_device_without_gpu_is_an_argument_error(capsys):
    code, cap = _exit(["diagnose", "--device", "cuda"], capsys)
    assert code == 2 and "dsv4 diagnose: error: --device cuda: no CUDA device is visible" in cap.err


def test_progress_bar_goes_to_stderr(tiny_ckpt, capsys):
    assert main(["generate", "--ckpt", str(tiny_ckpt), "--prompt", "Hi", "--max-tokens", "1"]) == 0
    cap = capsys.readouterr()
    assert "loading " in cap.err and "tensors from" in cap.err
    assert "loading " not in cap.out and "━" not in cap.out


def test_help_describes_every_option_and_the_exit_codes(capsys):
    parser = build_parser()
    for name, sub in parser.dsv4_subparsers.items():
        for action in sub._actions:
            assert action.help and action.help.strip(), f"dsv4 {name}: {action.option_strings or action.dest}"
        code, cap = _exit([name, "--help"], capsys)
        assert code == 0
        for piece in ("exit status: 0 = pass", "2 = bad input", "3 = hard stop", "TEST_LAYERS", "DSV4_CKPT"):
            assert piece in cap.out, (name, piece)
    code, cap = _exit(["--help"], capsys)
    assert code == 0 and "exit status: 0" in cap.out
    from dsv4 import cli, diagnose
    assert cli.DEFAULT_CONTINUE_TOKENS == diagnose.DEFAULT_CONTINUE_TOKENS  # one default, written twice


@pytest.mark.parametrize("argv", [
    ["diagnose", "--continue-tokens", "0"], ["diagnose", "--expect"], ["diagnose", "--expect", " "],
    ["diagnose", "--json", "/tmp"],
    ["diagnose", "--ckpt", "/nonexistent-dsv4"], ["generate", "--prompt", "x"], ["generate"],
    ["generate", "--prompt", "x", "--temperature", "nan"], ["make-tiny", "/proc/dsv4-cannot-write-here"],
    ["make-tiny", "--variant", "fp16", "x"], ["gate"], ["diagnose", "--thinking", "--no-thinking"],
])
def test_every_error_line_names_the_command(argv, capsys, monkeypatch):
    monkeypatch.delenv("DSV4_CKPT", raising=False)
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.value.code if hasattr(e, "value") else e.code
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "error" in ln.lower()]
    assert code == 2 and lines, err
    assert all(ln.startswith(f"dsv4 {argv[0]}: error: ") for ln in lines), err


def test_test_layers_with_a_space_is_refused_like_any_non_canonical_integer(tiny_ckpt, capsys, monkeypatch):
    monkeypatch.setenv("TEST_LAYERS", " 2")
    assert main(["diagnose", "--ckpt", str(tiny_ckpt)]) == 2
    assert "dsv4 diagnose: error: TEST_LAYERS=' 2': expected an integer in 1..4" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["make-checkpoint", "{tmp}/ck", "--geometry", "tiny", "--dry-run"],
                                  ["make-tiny", "{tmp}/tiny"]], ids=["make-checkpoint", "make-tiny"])
def test_stdout_closed_by_its_reader_ends_quietly(tmp_path, argv):
    """`dsv4 make-checkpoint ... | head -1`: the reader leaves, the next print raises BrokenPipeError. It used to end
    in a traceback (then in `error: [Errno 32] Broken pipe`, exit 2); now the command stops quietly with 141 (a
    shell's status for a writer ended by SIGPIPE), nothing on stderr, and no `Exception ignored` at exit. Here the
    reader is gone before the first line, the harshest case."""
    import os

    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "dsv4.cli", *[a.format(tmp=tmp_path) for a in argv]], stdout=w,
                           stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        os.close(w)
    assert (p.returncode, p.stderr) == (141, ""), p.stderr
