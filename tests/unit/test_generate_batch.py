"""`dsv4.generate.generate_batch` (issue 24 items 2 and 4): continuous batching over one ragged decode state gives
each conversation what `generate` gives it alone; the serving limits are named errors before any model work.

The rule (the function's docstring): a conversation's tokens equal `generate` alone, except from a step where the
alone run's logits put its top two tokens within the dtype's tolerance of each other (fp32: 1e-5 of the largest
|logit|; the batched decode GEMMs round in another order). The test counts such steps and fails on any other
difference; on the tiny fp32 model there are none (measured), so the count is reported, not required.
"""

from __future__ import annotations

import pytest
import torch

import dsv4.memory_plan as memory_plan
from dsv4.generate import generate, generate_batch, load_model
from dsv4.memory_plan import MAX_BATCH, LimitError, max_context
from dsv4.tokenizer import load_tokenizer

pytestmark = pytest.mark.hardstop  # a row of a continuous batch == the same conversation alone (issue 24)
REL = 1e-5  # fp32 tolerance of the top-2 gap (module docstring)

CONVS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name three prime numbers, then explain why each one is prime in one line."}],
    [{"role": "user", "content": "Count: one two three four five six seven eight nine ten eleven twelve"}],
    [{"role": "user", "content": "2+2?"}],
]
LIMITS = [6, 3, 9, 5, 7]  # different stops: rows free at different steps, waiting requests take them


@pytest.fixture(scope="module")
def model_tok(tiny_ckpt):
    model, _ = load_model(tiny_ckpt, progress=False)
    return model, load_tokenizer(tiny_ckpt)


def _near_tie_at(model, prompt: list[int], ids: list[int], k: int) -> tuple[bool, float]:
    """Whether step k of the alone run (its logits after prompt + ids[:k]) has its top two within REL of max |l|."""
    x = torch.tensor([prompt + ids[:k]])
    logits = model(x, model.new_state(1))[0]
    top = logits.topk(2).values
    gap = float(top[0] - top[1])
    return gap <= REL * float(logits.abs().max()), gap


def _check_against_alone(model, batch, alone, prompts_of) -> int:
    """Assert the rule; returns the number of near-tie divergences."""
    ties = 0
    for i, (b, a) in enumerate(zip(batch, alone)):
        assert b.prompt_ids == a.prompt_ids == prompts_of[i]
        if b.ids == a.ids:
            assert b.stop == a.stop and b.text == a.text, f"conversation {i}: same ids, other result"
            continue
        k = next(j for j, (u, v) in enumerate(zip(b.ids, a.ids)) if u != v)
        tie, gap = _near_tie_at(model, a.prompt_ids, a.ids, k)
        assert tie, (f"conversation {i}: batch and alone differ at step {k} ({b.ids[k]} vs {a.ids[k]}) where the "
                     f"top-2 gap {gap:.3g} is beyond the fp32 tolerance")
        ties += 1
    return ties


def test_generate_batch_equals_each_conversation_alone(model_tok):
    """5 conversations of different lengths in 3 rows with per-request max_tokens: rows sit at different
    positions, finish at different steps and are taken by the waiting requests (continuous batching)."""
    model, tok = model_tok
    batch = generate_batch(model, tok, CONVS, max_tokens=LIMITS, max_batch=3, progress=False)
    alone = [generate(model, tok, c, max_tokens=m) for c, m in zip(CONVS, LIMITS)]
    assert [len(r.ids) for r in batch] == [len(r.ids) for r in alone]
    assert all(r.stop in ("eos", "max_tokens") for r in batch)
    assert len({len(r.prompt_ids) for r in batch}) == len(CONVS), "the prompts must differ in length (ragged)"
    ties = _check_against_alone(model, batch, alone, [r.prompt_ids for r in alone])
    print(f"near-tie divergences: {ties} of {len(CONVS)} conversations")


def test_generate_batch_samples_like_generate(model_tok):
    """T > 0: request i draws from its own generator seeded like `generate`'s, so its tokens equal `generate`
    alone with the same seed (the neighbours' draws do not consume its random numbers). Power: the draws are not
    the greedy tokens."""
    model, tok = model_tok
    convs, limits = CONVS[:3], [4, 4, 4]
    batch = generate_batch(model, tok, convs, max_tokens=limits, temperature=0.9, seed=7, progress=False)
    alone = [generate(model, tok, c, max_tokens=m, temperature=0.9, seed=7) for c, m in zip(convs, limits)]
    assert [r.ids for r in batch] == [r.ids for r in alone]
    greedy = generate_batch(model, tok, convs, max_tokens=limits, progress=False)
    assert [r.ids for r in batch] != [r.ids for r in greedy], "control: sampling must not be greedy"


def test_generate_batch_progress_bar_on_stderr(model_tok, capsys):
    model, tok = model_tok
    generate_batch(model, tok, CONVS[:2], max_tokens=2, progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "generate_batch" in err and "2/2 done" in err


def test_generate_batch_limits_are_named_errors_before_any_work(model_tok, monkeypatch):
    model, tok = model_tok
    calls = []
    monkeypatch.setattr(type(model), "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(LimitError, match=f"batch {MAX_BATCH + 1} exceeds MAX_BATCH={MAX_BATCH}"):
        generate_batch(model, tok, [CONVS[1]] * (MAX_BATCH + 1), max_batch=MAX_BATCH + 1, progress=False)
    ctx = max_context(model.args)
    with pytest.raises(LimitError, match=f"over the model's context of {ctx} tokens per row"):
        generate_batch(model, tok, [CONVS[1]], max_tokens=ctx, progress=False)
    monkeypatch.setattr(memory_plan, "available_bytes", lambda device: (1000, "a test's device"))
    # the rows' real length (prompt + max_tokens), then the rounded size a row's state holds
    with pytest.raises(LimitError, match=r"decode state of 2 row\(s\) x (\d+) tokens needs .* GiB available "
                       r"\(a test's device\); about 0 row\(s\) of this length would fit; each row's state holds "
                       r"128 tokens \(\1 rounded up to a multiple of STATE_GRAIN = 128\)$"):
        generate_batch(model, tok, CONVS[:2], max_tokens=4, progress=False)
    with pytest.raises(ValueError, match=r"max_tokens\[1\]=0: expected an int >= 1"):
        generate_batch(model, tok, CONVS[:2], max_tokens=[3, 0], progress=False)
    with pytest.raises(ValueError, match=r"max_tokens=\[3\]: expected an int >= 1 or a list of 2"):
        generate_batch(model, tok, CONVS[:2], max_tokens=[3], progress=False)
    with pytest.raises(ValueError, match="max_batch=0"):
        generate_batch(model, tok, CONVS[:2], max_batch=0, progress=False)
    with pytest.raises(ValueError, match="non-empty list"):
        generate_batch(model, tok, [], progress=False)
    with pytest.raises(ValueError, match=r"conversations\[1\]: "):
        generate_batch(model, tok, [CONVS[0], []], progress=False)
    assert calls == [], "no model call before the limits are checked"


def test_generate_batch_continues_chats_where_the_ids_extend_them(model_tok, monkeypatch):
    """Multi-turn in a batch (issue 24 item 3): turn 1 with keep_chats=True; turn 2's prompts extend two of the
    three chats' ids and rewrite the third (its 5th id differs: a drop_thinking-like rewrite), so two rows start
    from a copy of their chat (only the new ids prefilled) and one rebuilds, and each result says which. Every
    conversation's tokens equal turn 2 run fresh (the near-tie rule), and the given chats are left as they were.
    The prompts are given through `dsv4.encoding.prompt_ids` (the one prompt path, replaced here) so that the
    ids extend exactly, whatever the random model generated."""
    import dsv4.encoding
    model, tok = model_tok
    g = torch.Generator().manual_seed(24)
    t1 = [torch.randint(0, 5000, (n,), generator=g).tolist() for n in (9, 17, 6)]
    table = {}
    monkeypatch.setattr(dsv4.encoding, "prompt_ids", lambda tok, conv, thinking=True: table[conv[0]["content"]])
    convs = [[{"role": "user", "content": f"c{i}"}] for i in range(3)]
    for i, ids in enumerate(t1):
        table[f"c{i}"] = ids
    r1 = generate_batch(model, tok, convs, max_tokens=[4, 3, 5], max_batch=2, keep_chats=True, progress=False)
    assert all(r.chat is not None and r.chat.state.pos == len(r.chat.ids) for r in r1)
    before = [r.chat.state.layers[1].keys.clone() for r in r1]
    t2 = [r1[0].chat.ids + [11, 12, 13], r1[1].chat.ids + [21], None]
    t2[2] = r1[2].chat.ids[:4] + [r1[2].chat.ids[4] + 1] + r1[2].chat.ids[5:] + [31, 32]
    convs2 = [[{"role": "user", "content": f"d{i}"}] for i in range(3)]
    for i, ids in enumerate(t2):
        table[f"d{i}"] = ids
    r2 = generate_batch(model, tok, convs2, max_tokens=5, max_batch=2, chats=[r.chat for r in r1], progress=False)
    fresh = generate_batch(model, tok, convs2, max_tokens=5, max_batch=2, progress=False)
    assert r2[0].reuse == f"reused {len(r1[0].chat.ids)} tokens, appended 3"
    assert r2[1].reuse == f"reused {len(r1[1].chat.ids)} tokens, appended 1"
    assert r2[2].reuse.startswith("rebuilt: the prompt's ids differ at position 4"), r2[2].reuse
    assert fresh[0].reuse == "fresh"
    _check_against_alone(model, r2, fresh, t2)
    assert all(torch.equal(b, r.chat.state.layers[1].keys) for b, r in zip(before, r1)), "the chats were changed"
    with pytest.raises(ValueError, match="chats: expected None or a list of 3"):
        generate_batch(model, tok, convs2, chats=[None], progress=False)


def test_generate_batch_names_the_real_row_length_not_the_rounded_state(model_tok):
    """A row over the context said `a row needs 1152 tokens (prompt + max_tokens)` when prompt + max_tokens was
    1,035: it reported the state's size rounded up to 128. Now: the conversation, its real total and its parts."""
    import dsv4.encoding

    model, tok = model_tok
    ctx = max_context(model.args)
    p = len(dsv4.encoding.prompt_ids(tok, CONVS[1], thinking=True))
    m = ctx - p + 11  # 11 over the context: rounded up it would read ctx + 128
    with pytest.raises(LimitError, match=rf"^conversations\[1\]: a row needs {ctx + 11} tokens \(prompt {p} \+ "
                                         rf"max_tokens {m}\), over the model's context of {ctx} tokens per row "
                                         r"\(original_seq_len \d+ x rope_factor [\d.]+\); shorten the prompt"):
        generate_batch(model, tok, [CONVS[0], CONVS[1]], max_tokens=[4, m], progress=False)
