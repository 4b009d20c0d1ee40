"""`dsv4 diagnose`, the main job: both decisive tests in one report, exit 0 on pass, 3 on a hard stop, 2 on
bad input. The negative cases run the same entry point with the final norm bypassed and with a hand-rolled
prompt, and check that it stops and says why."""

from __future__ import annotations

import json

import pytest

from dsv4.cli import main
from dsv4.diagnose import EXIT_ERROR, EXIT_HARD_STOP, EXIT_PASS, hand_rolled_ids
from dsv4.model import Transformer


def _run(capsys, *args):
    status = main(["diagnose", *args])
    return status, capsys.readouterr().out


@pytest.mark.hardstop
def test_diagnose_passes_and_reports_both_halves(tiny_ckpt, tmp_path, capsys):
    out_json = tmp_path / "report.json"
    status, out = _run(capsys, "--ckpt", str(tiny_ckpt), "--json", str(out_json))
    assert status == EXIT_PASS, out
    for label in ("== Test 1: prompt format", "hand-rolled ids", "template ids", 'extra in hand-rolled: "\\n\\n" (id 271)',
                  '"<think>" (id 128821)', "greedy top-1 after switching to the template",
                  "== Test 2: final norm", "final norm applied before the LM head", "argmax_A", "argmax_B", "cos",
                  "rel_L2", "KL", "TEST_LAYERS in effect: 4", "config_sha256", "RESULT: PASS"):
        assert label in out, label
    rep = json.loads(out_json.read_text())
    assert rep["passed"] and rep["test1_template"]["passed"] and rep["test2_final_norm"]["passed"]
    assert rep["test1_template"]["fed_ids"][-1] == 128821
    assert rep["test2_final_norm"]["norm_calls"] == 3  # prefill + 2 decode steps
    spec = rep["test1_template"]["speculative"]  # issue 26 item 4: the continuation decoded speculatively
    assert spec["equal"] and spec["oracle"]["equal"] and spec["adversary"]["equal"], spec
    assert spec["tokens"] == len(rep["test1_template"]["continuation"]["template"]["ids"])
    assert spec["adversary"]["mean_accepted_length"] == 1.0 and spec["oracle"]["mean_accepted_length"] > 1
    assert "speculative decoding check" in out and "EQUAL to the plain continuation" in out


def test_diagnose_chat_mode_and_test_layers(tiny_ckpt, capsys, monkeypatch):
    monkeypatch.setenv("TEST_LAYERS", "2")
    status, out = _run(capsys, "--ckpt", str(tiny_ckpt), "--no-thinking", "--dtype", "fp32", "--decode-steps", "1")
    assert status == EXIT_PASS, out
    assert "TEST_LAYERS in effect: 2 of 4 main layers" in out
    assert '"</think>" (id 128822)' in out


@pytest.mark.hardstop
def test_diagnose_hard_stops_when_final_norm_bypassed(tiny_ckpt, capsys, monkeypatch):
    def no_norm(self, H):
        return self.head(self.hc_head(H, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.backend))

    monkeypatch.setattr(Transformer, "final_logits", no_norm)
    status, out = _run(capsys, "--ckpt", str(tiny_ckpt), "--dtype", "fp32")
    assert status == EXIT_HARD_STOP, out
    assert "final norm applied before the LM head (executions on the path, per step): NO (0 of 3 steps)" in out
    assert "RESULT: HARD STOP" in out


@pytest.mark.hardstop
def test_diagnose_hard_stops_on_hand_rolled_prompt(tiny_ckpt, capsys, monkeypatch):
    import dsv4.diagnose as d

    monkeypatch.setattr(d, "prompt_ids", lambda tok, messages, thinking=True, **kw:
                        hand_rolled_ids(tok, messages[-1]["content"]))
    status, out = _run(capsys, "--ckpt", str(tiny_ckpt), "--dtype", "fp32")
    assert status == EXIT_HARD_STOP, out
    assert "Test 1 HARD STOP: the ids fed to the model are not the official prompt format" in out


def test_special_string_in_the_prompt_is_warned_about_once(tiny_ckpt, capsys, caplog):
    """A prompt holding a format special string: the log warning (stderr) appeared twice per run, since diagnose
    built the official prompt twice; now once, plus the report's own WARNING line."""
    prompt = "hi <｜Assistant｜> there"
    with caplog.at_level("WARNING", logger="dsv4.encoding"):
        status, out = _run(capsys, "--ckpt", str(tiny_ckpt), "--dtype", "fp32", "--prompt", prompt,
                           "--continue-tokens", "1", "--decode-steps", "1")
    assert status == EXIT_PASS, out
    warned = [r.getMessage() for r in caplog.records if "special string" in r.getMessage()]
    assert warned == ["messages[0].content contains the special string '<｜Assistant｜>': it is tokenised as the "
                      "special token, as the official encoder does"]
    assert out.count("WARNING: the prompt contains special strings ['<｜Assistant｜>']") == 1


@pytest.mark.parametrize("value", ["0", "5", "two", "-1", "+2", "1_0", " 2", "02"])
def test_diagnose_rejects_bad_test_layers(tiny_ckpt, capsys, monkeypatch, value):
    monkeypatch.setenv("TEST_LAYERS", value)
    assert main(["diagnose", "--ckpt", str(tiny_ckpt)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"dsv4 diagnose: error: ") and f"TEST_LAYERS={value!r}" in err and "1..4" in err


def test_diagnose_missing_checkpoint(tmp_path, capsys):
    assert main(["diagnose", "--ckpt", str(tmp_path / "nope")]) == EXIT_ERROR
    assert "dsv4 diagnose: error: --ckpt=" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["diagnose", "TEST_LAYERS=10"], ["diagnose", "--decode-step", "2"],
                                  ["diagnose", "--decode-steps", "0"], ["generate", "--prompt", "x", "--max-token", "3"]])
def test_cli_rejects_unknown_or_abbreviated_arguments(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_diagnose_builds_a_tiny_checkpoint_by_default(capsys, monkeypatch):
    monkeypatch.delenv("DSV4_CKPT", raising=False)
    monkeypatch.delenv("TEST_LAYERS", raising=False)
    status, out = _run(capsys, "--dtype", "fp32", "--decode-steps", "1")
    assert status == EXIT_PASS, out
    assert "tiny checkpoint built on the fly" in out


@pytest.mark.parametrize("argv,msg", [
    (["generate", "--prompt", "x", "--temperature", "inf"], "not a finite number"),
    (["diagnose", "--device", "bogus"], "not a torch device"),
    (["diagnose", "--json", "/nonexistent-dir/r.json"], "does not exist"),
    (["diagnose", "--json", "/tmp"], "is a directory"),
    (["diagnose", "--prompt", "\udc80"], "not valid UTF-8"),
])
def test_cli_rejects_bad_values_before_loading(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_make_tiny_unwritable_target(capsys):
    assert main(["make-tiny", "/proc/dsv4-cannot-write-here"]) == 2
    assert "dsv4 make-tiny: error" in capsys.readouterr().err


def test_diagnose_with_quantized_resident_weights(tiny_ckpt, capsys):
    status, out = _run(capsys, "--ckpt", str(tiny_ckpt), "--weights", "quantized", "--dtype", "fp32",
                       "--decode-steps", "1")
    assert status == EXIT_PASS, out
    assert "weights quantized" in out


@pytest.mark.hardstop
def test_diagnose_is_inconclusive_not_pass_under_a_huge_eps(tiny_ckpt, copy_ckpt, tmp_path, capsys):
    """issue 22: `rms_norm_eps: 1e30` gave "Test 2 PASS" with cos 0.000 and rel L2 98.96 (the no-norm signature)
    against a tolerance of 1e35. Now: INCONCLUSIVE with its reason, exit status 4 (not 0), JSON not passed."""
    from dsv4.diagnose import EXIT_INCONCLUSIVE

    d = copy_ckpt(tiny_ckpt)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e30
    (d / "config.json").write_text(json.dumps(cfg))
    out_json = tmp_path / "r.json"
    status, out = _run(capsys, "--ckpt", str(d), "--dtype", "fp32", "--decode-steps", "1", "--continue-tokens", "8",
                       "--json", str(out_json))
    assert status == EXIT_INCONCLUSIVE == 4, out
    assert "Test 2 INCONCLUSIVE" in out and "RESULT: INCONCLUSIVE" in out and "RESULT: PASS" not in out
    assert "NOT rejected" in out
    rep = json.loads(out_json.read_text())
    assert rep["outcome"] == "INCONCLUSIVE" and rep["passed"] is False
    assert rep["test2_final_norm"]["outcome"] == "INCONCLUSIVE" and rep["test2_final_norm"]["passed"] is False


@pytest.mark.hardstop
def test_test1_is_anchored_to_the_official_special_ids(tiny_ckpt, capsys, monkeypatch):
    """Test 1 compares our template with our encoder through the same tokenizer; both would agree on a tokenizer
    with other special ids. The official ids anchor it: the real tokenizer matches them; a mismatch (here the
    expected table altered, as a tokenizer with other ids would look) is a HARD STOP naming the string."""
    import dsv4.diagnose as d
    from dsv4.tokenizer import load_tokenizer

    assert d.special_id_problems(load_tokenizer(tiny_ckpt)) == []
    assert d.OFFICIAL_SPECIAL_IDS[d.USER] == 128803 and d.OFFICIAL_SPECIAL_IDS[d.THINK_END] == 128822
    monkeypatch.setitem(d.OFFICIAL_SPECIAL_IDS, d.USER, 128804)
    status, out = _run(capsys, "--ckpt", str(tiny_ckpt), "--dtype", "fp32", "--decode-steps", "1",
                       "--continue-tokens", "8")
    assert status == EXIT_HARD_STOP, out
    assert 'problem: "<｜User｜>" encodes to [128803], expected the official [128804]' in out
    assert "Test 1 FAIL: the tokenizer's special ids are not DeepSeek-V4's official ones" in out


def test_speculative_check_reports_a_rollback_bug(tiny_ckpt, capsys, monkeypatch):
    """Negative control of the diagnose check: a rollback that keeps every rejected token (the state left after the
    whole verify step, positions reset) makes the adversary's decode differ, and the report says DIFFERS."""
    from dsv4.model import Transformer

    def no_rollback(self, state, record, keep):
        state.row_pos = [p + k for p, k in zip(record.pos0, keep)]
    monkeypatch.setattr(Transformer, "rollback", no_rollback)
    status, out = _run(capsys, "--ckpt", str(tiny_ckpt))
    assert "DIFFERS from the plain continuation" in out and "adversary drafter, k=2: first difference" in out


# ------------------------------------------------------------------ token counts against the model's context

_CTX = "the model's context of 1024 tokens per row (original_seq_len 64 x rope_factor 16.0)"


@pytest.mark.parametrize("extra,line", [
    (["--continue-tokens", "2000"],
     f"Test 1: the prompt (11 tokens) + --continue-tokens 2000 + 4 (the speculative decoding check decodes the "
     f"continuation again in verify steps of k + 1 = 4 tokens) = 2015 tokens exceed {_CTX}; --continue-tokens 1009 "
     "or less fits this prompt"),
    (["--decode-steps", "2000"],
     f"Test 2: the prompt (11 tokens) + --decode-steps 2000 + 1 (the token after the prefill: Test 2 generates "
     f"--decode-steps + 1 tokens) = 2012 tokens exceed {_CTX}; --decode-steps 1012 or less fits this prompt"),
    (["--prompt", "hello " * 1500],
     f"Test 2: the prompt (1505 tokens) + --decode-steps 2 + 1 (the token after the prefill: Test 2 generates "
     f"--decode-steps + 1 tokens) = 1508 tokens exceed {_CTX}; the prompt alone leaves no room for --decode-steps "
     "1: at most 1022 prompt tokens fit, shorten it"),
], ids=["continue-tokens", "decode-steps", "long-prompt"])
@pytest.mark.parametrize("given", [True, False], ids=["ckpt", "built"])
def test_diagnose_refuses_lengths_over_the_context_before_any_work(tiny_ckpt, tmp_path, capsys, monkeypatch, extra,
                                                                   line, given):
    """User trial: `--continue-tokens 2000` ran Test 2 and both continuations past the 1,024-token context (~48 s)
    and crashed in speculative_check (JSON exit_status null); `--decode-steps 2000` and a 1,505-token prompt ran
    and PASSED. Now each is refused before any work (no load, no tiny checkpoint built): one line naming the
    numbers and the largest value that fits, exit 2, and the report says so with exit_status 2."""
    import dsv4.generate
    import dsv4.tiny

    def no_work(*a, **k):
        pytest.fail("the run did work (a load or a build) before refusing its input")

    monkeypatch.setattr(dsv4.generate, "load_model", no_work)
    monkeypatch.setattr(dsv4.tiny, "make_tiny", no_work)
    monkeypatch.delenv("DSV4_CKPT", raising=False)
    rep = tmp_path / "r.json"
    status = main(["diagnose", *(["--ckpt", str(tiny_ckpt)] if given else []), "--json", str(rep), *extra])
    assert status == EXIT_ERROR
    assert capsys.readouterr().err.splitlines() == [f"dsv4 diagnose: error: {line}"]
    doc = json.loads(rep.read_text())
    assert (doc["status"], doc["error"], doc["exit_status"], doc["run"]["exit_status"]) == ("failed", line, 2, 2)


def test_check_lengths_takes_the_tightest_row_and_the_state_grain():
    """--continue-tokens is bounded by three rows (hand-rolled, template, the speculative check's verify step in
    whole 128-token blocks); the error names the tightest and its largest value. A context that is not a multiple of
    128 leaves the speculative check only the whole blocks."""
    import dataclasses

    from dsv4.diagnose import check_lengths
    from dsv4.memory_plan import LimitError
    from dsv4.tiny import tiny_args

    args = tiny_args()
    check_lengths(args, template_tokens=10, hand_rolled_tokens=20, decode_steps=1013, continue_tokens=1004)
    with pytest.raises(LimitError) as e:
        check_lengths(args, template_tokens=10, hand_rolled_tokens=20, decode_steps=1, continue_tokens=1005)
    assert str(e.value) == (f"Test 1: the hand-rolled prompt (20 tokens) + --continue-tokens 1005 = 1025 tokens "
                            f"exceed {_CTX}; --continue-tokens 1004 or less fits this prompt")
    with pytest.raises(LimitError, match=r"\+ --decode-steps 1014 \+ 1 .* --decode-steps 1013 or less fits"):
        check_lengths(args, template_tokens=10, hand_rolled_tokens=20, decode_steps=1014, continue_tokens=1)
    odd = dataclasses.replace(args, rope_factor=15.625)  # context 1000: the state holds 7 blocks of 128 = 896
    check_lengths(odd, template_tokens=10, hand_rolled_tokens=10, decode_steps=1, continue_tokens=882)
    with pytest.raises(LimitError) as e:
        check_lengths(odd, template_tokens=10, hand_rolled_tokens=10, decode_steps=1, continue_tokens=883)
    assert ("exceed the model's context of 1000 tokens per row (original_seq_len 64 x rope_factor 15.625), of which "
            "a decode state held in blocks of 128 tokens can use 896; --continue-tokens 882 or less fits"
            ) in str(e.value)


def test_diagnose_runs_at_the_context_limit_and_refuses_one_more(tiny_ckpt, copy_ckpt, capsys):
    """The limits are the library's own: on a model of context 128 (rope factor 2) a prompt that leaves a few
    tokens runs Test 2 and Test 1 (continuations and the speculative check) at the largest values the check
    allows without any limit error, and one token more is refused before the load."""
    from dsv4.diagnose import _prompt_lengths, check_lengths
    from dsv4.memory_plan import max_context
    from dsv4.synth import checkpoint_args
    from dsv4.tokenizer import load_tokenizer

    d = copy_ckpt(tiny_ckpt)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"]["factor"] = 2.0
    cfg["max_position_embeddings"] = 128  # the config must say the context it describes (dsv4.config)
    (d / "config.json").write_text(json.dumps(cfg))
    args = checkpoint_args(d)
    assert max_context(args) == 128
    prompt = "hello " * 110
    hand, fed = _prompt_lengths(load_tokenizer(d), prompt, True)
    steps, cont = 128 - fed - 1, min(128 - hand, 128 - fed - 4)
    assert fed == 115 and steps == 12 and cont == 9
    check_lengths(args, template_tokens=fed, hand_rolled_tokens=hand, decode_steps=steps, continue_tokens=cont)
    base = ["--ckpt", str(d), "--prompt", prompt, "--dtype", "fp32"]
    status, out = _run(capsys, *base, "--decode-steps", str(steps), "--continue-tokens", str(cont))
    assert status == EXIT_PASS, out
    assert "Test 2 PASS" in out  # and the speculative check ran its whole continuation, up to the context's end
    assert f"speculative decoding check (verify steps + rollback; the template continuation, {cont} tokens" in out
    for option, fits in (("--decode-steps", steps), ("--continue-tokens", cont)):
        assert main(["diagnose", *base, option, str(fits + 1)]) == EXIT_ERROR
        assert capsys.readouterr().err.splitlines()[-1].endswith(f"{option} {fits} or less fits this prompt")


def test_synthetic_source_says_what_is_generated_before_the_slow_load(tiny_ckpt, capsys, monkeypatch):
    """User trial: `diagnose --ckpt synth:flash:1` on CPU showed nothing for 100+ s while the first tensors were
    generated. Now a line says what is generated (spec, device, tensors, values, GiB) and that it is slow on CPU,
    before the load starts (here the load is replaced: it takes minutes)."""
    import re

    import dsv4.generate
    from dsv4 import memory_plan
    from dsv4.formats import CheckpointError

    monkeypatch.setattr(memory_plan, "available_bytes", lambda device: (1 << 40, "test: 1 TiB"))
    monkeypatch.delenv("TEST_LAYERS", raising=False)

    def stop(*a, **k):
        raise CheckpointError("load replaced by the test")

    monkeypatch.setattr(dsv4.generate, "load_model", stop)
    note = (r"generating the synthetic weights of synth:flash:1:0 on cpu \(\d+ tensors, \d+\.\d\d billion values, 1 "
            r"main layer\(s\){mtp}, \d+\.\d GiB as held\): random values computed from \(seed, tensor name\), nothing "
            r"is read from a file; slow on CPU: of the order of 1e\+07 values per second on a few cores \(~\d+ min "
            r"here\), and no progress shows while the first, largest tensors are generated")
    assert main(["diagnose", "--ckpt", "synth:flash:1"]) == EXIT_ERROR
    err = capsys.readouterr().err.splitlines()
    assert re.fullmatch("dsv4 diagnose: " + note.format(mtp=""), err[0]), err
    assert err[1:] == ["dsv4 diagnose: generating the weights of synth:flash:1:0 ...",
                       "dsv4 diagnose: error: load replaced by the test"]
    assert main(["generate", "--ckpt", "synth:flash:1", "--prompt", "hi", "--speculative", "1"]) == EXIT_ERROR
    err = capsys.readouterr().err.splitlines()
    assert re.fullmatch("dsv4 generate: " + note.format(mtp=", MTP block"), err[0]), err
    assert err[1:] == ["dsv4 generate: error: load replaced by the test"]
