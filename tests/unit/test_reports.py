"""Issue 28, items 2-4: what a report records (versions with build tags, CUDA / GPUs, timestamp, command line, exit
status, schema version), labelled JSON rows, a bounded text report for long prompts, progress on stderr, the
memory plan checked before loading, named errors instead of tracebacks (gate reports of the wrong shape, out of
memory) and Ctrl-C: one line, exit 130, nothing half-written."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from dsv4.cli import main
from dsv4.diagnose import EXIT_PASS, environment, format_template_report, template_diff
from dsv4.memory_plan import LimitError

FAST = ["--continue-tokens", "2", "--dtype", "fp32", "--decode-steps", "1"]


@pytest.fixture(scope="module")
def diagnosed(tiny_ckpt, tmp_path_factory):
    """One `dsv4 diagnose --json` run on the tiny checkpoint: (status, stdout, stderr, report)."""
    import contextlib
    import io

    out_json = tmp_path_factory.mktemp("rep") / "r.json"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["diagnose", "--ckpt", str(tiny_ckpt), "--json", str(out_json), *FAST])
    return status, out.getvalue(), err.getvalue(), json.loads(out_json.read_text())


# ---------------------------------------------------------------- provenance

def test_versions_are_the_imports_own_with_the_build_tag(monkeypatch):
    """A CUDA wheel: package metadata says 2.14.1, the import says 2.14.1+cu130; the report must say the latter
    (the README's install on a fresh machine failed test_report_environment_commit_and_world_size on this)."""
    from importlib import metadata

    import torch

    monkeypatch.setattr(torch, "__version__", "2.14.1+cu130")
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda d: "2.14.1" if d == "torch" else real(d))
    env = environment()
    assert env["torch"] == "2.14.1+cu130"


def test_environment_names_cuda_gpus_time_platform():
    import torch

    env = environment()
    assert env["torch_cuda"] == torch.version.cuda
    assert env["cuda_available"] == torch.cuda.is_available()
    assert isinstance(env["gpus"], list) and len(env["gpus"]) == (torch.cuda.device_count()
                                                                 if torch.cuda.is_available() else 0)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", env["timestamp"])
    assert env["platform"] and env["cpu_count"] >= 1


def test_report_has_schema_command_line_exit_status(diagnosed, tiny_ckpt):
    from dsv4.report import SCHEMA_VERSION

    status, out, _, rep = diagnosed
    assert status == EXIT_PASS, out
    assert rep["schema_version"] == SCHEMA_VERSION >= 2
    argv = ["dsv4", "diagnose", "--ckpt", str(tiny_ckpt), "--json"]
    assert rep["run"]["argv"][:5] == argv and rep["run"]["command_line"] == shlex.join(rep["run"]["argv"])
    assert rep["run"]["exit_status"] == rep["exit_status"] == 0
    env = rep["environment"]
    assert {"torch_cuda", "gpus", "timestamp", "platform"} <= set(env)
    # the text report says the same: hardware line, when and how it was run, the exit status
    assert re.search(r"^hardware: torch (CPU build|built with CUDA \S+), (no GPU visible|\d+ GPU)", out, re.M)
    assert f"run: {env['timestamp']} | command: {shlex.join(rep['run']['argv'])} | report schema" in out
    assert out.rstrip().endswith("exit status: 0")


def test_alignment_rows_and_tokens_are_labelled(diagnosed):
    t1 = diagnosed[3]["test1_template"]
    keys = {"hand_pos", "hand_id", "hand_token", "template_pos", "template_id", "template_token", "op"}
    assert t1["alignment"] and all(isinstance(r, dict) and set(r) == keys for r in t1["alignment"])
    delete = next(r for r in t1["alignment"] if r["op"] == "delete")
    assert delete["hand_id"] == 271 and delete["template_pos"] is None and delete["template_id"] is None
    for op in t1["ops"]:
        assert all(set(t) == {"id", "token"} for t in op["hand_tokens"] + op["template_tokens"])


# ---------------------------------------------------------------- a bounded text report

def test_long_prompt_text_report_is_bounded_the_json_is_full(tiny_ckpt):
    from dsv4.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_ckpt)
    prompt = " ".join(f"word{i}" for i in range(6000))  # ~20k tokens
    d = template_diff(tok, prompt)
    assert len(d.template_ids) > 10_000
    text = format_template_report(d)
    assert len(text) < 40_000, len(text)  # was ~2 MB for 20k tokens: every id three times
    n = len(d.template_ids)
    assert f"template ids ({n}):" in text and f"{n - 32} ids not shown" in text
    assert str(d.template_ids[:16])[1:-1] in text and str(d.template_ids[-16:])[1:-1] in text
    assert "equal row(s) not shown" in text and "<-- delete" in text and "<-- insert" in text
    assert len(d.to_json()["template_ids"]) == n and len(d.to_json()["alignment"]) == len(d.alignment)


def test_short_prompt_text_report_is_complete(tiny_ckpt):
    from dsv4.tokenizer import load_tokenizer

    d = template_diff(load_tokenizer(tiny_ckpt), "What is the capital of France?")
    text = format_template_report(d)
    assert str(d.template_ids) in text and "not shown" not in text


# ---------------------------------------------------------------- progress

def test_progress_of_test2_and_the_continuations_on_stderr(diagnosed):
    _, out, err, _ = diagnosed
    for label in ("Test 2: final norm", "greedy continuation of the hand-rolled prompt",
                  "greedy continuation of the template prompt"):
        assert re.search(rf"^dsv4 diagnose: (Test 1: )?{label}.* \.\.\.$", err, re.M), err
        assert re.search(rf"^dsv4 diagnose: (Test 1: )?{label}.*: done in [0-9.]+ s$", err, re.M), err
        assert f"dsv4 diagnose: {label}" not in out


def test_progress_ticks_at_most_every_few_seconds(monkeypatch, capsys):
    from dsv4 import diagnose

    clock = iter([0.0, 0.5, 2.5, 3.0, 5.0, 9.0])
    monkeypatch.setattr("time.perf_counter", lambda: next(clock))
    p = diagnose.Progress("diagnose")
    with p.step("continuation"):
        for k in (1, 2, 3, 4):
            p.tick(k, 10)
    err = capsys.readouterr().err.splitlines()
    assert err == ["dsv4 diagnose: continuation ...", "dsv4 diagnose: continuation: 2/10 tokens (2.5 s)",
                   "dsv4 diagnose: continuation: 4/10 tokens (5.0 s)", "dsv4 diagnose: continuation: done in 9.0 s"]


# ---------------------------------------------------------------- the memory plan before loading

def test_memory_plan_refuses_before_any_weight(tiny_ckpt, monkeypatch):
    import torch

    from dsv4 import memory_plan
    from dsv4.generate import load_model

    monkeypatch.setattr(memory_plan, "available_bytes", lambda device: (1 << 20, "test: 1 MiB"))
    monkeypatch.setattr("dsv4.checkpoint.load_checkpoint",
                        lambda *a, **k: pytest.fail("weights were read before the memory check"))
    with pytest.raises(memory_plan.DeviceMemoryError, match=r"does not fit on cpu: .* need [0-9.]+ GiB, and cpu "
                                                            r"has 0\.00 GiB available \(test: 1 MiB\)"):
        load_model(tiny_ckpt, dtype=torch.float32)


def test_synth_flash_on_a_small_host_is_a_named_error_at_once(monkeypatch, capsys):
    """synth:flash on CPU ran 159 s, then died with a raw allocator error; now: exit 2, the numbers, no tensor."""
    import time

    from dsv4 import memory_plan

    monkeypatch.setattr(memory_plan, "available_bytes", lambda device: (64 << 30, "test: 64 GiB"))
    monkeypatch.setattr("dsv4.synth.synth_tensor", lambda *a, **k: pytest.fail("a tensor was generated"),
                        raising=False)
    t0 = time.perf_counter()
    status = main(["generate", "--ckpt", "synth:flash", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert status == 2 and time.perf_counter() - t0 < 60
    line = err.strip().splitlines()[-1]
    assert line.startswith("dsv4 generate: error: the model does not fit on cpu"), err
    assert "64.00 GiB available" in line and "43 main layer(s)" in line and "--weights quantized" in line


def test_memory_plan_counts_fp32_twice_the_bf16(tiny_ckpt):
    from dsv4.memory_plan import load_bytes
    from dsv4.synth import checkpoint_args

    args = checkpoint_args(tiny_ckpt)
    bf16 = load_bytes(args, args.n_layers, dtype_bytes=2, weights="dequantized")
    fp32 = load_bytes(args, args.n_layers, dtype_bytes=4, weights="dequantized")
    assert bf16 < fp32 < 2 * bf16 + 1


def test_available_bytes_on_this_host():
    from dsv4.memory_plan import available_bytes

    got = available_bytes("cpu")
    if got is not None:
        assert got[0] > 0 and got[1]


# ---------------------------------------------------------------- named errors, Ctrl-C

@pytest.mark.parametrize("report,field", [
    ({"hardstop": {"tests": [{"x": 1}], "failed": [], "deselected": []}}, "hardstop.tests[0] is an object"),
    ({"tests": 5}, "tests is a number"),
    ({"tests": [{"nodeid": ["x"], "outcome": "passed"}]}, "tests[0].nodeid is an array"),
    ({"summary": {"collected": 3, "total": "x"}}, "summary.total is a string"),
    ({"hardstop": []}, "hardstop is an array"),
    ({"collectors": [3]}, "collectors[0] is a number"),
])
def test_gate_report_of_the_wrong_shape_is_blocked_with_the_field_named(report, field):
    from dsv4.gate import judge_report

    base = {"hardstop": {"tests": ["a"], "failed": [], "deselected": [], "passed": True}, "git_commit": "c0ffee",
            "git_dirty": False, "tests": [{"nodeid": "a", "outcome": "passed"}], "exitcode": 0}
    problem, _ = judge_report({**base, **report}, "c0ffee", ["a"])  # a TypeError traceback before
    assert problem.startswith(f"the report is not a pytest-json-report of the expected shape: {field}, expected ")
    assert judge_report(base, "c0ffee", ["a"]) == (None, [])


def test_version(capsys):
    import dsv4

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"dsv4 {dsv4.__version__}"


def test_ctrl_c_in_make_checkpoint_one_line_130_no_index(tmp_path, monkeypatch, capsys):
    out = tmp_path / "ck"

    def interrupted(out_dir, *a, **k):  # a build stopped while writing its index
        out_dir.mkdir()
        (out_dir / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 8)
        (out_dir / "model.safetensors.index.json").write_text('{"metadata": {"total_')
        raise KeyboardInterrupt

    monkeypatch.setattr("dsv4.synth.make_checkpoint", interrupted)
    assert main(["make-checkpoint", str(out), "--geometry", "tiny"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsv4 make-checkpoint: interrupted (Ctrl-C)") and "no index" in err[0]
    assert not (out / "model.safetensors.index.json").exists()


def test_ctrl_c_never_touches_a_directory_it_found_full(tiny_ckpt, copy_ckpt, monkeypatch, capsys):
    ck = copy_ckpt(tiny_ckpt)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("dsv4.synth.make_checkpoint", interrupted)
    assert main(["make-checkpoint", str(ck), "--geometry", "tiny"]) == 130
    assert (ck / "model.safetensors.index.json").is_file()
    assert "no index" not in capsys.readouterr().err


def test_ctrl_c_in_diagnose_one_line_130_failure_report(tiny_ckpt, tmp_path, monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("dsv4.final_norm.final_norm_check", interrupted)
    rep = tmp_path / "r.json"
    assert main(["diagnose", "--ckpt", str(tiny_ckpt), "--json", str(rep), *FAST]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dsv4 diagnose: interrupted (Ctrl-C)") and "Traceback" not in "".join(err)
    doc = json.loads(rep.read_text())
    assert doc["status"] == "failed" and doc["passed"] is False and doc["error"] == "KeyboardInterrupt"
    assert doc["exit_status"] == doc["run"]["exit_status"] == 130  # null before, though the process exits 130


@pytest.mark.parametrize("exc,status,error", [
    (LimitError("the decode state needs 9 GiB"), 2, "the decode state needs 9 GiB"),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 GiB"), 2, None),
    (ZeroDivisionError("a bug"), 1, "ZeroDivisionError: a bug"),
], ids=["limit", "out-of-memory", "bug"])
def test_report_exit_status_is_the_process_status_when_the_run_raises(tiny_ckpt, tmp_path, monkeypatch, capsys,
                                                                      exc, status, error):
    """An exception in the middle of a diagnose run (here from the speculative check): the report's exit_status was
    null whatever the process then exited with. Now it is the process's status: 2 with the error line for a
    named input error or running out of memory, 1 for a bug (the traceback)."""
    def raise_it(*a, **k):
        raise exc

    monkeypatch.setattr("dsv4.diagnose.speculative_check", raise_it)
    rep = tmp_path / "r.json"
    argv = ["diagnose", "--ckpt", str(tiny_ckpt), "--json", str(rep), *FAST]
    if status == 1:
        with pytest.raises(ZeroDivisionError):
            main(argv)
    else:
        assert main(argv) == status
        line = capsys.readouterr().err.splitlines()[-1]
        assert line.startswith("dsv4 diagnose: error: ")
        error = error or line.removeprefix("dsv4 diagnose: error: ")
        assert line == f"dsv4 diagnose: error: {error}"
    doc = json.loads(rep.read_text())
    assert (doc["status"], doc["error"], doc["exit_status"], doc["run"]["exit_status"]) == ("failed", error, status,
                                                                                           status)


def test_ctrl_c_in_generate(tiny_ckpt, monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("dsv4.generate.generate", interrupted)
    assert main(["generate", "--ckpt", str(tiny_ckpt), "--prompt", "hi", "--dtype", "fp32"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "dsv4 generate: interrupted (Ctrl-C)"


def test_out_of_memory_during_a_run_is_a_named_error(tiny_ckpt, monkeypatch, capsys):
    def oom(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:119] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr("dsv4.generate.generate", oom)
    assert main(["generate", "--ckpt", str(tiny_ckpt), "--prompt", "hi", "--dtype", "fp32"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("dsv4 generate: error: out of memory: ") and "TEST_LAYERS" in line
