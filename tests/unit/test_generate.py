"""Generation end to end on the tiny checkpoint with the real tokenizer, through the one prompt path."""

from __future__ import annotations

import re

import pytest
import torch

from dsv4.cli import main
from dsv4.encoding import prompt_ids
from dsv4.generate import ResidualTrace, generate, load_model, sample
from dsv4.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def model_tok(tiny_ckpt):
    model, _ = load_model(tiny_ckpt, progress=False)
    return model, load_tokenizer(tiny_ckpt)


def test_generate_greedy_uses_the_prompt_path_and_traces_residuals(model_tok):
    model, tok = model_tok
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    trace = ResidualTrace(capture_last=True)
    res = generate(model, tok, msgs, max_tokens=5, trace=trace)
    assert res.prompt_ids == prompt_ids(tok, msgs, thinking=True)
    assert res.prompt_ids[-1] == 128821  # <think>
    assert 1 <= len(res.ids) <= 5 and res.stop in ("eos", "max_tokens")
    assert res.text == tok.decode(res.ids, skip_special_tokens=False)
    assert len(trace.max_abs) == len(res.ids)  # one step per forward call
    assert all(len(step) == model.args.n_layers for step in trace.max_abs)
    assert trace.last_residual.shape == (1, model.args.hc_mult, model.args.dim)
    # greedy generation is the argmax of a fresh full prefill at every step
    ids = res.prompt_ids + res.ids
    full = model(torch.tensor([ids]), model.new_state(1), all_logits=True)[0]
    assert full[len(res.prompt_ids) - 1:-1].argmax(-1).tolist() == res.ids[:len(ids) - len(res.prompt_ids)]


def test_generate_stops_at_eos(model_tok, monkeypatch):
    model, tok = model_tok
    import dsv4.generate as g
    monkeypatch.setattr(g, "sample", lambda logits, t, gen=None: torch.tensor([model.args.eos_token_id]))
    res = generate(model, tok, [{"role": "user", "content": "hi"}], max_tokens=5)
    assert res.ids == [1] and res.stop == "eos"


def test_sampling_is_seeded_and_validated():
    logits = torch.randn(1, 50)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert sample(logits, 0.7, g1).item() == sample(logits, 0.7, g2).item()
    assert sample(logits, 0.0).item() == logits.argmax().item()
    with pytest.raises(ValueError, match="temperature"):
        sample(logits, -1.0)


def test_generate_samples_at_the_requested_temperature(model_tok):
    """`generate(temperature=T, seed=s)` draws each token with `sample(logits, T, Generator(seed=s))` (spec §12;
    `sample`'s distribution is pinned by the chi-square test of test_sampler.py): the first token of 8 seeded
    generations equals that draw on the logits of the prompt's prefill. Kills a generation path that drops,
    rescales or inverts the temperature (or the seed) while `sample` itself stays right. Power: the 8 draws are
    not all the argmax (random tiny weights give a flat distribution over the 129,280 tokens)."""
    model, tok = model_tok
    msgs = [{"role": "user", "content": "Name a colour."}]
    logits = model(torch.tensor([prompt_ids(tok, msgs, thinking=True)]), model.new_state(1))
    T, want, got = 0.8, [], []
    for seed in range(8):
        want.append(int(sample(logits, T, torch.Generator().manual_seed(seed))[0]))
        got.append(generate(model, tok, msgs, max_tokens=1, temperature=T, seed=seed).ids[0])
    assert got == want, f"generate(temperature={T}) drew {got}, sample(logits, {T}, seed) draws {want}"
    assert len(set(want) - {int(logits.argmax())}) >= 2, f"draws {want} are (nearly) greedy: no power"


def test_generate_cli(tiny_ckpt, capsys):
    assert main(["generate", "--ckpt", str(tiny_ckpt), "--prompt", "Hi", "--max-tokens", "3", "--no-thinking"]) == 0
    captured = capsys.readouterr()
    assert "stop=" in captured.err and "TEST_LAYERS=4 of 4" in captured.err


def test_generate_cli_without_checkpoint(capsys, monkeypatch):
    monkeypatch.delenv("DSV4_CKPT", raising=False)
    assert main(["generate", "--prompt", "Hi"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def _scripted(monkeypatch, ids):
    """Make `generate` emit the given token ids (then EOS) instead of sampling: a known assistant text."""
    import dsv4.generate as g
    it = iter(ids)
    monkeypatch.setattr(g, "sample", lambda logits, t, gen=None: torch.tensor([next(it)]))


@pytest.mark.parametrize("thinking", [False, True], ids=["chat", "thinking"])
def test_multi_turn_continues_the_state_only_when_the_prompt_extends_it(model_tok, monkeypatch, thinking):
    """issue 24 item 3: the second turn continues the first turn's state when the new prompt's ids extend the ids
    that state holds (chat mode: turn 1 + "Paris." + EOS + turn 2), appending only the new tokens; in thinking
    mode `drop_thinking` rewrites the first turn (its `<think>` becomes `</think>`), so the state is rebuilt and
    the result says where the ids differ. Either way the greedy tokens are those of a fresh generation, and the
    first one is the argmax of one prefill of the whole new prompt."""
    model, tok = model_tok
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    answer = tok.encode("Paris.", add_special_tokens=False)
    with monkeypatch.context() as mp:
        _scripted(mp, answer + [model.args.eos_token_id])
        r1 = generate(model, tok, msgs, max_tokens=8, thinking=thinking)
    assert r1.ids == answer + [model.args.eos_token_id] and r1.reuse == "fresh"
    assert r1.chat.ids == r1.prompt_ids + answer and r1.chat.state.pos == len(r1.chat.ids)
    turn = {"role": "assistant", "content": "Paris."}
    if thinking:
        turn["reasoning_content"] = "An easy one."
    msgs2 = msgs + [turn, {"role": "user", "content": "And Spain?"}]
    kept = len(r1.chat.ids)
    r2 = generate(model, tok, msgs2, max_tokens=4, thinking=thinking, chat=r1.chat)
    fresh = generate(model, tok, msgs2, max_tokens=4, thinking=thinking)
    assert r2.ids == fresh.ids and r2.prompt_ids == fresh.prompt_ids
    if thinking:
        assert r2.reuse.startswith("rebuilt: the prompt's ids differ at position 10"), r2.reuse
    else:
        assert r2.prompt_ids[:kept] == r1.chat.ids
        assert r2.reuse == f"reused {kept} tokens, appended {len(r2.prompt_ids) - kept}", r2.reuse
    assert r2.chat.state.pos == len(r2.prompt_ids) + len(r2.ids) - 1
    full = model(torch.tensor([r2.prompt_ids]), model.new_state(1))
    assert int(full.argmax()) == r2.ids[0]


def test_a_chat_state_serves_one_next_turn(model_tok, monkeypatch):
    """A ChatState is consumed by the turn that continues it (its DecodeState advances). Giving the same one to a
    second call appended the new prompt at the wrong position, generated, and only then failed inside
    `ChatState` ("the state is at position 46 but holds 30 ids"). Now the second call is refused before any model
    step, saying to pass the newer result's chat (control: that one continues)."""
    model, tok = model_tok
    eos = model.args.eos_token_id
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    with monkeypatch.context() as mp:
        _scripted(mp, tok.encode("Paris.", add_special_tokens=False) + [eos])
        r1 = generate(model, tok, msgs, max_tokens=8, thinking=False)
    msgs2 = msgs + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"}]
    with monkeypatch.context() as mp:
        _scripted(mp, tok.encode("Madrid.", add_special_tokens=False) + [eos])
        r2 = generate(model, tok, msgs2, max_tokens=8, thinking=False, chat=r1.chat)
    assert r2.reuse.startswith("reused"), r2.reuse
    calls = []
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda *a, **k: (calls.append(1), forward(*a, **k))[1])
    with pytest.raises(ValueError, match=r"chat: this ChatState was already used by a generate call \(its state "
                                         r"advanced to position \d+, past its \d+ ids\).*newer GenerationResult.chat"):
        generate(model, tok, msgs2, max_tokens=3, thinking=False, chat=r1.chat)
    assert calls == []
    msgs3 = msgs2 + [{"role": "assistant", "content": "Madrid."}, {"role": "user", "content": "Italy?"}]
    assert generate(model, tok, msgs3, max_tokens=2, thinking=False, chat=r2.chat).reuse.startswith("reused")


def test_multi_turn_refuses_a_state_it_cannot_continue(model_tok, tiny_ckpt):
    """A chat state of another model instance, or one whose ids the new prompt does not extend, is never
    continued: the turn rebuilds and says why."""
    from dsv4.generate import ChatState, reuse_plan
    model, tok = model_tok
    other, _ = load_model(tiny_ckpt, progress=False)
    ids = prompt_ids(tok, [{"role": "user", "content": "hi"}], thinking=False)
    st = other.new_state(1)
    other(torch.tensor([ids[:-1]]), st)
    assert reuse_plan(model, ChatState(st, ids[:-1]), ids)[1] == \
        "rebuilt: the chat state belongs to another model instance"
    st = model.new_state(1)
    model(torch.tensor([ids]), st)
    assert reuse_plan(model, ChatState(st, ids), ids) == (0, "rebuilt: the prompt adds no token to the chat state")
    assert reuse_plan(model, ChatState(st, ids), ids[:-2] + [5, 6, 7])[1].startswith(
        f"rebuilt: the prompt's ids differ at position {len(ids) - 2}")
    assert reuse_plan(model, ChatState(st, ids), ids + [9]) == (len(ids), f"reused {len(ids)} tokens, appended 1")
    with pytest.raises(ValueError, match="position"):
        ChatState(st, ids + [9])
    # ids that are not token ids: named by index, never a silent rebuild
    with pytest.raises(ValueError, match=r"ChatState.ids\[2\] is -1"):
        ChatState(st, ids[:2] + [-1] + ids[3:])
    with pytest.raises(ValueError, match=r"ChatState.ids\[1\] is True"):
        ChatState(st, ids[:1] + [True] + ids[2:])
    V = model.args.vocab_size
    with pytest.raises(ValueError, match=rf"ChatState.ids\[0\] is {V}; expected a token id in 0..{V - 1}"):
        reuse_plan(model, ChatState(st, [V] + ids[1:]), ids + [9])
    for bad in ("x", st, {"state": st}):  # not a ChatState: an AttributeError deep inside before
        with pytest.raises(ValueError, match=rf"^chat: expected a ChatState .* got {type(bad).__name__}$"):
            reuse_plan(model, bad, ids)


def test_sample_refuses_a_temperature_below_the_minimum():
    """0 < T < 1e-5 was clamped to 1e-5 silently (T=1e-30 ran at 1e-5): now refused, saying to use 0 for greedy;
    T = 1e-5 itself and T = 0 still sample."""
    from dsv4.cli import TEMPERATURE_MIN as CLI_MIN, parse_args
    from dsv4.generate import TEMPERATURE_MIN
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    for t in (1e-30, 5e-6, 9.999e-6):
        with pytest.raises(ValueError, match=rf"temperature={t!r}: expected 0 \(greedy\) or a number >= 1e-05.*use "
                                             r"temperature=0 for greedy"):
            sample(logits, t)
    assert TEMPERATURE_MIN == CLI_MIN == 1e-5
    assert sample(logits, 1e-5, torch.Generator().manual_seed(0)).tolist() == [2]  # as sharp as greedy
    assert sample(logits, 0.0).tolist() == [2]
    with pytest.raises(SystemExit):
        parse_args(["generate", "--prompt", "x", "--temperature", "1e-30"])
    assert parse_args(["generate", "--prompt", "x", "--temperature", "1e-5"]).temperature == 1e-5


def test_generate_checks_its_arguments_before_any_model_step(model_tok, monkeypatch):
    """An empty final user message (the docstring's "prompt is empty"), a seed the CLI refuses (negative, or over
    64 bits: torch's "Overflow when unpacking long long"), a non-callable on_token and a trace that is not a
    ResidualTrace are ValueErrors naming the argument, raised before the model runs."""
    model, tok = model_tok
    calls = []
    monkeypatch.setattr(type(model), "forward", lambda *a, **k: calls.append(1))
    msg = [{"role": "user", "content": "What is 2+2?"}]
    bad = [
        (dict(messages=[{"role": "user", "content": ""}]), r"messages\[0\]\.content: '' is an empty prompt"),
        (dict(messages=msg + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "  \n"}]),
         r"messages\[2\]\.content: '  \\n' is an empty prompt"),
        (dict(temperature=1.0, seed=2**70), r"seed=1180591620717411303424: expected an integer in "
                                            r"0\.\.18446744073709551615 \(a 64-bit seed"),
        (dict(temperature=1.0, seed=-1), r"seed=-1: expected an integer in 0\.\.18446744073709551615"),
        (dict(on_token=5), r"on_token=5: expected None or a callable, got int"),
        (dict(trace=print), r"trace=<built-in function print>: expected None or a ResidualTrace"),
        (dict(temperature=1e-30), r"temperature=1e-30: expected 0 \(greedy\)"),
    ]
    for kw, match in bad:
        kw = {"messages": msg, **kw}
        with pytest.raises(ValueError, match=match):
            generate(model, tok, kw.pop("messages"), max_tokens=2, **kw)
    assert calls == []
    from dsv4.generate import generate_batch
    with pytest.raises(ValueError, match=r"conversations\[1\]: messages\[0\]\.content: '' is an empty prompt"):
        generate_batch(model, tok, [msg, [{"role": "user", "content": ""}]], max_tokens=1, progress=False)
    with pytest.raises(ValueError, match=r"seed=-1: expected an integer"):
        generate_batch(model, tok, [msg], max_tokens=1, temperature=0.5, seed=-1, progress=False)
    monkeypatch.undo()
    # positive control: the largest 64-bit seed samples; an earlier empty turn is history, allowed
    seen = []
    res = generate(model, tok, [{"role": "user", "content": ""}, {"role": "assistant", "content": "?"}] + msg,
                   max_tokens=2, temperature=1.0, seed=2**64 - 1, on_token=lambda i, s: seen.append(i))
    assert seen == res.ids and len(res.ids) >= 1


def test_a_finished_conversation_is_refused_and_wo_eos_continues_the_reply(model_tok, monkeypatch):
    """A conversation ending in an assistant reply renders with the end-of-sentence token last (the format closes
    every assistant turn); generating after it continued past the end of the conversation (public report
    vllm#46256: empty or garbled output). generate and generate_batch refuse it before any model step, naming the
    message; positive controls: the same reply with wo_eos=True is continued (its prompt ends in the reply's text,
    which the model is fed), and a conversation ending in a tool result is answered. A conversation ending in a
    system message (no assistant turn opened after it) is refused likewise."""
    from dsv4.encoding import prompt_ids
    from dsv4.generate import generate_batch
    model, tok = model_tok
    eos = model.args.eos_token_id
    user = {"role": "user", "content": "What is 2+2?"}
    finished = [[user, {"role": "assistant", "content": "4"}],
                [user, {"role": "assistant", "content": "4", "reasoning_content": "2+2=4"}]]
    calls = []
    monkeypatch.setattr(type(model), "forward", lambda *a, **k: calls.append(1))
    for conv in finished:
        for thinking in (True, False):
            assert prompt_ids(tok, conv, thinking=thinking)[-1] == eos  # what the check reads
            with pytest.raises(ValueError, match=r"messages\[1\] \(role 'assistant'\): the conversation ends in a "
                                                 rf"finished reply \(.*id {eos}\).*wo_eos=True"):
                generate(model, tok, conv, max_tokens=2, thinking=thinking)
    with pytest.raises(ValueError, match=r"conversations\[1\]: messages\[1\] \(role 'assistant'\)"):
        generate_batch(model, tok, [[user], finished[0]], max_tokens=1, progress=False)
    for conv in ([{"role": "system", "content": "Be brief."}], [user, {"role": "system", "content": "Be brief."}]):
        ids = prompt_ids(tok, conv)
        assert tok.decode(ids).endswith("Be brief.")  # no assistant turn opened: the text would be continued
        with pytest.raises(ValueError, match=rf"messages\[{len(conv) - 1}\] \(role 'system'\): the conversation "
                                             "ends in a system message"):
            generate(model, tok, conv, max_tokens=2)
    assert calls == []
    monkeypatch.undo()
    fed = []
    cont = [user, {"role": "assistant", "content": "The answer is", "wo_eos": True}]
    ids = prompt_ids(tok, cont)
    assert ids[-1] != eos and tok.decode(ids).endswith("The answer is")
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, x, *a, **k: (fed.append(x), forward(self, x, *a, **k))[1])
    res = generate(model, tok, cont, max_tokens=2)
    assert fed[0][0].tolist() == ids and len(res.ids) >= 1
    tool = [user, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": "{}"}}]}, {"role": "tool", "content": "4"}]
    assert len(generate(model, tok, tool, max_tokens=1).ids) == 1


@pytest.mark.parametrize("bad", [None, "", 3, ["ckpt"]])
def test_load_model_names_a_ckpt_that_is_not_a_path(bad):
    """load_model(None) was pathlib's bare TypeError ("expected str, bytes or os.PathLike object, not NoneType"):
    now a ValueError naming ckpt and what it takes."""
    with pytest.raises(ValueError, match=rf"load_model: ckpt={re.escape(repr(bad))}: expected a checkpoint "
                                         r"directory \(str or Path\) or a synthetic source"):
        load_model(bad)


def test_load_model_dtype_is_checked_and_names_accepted(tiny_ckpt):
    """dtype="bf16" was torch's TypeError from deep inside ("empty(): argument 'dtype' must be torch.dtype"):
    the CLI's names map to their torch dtype; anything else is a ValueError naming dtype and the accepted values."""
    from dsv4.generate import model_dtype
    for bad in ("bfloat16", torch.float16, None, 32):
        with pytest.raises(ValueError, match=rf"dtype={bad!r}: expected torch\.bfloat16 or torch\.float32 \(or the "
                                             r"CLI's names 'bf16' / 'fp32'\)"):
            load_model(tiny_ckpt, dtype=bad, progress=False)
    assert model_dtype("bf16") is torch.bfloat16 and model_dtype(torch.float32) is torch.float32
    model, _ = load_model(tiny_ckpt, dtype="bf16", progress=False)
    assert model.embed.weight.dtype == torch.bfloat16
