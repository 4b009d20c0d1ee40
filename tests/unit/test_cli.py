"""The `dsv4` command line as a new user meets it: a stray `TEST_LAYERS=2` argument is named as an
environment variable, argument errors come before torch is imported, `--backend triton` where it cannot run
fails before any weight is read and names the flag, the progress bar goes to stderr, `--help` describes every
option and the exit codes, and every error line reads `dsv4 COMMAND: error: ...`."""

from __future__ import annotations

import json
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


_SAMPLE = {"ckpt": "ckpt", "prompt": "Hi", "json": "d.json", "decode_steps": "1", "continue_tokens": "1",
           "expect": "Paris", "device": "cpu", "max_tokens": "1", "temperature": "0.5", "seed": "7",
           "speculative": "1", "layers": "1", "shard_gb": "1.5", "base": "main", "report": "r.json"}
_REQUIRED = {"generate": ["--prompt", "Hi"], "make-tiny": ["out"], "make-checkpoint": ["out"], "gate": ["--base", "m"]}


def _single_valued_options():
    for name, sub in build_parser().dsv4_subparsers.items():
        for a in sub._actions:
            if a.option_strings and a.dest != "help":
                for opt in a.option_strings:
                    val = [] if a.nargs == 0 else [a.choices[-1] if a.choices else _SAMPLE[a.dest]]
                    yield pytest.param(name, opt, a.dest, val, id=f"{name} {opt}")


@pytest.mark.parametrize("command,opt,dest,val", list(_single_valued_options()))
def test_an_option_given_twice_is_refused(command, opt, dest, val, capsys, tmp_path, monkeypatch):
    """Every single-valued option of every command, given twice, is exit status 2 naming the option (argparse
    keeps the last value silently: `--prompt first --prompt second` ran on "second"); given once it parses."""
    from dsv4.cli import parse_args
    monkeypatch.chdir(tmp_path)
    base = [] if opt in _REQUIRED.get(command, []) else _REQUIRED.get(command, [])
    with pytest.raises(SystemExit) as e:
        parse_args([command, *base, opt, *val, opt, *val])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    why = "a flag: once is enough" if not val else "argparse would keep the last value silently"
    assert e.value.code == 2 and err == f"dsv4 {command}: error: argument {opt}: given twice; give it once ({why})"
    args = parse_args([command, *base, opt, *val])  # positive control: once is fine, and no bookkeeping is left
    assert "_dsv4_options_given" not in vars(args)
    if val and dest not in ("json", "ckpt", "report"):
        assert str(getattr(args, dest)) == val[0]


def test_repeated_option_examples_of_the_review(capsys, tmp_path):
    for argv, opt in ((["generate", "--prompt", "first", "--prompt", "second"], "--prompt"),
                      (["generate", "--prompt", "x", "--ckpt", "A", "--ckpt", "B"], "--ckpt"),
                      (["diagnose", "--json", str(tmp_path / "d.json"), "--json", str(tmp_path / "e.json")], "--json"),
                      (["generate", "--prompt", "x", "--no-thinking", "--no-thinking"], "--no-thinking")):
        code, cap = _exit(argv, capsys)
        assert code == 2 and f"dsv4 {argv[0]}: error: argument {opt}: given twice" in cap.err, argv
    code, cap = _exit(["generate", "--prompt", "x", "--thinking", "--no-thinking"], capsys)  # one setting, twice
    assert code == 2 and "--no-thinking" in cap.err and "--thinking" in cap.err


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


@pytest.mark.parametrize("command", ["diagnose", "generate"])
def test_empty_dsv4_ckpt_is_an_error_not_the_tiny_checkpoint(tiny_ckpt, capsys, monkeypatch, command):
    """`DSV4_CKPT=$UNSET dsv4 diagnose` used to build the tiny random checkpoint and report PASS, as if no
    checkpoint had been named: an empty value is now an error (exit 2) naming the variable. Controls: --ckpt
    still wins over it, and an unset variable still means the tiny checkpoint (diagnose)."""
    monkeypatch.setenv("DSV4_CKPT", "")
    extra = ["--prompt", "hi", "--max-tokens", "1"] if command == "generate" else []
    assert main([command, *extra]) == 2
    assert f"dsv4 {command}: error: $DSV4_CKPT is set but empty; expected a checkpoint directory" in \
        capsys.readouterr().err
    assert main([command, "--ckpt", str(tiny_ckpt), *extra]) == 0
    if command == "diagnose":
        monkeypatch.delenv("DSV4_CKPT")
        monkeypatch.delenv("TEST_LAYERS", raising=False)
        assert main([command, "--decode-steps", "1"]) == 0


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


# ---------------------------------------------------------------------------------------------- torchrun variables
_BAD_LAUNCH = [
    ({"RANK": "1"}, r"RANK set without WORLD_SIZE and LOCAL_RANK"),
    ({"RANK": "0"}, r"RANK set without WORLD_SIZE and LOCAL_RANK"),
    ({"LOCAL_RANK": "1"}, r"LOCAL_RANK set without RANK and WORLD_SIZE"),
    ({"WORLD_SIZE": "2"}, r"WORLD_SIZE set without RANK and LOCAL_RANK"),
    ({"WORLD_SIZE": "1"}, r"WORLD_SIZE set without RANK and LOCAL_RANK"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, r"RANK and WORLD_SIZE set without LOCAL_RANK"),
    ({"RANK": "1", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, r"RANK=1 is not below WORLD_SIZE=1 \(expected RANK in 0..0\)"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, r"RANK=2 is not below WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, r"LOCAL_RANK=1 is greater than RANK=0"),
    ({"RANK": "0", "WORLD_SIZE": "0", "LOCAL_RANK": "0"}, r"WORLD_SIZE=0: expected >= 1"),
    ({"RANK": "01", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, r"\$RANK='01' is not a canonical non-negative decimal"),
    ({"RANK": "0", "WORLD_SIZE": "+2", "LOCAL_RANK": "0"}, r"\$WORLD_SIZE='\+2' is not a canonical"),
    ({"RANK": "0", "WORLD_SIZE": " 2", "LOCAL_RANK": "0"}, r"\$WORLD_SIZE=' 2' is not a canonical"),
    ({"RANK": "0", "WORLD_SIZE": "2.0", "LOCAL_RANK": "0"}, r"\$WORLD_SIZE='2.0' is not a canonical"),
    ({"RANK": "0", "WORLD_SIZE": "1_0", "LOCAL_RANK": "0"}, r"\$WORLD_SIZE='1_0' is not a canonical"),
    ({"RANK": "0", "WORLD_SIZE": "\u0662", "LOCAL_RANK": "0"}, r"\$WORLD_SIZE='\u0662' is not a canonical"),
    ({"RANK": "-1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, r"\$RANK='-1' is not a canonical"),
    ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, r"\$RANK='x' is not a canonical"),
]
_LAUNCH_IDS = ["rank1_alone", "rank0_alone", "local_alone", "ws2_alone", "ws1_alone", "no_local", "ws1_rank1",
               "rank_eq_ws", "local_gt_rank", "ws0", "leading_zero", "plus", "space", "decimal", "underscore",
               "arabic_digit", "negative", "word"]


@pytest.mark.parametrize("env,message", _BAD_LAUNCH, ids=_LAUNCH_IDS)
def test_inconsistent_launch_variables_are_one_named_error(env, message):
    from dsv4.launch import LaunchEnvError, launch_from_env

    with pytest.raises(LaunchEnvError, match=rf"^inconsistent torchrun launch environment \(RANK.*\): {message}"):
        launch_from_env(env)


@pytest.mark.parametrize("env,want", [({}, (0, 1, 0)), ({"RANK": "", "WORLD_SIZE": "", "LOCAL_RANK": ""}, (0, 1, 0)),
                                      ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, (0, 1, 0)),
                                      ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}, (3, 4, 3)),
                                      ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, (5, 8, 1))],
                         ids=["unset", "empty", "single", "one_node", "second_node"])
def test_consistent_launch_variables_are_accepted(env, want):
    """Negative control: what torchrun sets (one node, or rank 5 = node 1's local rank 1 of 4), and nothing."""
    from dsv4.launch import launch_from_env

    got = launch_from_env(env)
    assert (got.rank, got.world_size, got.local_rank) == want


@pytest.mark.parametrize("command", [["diagnose"], ["generate", "--prompt", "x"]], ids=["diagnose", "generate"])
@pytest.mark.parametrize("env", [{"RANK": "1"}, {"RANK": "1", "WORLD_SIZE": "1", "LOCAL_RANK": "0"},
                                 {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}], ids=["rank1", "ws1_rank1", "local"])
def test_bad_launch_variables_stop_the_command_before_torch(tmp_path, command, env):
    """A stray RANK=1 made `diagnose` / `generate` print nothing, write no report and exit 0 (the process took
    itself for a silent non-zero rank). Now: exit 2, one `dsv4 COMMAND: error: ...` line, before torch is
    imported (no work), and no report file."""
    import os

    report = tmp_path / "r.json"
    argv = [*command, "--json", str(report)] if command[0] == "diagnose" else command
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DSV4_CKPT")}
    p = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**clean, **env, "PYTHONPATH": str(REPO)})
    _, code, torch_loaded = p.stdout.splitlines()[-1].split()
    err = p.stderr.strip().splitlines()[-1]
    assert (code, torch_loaded) == ("2", "False"), p.stderr
    assert err.startswith(f"dsv4 {command[0]}: error: inconsistent torchrun launch environment ("), err
    assert not report.exists()


def test_library_entry_points_check_the_launch_too(capsys, monkeypatch):
    """`run_diagnose` / `run_generate` called directly (not through the CLI) read the same check."""
    from dsv4.diagnose import run_diagnose
    from dsv4.generate import run_generate

    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert run_diagnose(None, "x", 1, None, True, "cpu") == 2
    assert run_generate(ckpt=None, prompt="x", max_tokens=1, temperature=0.0, thinking=True, seed=0,
                        device="cpu") == 2
    err = capsys.readouterr().err.splitlines()
    assert [ln.split(": error: ")[0] for ln in err] == ["dsv4 diagnose", "dsv4 generate"], err
    assert all("RANK set without WORLD_SIZE" in ln for ln in err)


# ---------------------------------------------------------------------------------------------- report files
def _no_weights(monkeypatch):
    import dsv4.checkpoint
    import dsv4.tiny

    def no_weights(*a, **k):
        raise AssertionError("a weight was read or written")

    monkeypatch.setattr(dsv4.checkpoint, "load_checkpoint", no_weights)
    monkeypatch.setattr(dsv4.tiny, "make_tiny", no_weights)


@pytest.mark.parametrize("where", ["config", "new_file_inside", "subdir", "symlink_to_config", "symlink_dir",
                                   "link_inside_ckpt", "hard_link", "via_env"])
def test_report_path_over_the_checkpoint_is_refused_before_any_work(tiny_ckpt, copy_ckpt, tmp_path, where, capsys,
                                                                    monkeypatch):
    """`--json CKPT/config.json` silently overwrote the checkpoint's config. Any report path inside the checkpoint
    directory, or resolving to one of its files (a symlink to it, a symlink inside the checkpoint pointing
    elsewhere as in a Hugging Face cache, a hard link), is refused before any weight is read; nothing is touched."""
    import os

    d = copy_ckpt(tiny_ckpt)
    outside = tmp_path / "outside"
    outside.mkdir()
    blob = outside / "blob.json"
    blob.write_text("{}")
    (d / "sub").mkdir()
    if where == "link_inside_ckpt":
        (d / "generation_config.json").unlink()
        os.symlink(blob, d / "generation_config.json")  # the checkpoint's file lives outside it
    report = {"config": d / "config.json", "new_file_inside": d / "report.json", "subdir": d / "sub" / "r.json",
              "symlink_to_config": outside / "r.json", "symlink_dir": outside / "ck" / "r.json",
              "link_inside_ckpt": blob, "hard_link": outside / "hard.json", "via_env": d / "config.json"}[where]
    if where == "symlink_to_config":
        os.symlink(d / "config.json", report)
    if where == "symlink_dir":
        os.symlink(d, outside / "ck")
    if where == "hard_link":
        os.link(d / "config.json", report)
    before = {p: p.read_bytes() for p in [*d.rglob("*"), blob] if p.is_file()}
    _no_weights(monkeypatch)
    if where == "via_env":
        monkeypatch.setenv("DSV4_CKPT", str(d))
        argv = ["diagnose", "--json", str(report)]
    else:
        argv = ["diagnose", "--ckpt", str(d), "--json", str(report)]
    code, cap = _exit(argv, capsys)
    err = cap.err.strip().splitlines()[-1]
    assert code == 2 and err.startswith(f"dsv4 diagnose: error: argument --json: {str(report)!r}: refusing to "
                                        "write the report there: "), err
    assert "write the report outside the checkpoint directory" in err
    assert {p: p.read_bytes() for p in before} == before
    assert not (d / "report.json").exists() and not (d / "sub" / "r.json").exists()


def test_report_path_beside_the_checkpoint_is_fine(tiny_ckpt, tmp_path):
    """Negative control: a report next to (not inside) the checkpoint, or in a directory whose name starts like
    the checkpoint's, passes the check; the check leaves no file behind."""
    from dsv4.report import check_report_path

    sibling = tiny_ckpt.parent / (tiny_ckpt.name + "-reports")
    sibling.mkdir(exist_ok=True)
    for p in (tiny_ckpt.parent / "report.json", sibling / "r.json", tmp_path / "r.json"):
        check_report_path(p, tiny_ckpt)
        assert not p.exists()
    assert sorted(x.name for x in sibling.iterdir()) == []


def test_failed_run_replaces_the_previous_report(tiny_ckpt, copy_ckpt, tmp_path, capsys):
    """A failed run left the previous `--json` report (`"passed": true`) in place. Now the file is replaced by a
    failure report of this run: passed false, status failed, the error line, the exit status, a run id."""
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"passed": True, "note": "an earlier run"}))
    d = copy_ckpt(tiny_ckpt)
    (d / "config.json").write_text("{")
    assert main(["diagnose", "--ckpt", str(d), "--json", str(report)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    rep = json.loads(report.read_text())
    assert rep["passed"] is False and rep["status"] == "failed" and rep["exit_status"] == 2, rep
    assert err == f"dsv4 diagnose: error: {rep['error']}" and f"{d / 'config.json'}: not valid JSON" in rep["error"]
    assert rep["run"]["command"] == "dsv4 diagnose" and len(rep["run"]["id"]) == 32 and rep["run"]["finished"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "r.json"]  # no temporary file left


def test_report_during_the_run_and_after_an_exception(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """While the run works, the file already says incomplete (passed false): a run killed before it can write
    leaves no earlier verdict behind. An exception replaces it by a failure report naming the exception and is
    re-raised (a traceback, as before)."""
    import dsv4.generate

    report = tmp_path / "r.json"
    report.write_text(json.dumps({"passed": True}))
    seen = []

    def load_model(*a, **k):
        seen.append(json.loads(report.read_text()))
        raise KeyError("boom")

    monkeypatch.setattr(dsv4.generate, "load_model", load_model)
    with pytest.raises(KeyError, match="boom"):
        main(["diagnose", "--ckpt", str(tiny_ckpt), "--json", str(report)])
    assert seen[0]["passed"] is False and seen[0]["status"] == "incomplete", seen
    rep = json.loads(report.read_text())
    assert (rep["passed"], rep["status"], rep["error"], rep["exit_status"]) == (False, "failed", "KeyError: 'boom'",
                                                                                 1)  # null before: the traceback's 1
    assert rep["run"]["exit_status"] == 1 and rep["run"]["id"] == seen[0]["run"]["id"]


def test_report_writes_are_atomic(tmp_path, monkeypatch):
    """A report is written to a temporary file beside it and moved into place: when the move fails the old file
    is intact and no temporary file stays."""
    import os

    from dsv4.report import write_atomically

    p = tmp_path / "r.json"
    p.write_text("old")
    write_atomically(p, "new")
    assert p.read_text() == "new"

    def fail(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        write_atomically(p, "newer")
    assert p.read_text() == "new" and [x.name for x in tmp_path.iterdir()] == ["r.json"]


# ---------------------------------------------------------- limits and library errors: one line, not a traceback

def _no_weights(monkeypatch):
    """Fail the test if a weight is read or generated, or a tiny checkpoint built."""
    import dsv4.checkpoint
    import dsv4.generate
    import dsv4.tiny

    def no_work(*a, **k):
        pytest.fail("the run did work (a load or a build) before refusing its input")

    monkeypatch.setattr(dsv4.generate, "load_model", no_work)
    monkeypatch.setattr(dsv4.checkpoint, "load_checkpoint", no_work)
    monkeypatch.setattr(dsv4.tiny, "make_tiny", no_work)


_CTX = "the model's context of 1024 tokens per row (original_seq_len 64 x rope_factor 16.0)"


@pytest.mark.parametrize("extra,line", [
    (["--prompt", "hi", "--max-tokens", "1100"],
     f"the prompt (5 tokens) + --max-tokens 1100 = 1105 tokens exceed {_CTX}; --max-tokens 1019 or less fits this "
     "prompt"),
    (["--prompt", "hello " * 1500],
     f"the prompt (1505 tokens) + --max-tokens 64 = 1569 tokens exceed {_CTX}; the prompt alone leaves no room for "
     "--max-tokens 1: at most 1023 prompt tokens fit, shorten it"),
    (["--prompt", "hi", "--speculative", "3", "--max-tokens", "1017"],
     f"the prompt (5 tokens) + --max-tokens 1017 + 4 (one verify step of k + 1 tokens, --speculative 3) = 1026 "
     f"tokens exceed {_CTX}; --max-tokens 1015 or less fits this prompt"),
], ids=["max-tokens", "long-prompt", "speculative"])
def test_generate_over_the_context_is_one_line_before_any_weight(tiny_ckpt, capsys, monkeypatch, extra, line):
    """User trial: `generate --max-tokens 1100` on the tiny model (context 1024) loaded it, then ended in a
    LimitError traceback, exit 1. Now one line naming the numbers and the largest value that fits, exit 2, before
    any weight is read."""
    monkeypatch.delenv("TEST_LAYERS", raising=False)
    _no_weights(monkeypatch)
    assert main(["generate", "--ckpt", str(tiny_ckpt), *extra]) == 2
    assert capsys.readouterr().err.splitlines() == [f"dsv4 generate: error: {line}"]


@pytest.mark.parametrize("extra", [["--max-tokens", "1019"], ["--speculative", "3", "--max-tokens", "1015"]])
def test_generate_at_the_context_limit_goes_on(tiny_ckpt, capsys, monkeypatch, extra):
    """The largest value the error line offers is accepted (the run itself is replaced: 1,019 tokens take minutes)."""
    import dsv4.generate

    calls = []
    monkeypatch.setattr(dsv4.generate, "run_generate", lambda **kw: calls.append(kw) or 0)
    assert main(["generate", "--ckpt", str(tiny_ckpt), "--prompt", "hi", *extra]) == 0
    assert calls and calls[0]["max_tokens"] == int(extra[-1]) and capsys.readouterr().err == ""


def test_library_input_errors_are_one_line_and_bugs_keep_their_traceback(tiny_ckpt, capsys, monkeypatch):
    """A named bad-input error of the library raised while a command runs (a serving limit, a checkpoint error) is
    the one error line with exit status 2; a plain ValueError from inside dsv4 is a bug: it propagates (traceback)."""
    import dsv4.generate
    from dsv4.formats import CheckpointError
    from dsv4.memory_plan import LimitError

    argv = ["generate", "--ckpt", str(tiny_ckpt), "--prompt", "hi", "--dtype", "fp32", "--max-tokens", "1"]
    for exc in (LimitError("the decode state of 1 row(s) x 128 tokens needs 9 GiB"),
                CheckpointError("shard 2: truncated")):
        def raise_it(*a, **k):
            raise exc
        monkeypatch.setattr(dsv4.generate, "generate", raise_it)
        assert main(argv) == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"dsv4 generate: error: {exc}"

    def bug(*a, **k):
        raise ValueError("an internal invariant broke")
    monkeypatch.setattr(dsv4.generate, "generate", bug)
    with pytest.raises(ValueError, match="an internal invariant broke"):
        main(argv)


def test_outcome_of_gives_the_process_exit_status():
    from dsv4.report import outcome_of
    from dsv4.config import ModelArgsError
    from dsv4.memory_plan import DeviceMemoryError, LimitError

    assert outcome_of(KeyboardInterrupt()) == (130, "interrupted (Ctrl-C)")
    assert outcome_of(BrokenPipeError())[0] == 141
    assert outcome_of(LimitError("over")) == (2, "over")
    assert outcome_of(DeviceMemoryError("too big")) == (2, "too big")
    assert outcome_of(ModelArgsError("dim", "bad config")) == (2, "bad config")
    assert outcome_of(MemoryError())[0] == 2
    assert outcome_of(RuntimeError("DefaultCPUAllocator: can't allocate memory: 1 TiB"))[0] == 2
    assert outcome_of(RuntimeError("shape mismatch")) == (1, "RuntimeError: shape mismatch")
    assert outcome_of(ValueError("internal")) == (1, "ValueError: internal")
    assert outcome_of(KeyError("k")) == (1, "KeyError: 'k'")
    assert outcome_of(SystemExit(3))[0] == 3


@pytest.mark.parametrize("command", ["generate", "diagnose"])
def test_no_progress_bar_is_drawn_after_the_error_line(tiny_ckpt, capsys, monkeypatch, command):
    """User trial: a load that failed at 2% printed its error line, then the half-drawn bar (`loading ... 2%`) below
    it (the bar's generator was closed only when the exception was released). Now the bar ends first."""
    import dsv4.checkpoint

    real, count = dsv4.checkpoint.Source.load, [0]

    def load(self, *a, **k):
        count[0] += 1
        if count[0] == 5:
            raise dsv4.checkpoint.CheckpointError("tensor 5: corrupt (simulated)")
        return real(self, *a, **k)

    monkeypatch.setattr(dsv4.checkpoint.Source, "load", load)
    argv = [command, "--ckpt", str(tiny_ckpt), "--dtype", "fp32"] + (["--prompt", "hi"] if command == "generate"
                                                                     else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    error = f"dsv4 {command}: error: tensor 5: corrupt (simulated)"
    assert err[-1] == error, err
    assert any("loading " in ln for ln in err[:-1]), err  # the bar was drawn, and ended before the line
