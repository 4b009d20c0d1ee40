"""Speculative greedy decoding (issue 26 items 2-3, `dsv4.speculative`): speculative greedy == plain greedy, and the
verify step's rollback leaves the state of the accepted prefix.

Anchor: plain greedy decoding of the same prompt, one token per call. Over 260 tokens from a 21-token prompt on
the tiny geometry (window 8, ratios 0/4/128/4, index_topk 4) the verify windows cross ratio-4 boundaries, the
ratio-128 boundary (position 127) and the ring's wrap many times; four drafters: the oracle (the plain greedy
continuation: every draft accepted), an adversary (every draft wrong: each round rolls back all of them), a random
one (rejected: random ids from 512), and an EOS-injecting oracle (drafts EOS where the model's token is not: it must
be rejected; rounds accept 0..k drafts, so rollbacks go to every prefix length). The tokens must be equal one for one; a divergence is allowed only at a step
whose plain-run top two logits lie within fp32 1e-5 of the largest |logit| (the verify step batches k + 1
positions: fp32 sums in another order), counted and reported (none measured).

A batch (`speculative_greedy_batch`): four ragged rows with different drafters and stopping times each equal plain
greedy of their prompt alone (the same near-tie rule); a sampled batch's rows equal each row sampled alone.
Sampling end to end: the whole loop's first three tokens against plain sampling's exact distribution (a
16-token vocabulary), chi-square at a stated false-alarm rate, with negative controls through the same loop.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.model import Transformer
from dsv4.speculative import AdversaryDrafter, ContinuationDrafter, RandomDrafter, speculative_greedy
from dsv4.tiny import random_state_dict, tiny_args

pytestmark = pytest.mark.hardstop  # speculative greedy == plain greedy; the rollback's state (issue 26)
VOCAB, REL, N, EOS = 512, 1e-5, 260, 7


@pytest.fixture(scope="module")
def run():
    args = tiny_args(vocab_size=VOCAB, index_topk=4)
    m = Transformer(args)
    m.load_weights({k: v for k, v in random_state_dict(args, seed=26).items() if not k.startswith("mtp.")})
    prompt = torch.randint(0, VOCAB, (21,), generator=torch.Generator().manual_seed(26)).tolist()
    out, logits = _plain(m, prompt, N)
    assert EOS not in out, "the test's EOS id must not be a plain greedy token (the run ends at max_tokens)"
    return m, prompt, out, logits


def _plain(m: Transformer, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Plain greedy decoding of `prompt` alone, one token per call: (n tokens, the logits [V] each came from)."""
    st, logits, out = m.new_state(1), [], []
    lg = m(torch.tensor([prompt]), st)
    for _ in range(n):
        logits.append(lg[0])
        out.append(int(lg.argmax(-1)))
        lg = m(torch.tensor([[out[-1]]]), st)
    return out, logits


def _check(got: list[int], plain: list[int], logits: list[torch.Tensor], what: str) -> int:
    for i, (g, p) in enumerate(zip(got, plain)):
        if g != p:
            top = logits[i].topk(2).values
            gap, scale = float(top[0] - top[1]), float(logits[i].abs().max())
            assert gap <= REL * scale, f"{what}: token {i} is {g}, plain greedy {p} (top-2 gap {gap:.3g})"
            return 1  # a near-tie: the rest follows another (equally valid) path
    assert len(got) == len(plain), f"{what}: {len(got)} tokens, plain {len(plain)}"
    return 0


@pytest.mark.parametrize("name,k", [("oracle", 3), ("oracle", 7), ("adversary", 2), ("random", 4),
                                    ("eos_drafts", 3)])
def test_speculative_greedy_equals_plain_greedy(run, name, k):
    m, prompt, plain, logits = run
    n = len(prompt)
    drafter = {"oracle": ContinuationDrafter(n, plain), "adversary": AdversaryDrafter(n, plain, VOCAB),
               "random": RandomDrafter(VOCAB, seed=k),
               "eos_drafts": ContinuationDrafter(n, [EOS if i % 5 == 2 else t for i, t in enumerate(plain)])}[name]
    res = speculative_greedy(m, prompt, drafter, k=k, max_tokens=N, eos=EOS)
    ties = _check(res.ids, plain, logits, f"{name} k={k}")
    assert res.stop == "max_tokens" and EOS not in res.ids
    if name == "oracle" and not ties:
        assert all(a == k for a in res.accepted[:-1]), f"the oracle's drafts must all be accepted: {res.accepted}"
        assert res.mean_accepted_length > k
    if name == "adversary":
        assert set(res.accepted) == {0} and len(res.accepted) == N - 1
    if name == "eos_drafts":
        assert set(res.accepted) == set(range(k + 1)), f"rollbacks to every prefix length: {set(res.accepted)}"
    print(f"{name} k={k}: {len(res.accepted)} verify rounds, mean accepted length "
          f"{res.mean_accepted_length:.2f}, near-tie divergences {ties}")


def test_rollback_of_a_ragged_batch_keeps_each_rows_prefix(run, seed):
    """Two rows at different positions verify 5 tokens each and keep 2 and 5 of them (rows accept different
    lengths); the decode steps after the rollback equal each row's conversation fed only its kept tokens, fp32
    1e-5. Row 0 sits so that its rejected tokens complete a ratio-4 window (an entry committed, then rolled back).
    Negative control: without the rollback (state left after all 5 tokens, positions reset) row 0 differs."""
    m = run[0]
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (13, 30)]
    ver = torch.randint(0, VOCAB, (2, 5), generator=g)
    after = [torch.randint(0, VOCAB, (2, 1), generator=g) for _ in range(6)]
    keep = [2, 5]

    def batch(rollback: bool) -> list[torch.Tensor]:
        st = m.new_state(2, 128)
        for i, p in enumerate(prompts):
            m(p[None], st.row(i))
        _, rec = m.verify(ver, st)
        if rollback:
            m.rollback(st, rec, keep)
        else:
            st.row_pos = [p + k for p, k in zip(rec.pos0, keep)]
        return [m(a, st) for a in after]

    got, wrong = batch(True), batch(False)
    for i, p in enumerate(prompts):
        st = m.new_state(1)
        m(torch.cat((p, ver[i, :keep[i]]))[None], st)
        for j, a in enumerate(after):
            want = m(a[i:i + 1], st)
            d, scale = float((got[j][i] - want[0]).abs().max()), float(want.abs().max())
            assert d <= REL * scale, f"row {i} step {j} after the rollback: |d| {d:.3g}"
            if i == 0 and j == 0:
                assert float((wrong[j][0] - want[0]).abs().max()) > 100 * REL * scale, "control: no rollback"


def test_verify_and_rollback_name_misuse(run):
    m = run[0]
    st = m.new_state(1, 128)
    with pytest.raises(ValueError, match="every row must be prefilled"):
        m.verify(torch.tensor([[1, 2]]), st)
    m(torch.tensor([[1, 2, 3]]), st)
    with pytest.raises(ValueError, match=r"9 tokens per row; expected 2..8"):
        m.verify(torch.ones(1, 9, dtype=torch.long), st)
    _, rec = m.verify(torch.tensor([[4, 5, 6]]), st)
    for keep in ([4], [0], [True], 2, [1, 1]):
        with pytest.raises(ValueError, match=r"rollback: keep=.*; expected a list of 1 ints in 1..3"):
            m.rollback(st, rec, keep)
    m.rollback(st, rec, [1])
    assert st.pos == 4
    with pytest.raises(ValueError, match=r"the state moved since the verify call"):
        m.rollback(st, rec, [1])  # a record is used once
    # a state that moved and came back to the record's position (found by a fresh-user attack)
    _, rec = m.verify(torch.tensor([[4, 5, 6]]), st)
    m.rollback(st, rec, [1])
    m(torch.tensor([[9, 9]]), st)
    assert st.pos == 7 == rec.pos0[0] + rec.s
    with pytest.raises(ValueError, match="the state moved since the verify call"):
        m.rollback(st, rec, [2])
    other = m.new_state(1, 128)
    m(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), other)
    _, rec2 = m.verify(torch.tensor([[1, 2, 3]]), other)
    m(torch.tensor([[1, 2, 3]]), st)
    with pytest.raises(ValueError, match="the record is another state's"):
        m.rollback(st, rec2, [2])
    with pytest.raises(ValueError, match=r"5 tokens per row > window_size 4"):
        small = Transformer(tiny_args(vocab_size=VOCAB, window_size=4))
        small.load_weights({k: v for k, v in random_state_dict(small.args, seed=1).items()
                            if not k.startswith("mtp.")})
        sst = small.new_state(1, 128)
        small(torch.tensor([[1, 2, 3, 4, 5, 6]]), sst)
        small.verify(torch.tensor([[1, 2, 3, 4, 5]]), sst)
    with pytest.raises(ValueError, match=r"k=8"):
        speculative_greedy(m, [1, 2], RandomDrafter(VOCAB), k=8, max_tokens=4)
    with pytest.raises(ValueError, match="drafter returned"):
        speculative_greedy(m, [1, 2], ContinuationDrafter(2, [VOCAB + 5] * 9), k=2, max_tokens=4)


def test_verify_on_a_growable_state_that_must_grow(run):
    """A verify call that makes a growable state reallocate keeps its record (taken after the reallocation)."""
    m = run[0]
    st = m.new_state(1)
    m(torch.randint(0, VOCAB, (1, 126)), st)
    assert st.max_len == 128
    logits, rec = m.verify(torch.tensor([[1, 2, 3, 4]]), st)
    assert st.max_len > 128 and all(len(t) == 4 for t in rec.trails if t)
    m.rollback(st, rec, [2])
    assert st.pos == 128


@pytest.fixture(scope="module")
def mtp_model():
    args = tiny_args(vocab_size=VOCAB, index_topk=4)
    m = Transformer(args, mtp=True)
    m.load_weights(random_state_dict(args, seed=26))  # the main weights of `run`'s model, plus mtp.0.*
    return m


def test_speculative_greedy_with_the_mtp_drafter_equals_plain_greedy(run, mtp_model):
    """The MTP block as drafter (k = 3: one MTP step on the main streams, two chained on its own): the output is
    plain greedy (the drafter cannot change it: every emitted token is verified); the drafter's state stays at
    the main model's position (it consumed every kept position once)."""
    _, prompt, plain, logits = run
    from dsv4.speculative import MTPDrafter
    d = MTPDrafter(mtp_model)
    res = speculative_greedy(mtp_model, prompt, d, k=3, max_tokens=N, eos=EOS)
    ties = _check(res.ids, plain, logits, "mtp k=3")
    assert d.pos == len(prompt) + sum(a + 1 for a in res.accepted) or ties
    print(f"mtp k=3: {len(res.accepted)} rounds, mean accepted length {res.mean_accepted_length:.2f} (random "
          f"weights: meaningless), near-tie divergences {ties}")


def test_mtp_block_prefill_equals_token_by_token(mtp_model, seed):
    """The MTP block over a prompt's positions in one call equals the same positions one call at a time (its
    window state across calls: the ring wraps at 8), fp32 within 1e-5; and its logits depend on both inputs
    (negative controls: another H, another next token)."""
    m = mtp_model
    blk = m.mtp[0]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, 20), generator=g)
    with torch.no_grad():
        _, H = m(ids, m.new_state(1), streams=True)
        nxt = torch.randint(0, VOCAB, (1, 20), generator=g)
        st = blk.attn.new_state(1, 128, m.dtype, m.device)
        whole, _ = blk.predict(H, m.embed(nxt), 0, nxt, st, m.backend, m.head)
        st = blk.attn.new_state(1, 128, m.dtype, m.device)
        steps = [blk.predict(H[:, t:t + 1], m.embed(nxt[:, t:t + 1]), t, nxt[:, t:t + 1], st, m.backend, m.head)[0]
                 for t in range(20)]
        other_h, _ = blk.predict(H.flip(1), m.embed(nxt), 0, nxt, blk.attn.new_state(1, 128, m.dtype, m.device),
                                 m.backend, m.head)
        other_t, _ = blk.predict(H, m.embed(nxt.flip(1)), 0, nxt, blk.attn.new_state(1, 128, m.dtype, m.device),
                                 m.backend, m.head)
    scale = float(whole.abs().max())
    assert float((torch.cat(steps, 1) - whole).abs().max()) <= REL * scale
    assert float((other_h - whole).abs().max()) > 100 * REL * scale, "control: H must matter"
    assert float((other_t - whole).abs().max()) > 100 * REL * scale, "control: the next token must matter"


def test_mtp_loads_from_a_checkpoint_in_both_weight_modes(tiny_ckpt):
    """`load_model(..., mtp=True)` reads `mtp.*` from the official files (dequantized and quantized: the same
    logits bit for bit, as for the main layers), and the MTP drafter runs on both."""
    from dsv4.generate import load_model
    from dsv4.speculative import MTPDrafter
    outs = []
    for weights in ("dequantized", "quantized"):
        m, _ = load_model(tiny_ckpt, progress=False, weights=weights, mtp=True)
        assert m.mtp is not None and not m.mtp[0].ffn.gate.hash
        res = speculative_greedy(m, [5, 6, 7, 8, 9], MTPDrafter(m), k=2, max_tokens=12, eos=-1)
        outs.append(res.ids)
    assert outs[0] == outs[1]
    with pytest.raises(ValueError, match="no MTP block"):
        MTPDrafter(load_model(tiny_ckpt, progress=False)[0])


def test_generate_cli_speculative(tiny_ckpt, capsys):
    """`dsv4 generate --speculative 2` prints the plain greedy completion (the same text as without the flag) and
    the accepted drafts per verify step; with --temperature it samples speculatively (`speculative_sample` with
    --seed: the same seed, the same text; the tokens equal `speculative_sample` called directly); K outside 0..7
    is refused by name."""
    from dsv4.cli import main
    base = ["generate", "--ckpt", str(tiny_ckpt), "--prompt", "hello", "--max-tokens", "9", "--dtype", "fp32"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main(base + ["--speculative", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == plain.strip() and "speculative k=2" in err and "mean accepted length" in err
    assert main(base + ["--speculative", "2", "--temperature", "0.8", "--seed", "3"]) == 0
    s1, err = capsys.readouterr()
    assert "speculative k=2" in err
    assert main(base + ["--speculative", "2", "--temperature", "0.8", "--seed", "3"]) == 0
    assert capsys.readouterr().out == s1
    from dsv4 import encoding
    from dsv4.generate import load_model
    from dsv4.speculative import MTPDrafter, speculative_sample
    from dsv4.synth import tokenizer_folder
    from dsv4.tokenizer import load_tokenizer
    m, _ = load_model(tiny_ckpt, progress=False, dtype=torch.float32, mtp=True)
    tok = load_tokenizer(tokenizer_folder(tiny_ckpt))
    ids = encoding.prompt_ids(tok, [{"role": "user", "content": "hello"}], thinking=True)
    direct = speculative_sample(m, ids, MTPDrafter(m), k=2, max_tokens=9, temperature=0.8, seed=3)
    assert s1.strip() == tok.decode(direct.ids, skip_special_tokens=False).strip()
    assert s1.strip() != plain.strip()  # sampled, not the greedy text (a flag dropped on the way would show here)
    with pytest.raises(SystemExit):
        main(base + ["--speculative", "8"])


def _chi2_critical(dof: int, z: float) -> float:
    """Upper quantile of chi-square(dof) at the normal quantile z (Wilson-Hilferty, within ~1 % for dof >= 10)."""
    a = 2.0 / (9 * dof)
    return dof * (1 - a + z * a ** 0.5) ** 3


@pytest.mark.parametrize("which", ["likely_draft", "unlikely_draft"])
def test_rejection_rule_draws_from_the_target_distribution(which):
    """`accept_or_resample` returns tokens distributed as p whatever the draft: 40,000 draws against p by
    Pearson's chi-square over 31 cells (30 tokens + the rest pooled), false-alarm rate 1e-4 (z = 3.719; the test
    fails on a correct rule once in 10,000 seeds; it is seeded). The drafts: p's most likely token (p ~ 0.35) and
    an unlikely one (p ~ 0.003). Negative controls at the same rate: always accepting the draft (both), and
    resampling from p itself (the draft's mass counted twice; for the likely draft, where it has power)."""
    from dsv4.speculative import accept_or_resample
    g = torch.Generator().manual_seed(2026)
    logits = torch.randn(200, generator=g) * 1.5
    logits[7] += 4.0
    p = logits.softmax(-1)
    d = int(p.argmax()) if which == "likely_draft" else int(p.argsort()[100])
    n, cells = 40_000, 30
    top = p.argsort(descending=True)[:cells]
    crit = _chi2_critical(cells, 3.719)

    def chi2(draws: list[int]) -> float:
        counts = torch.bincount(torch.tensor(draws), minlength=p.numel()).float()
        obs = torch.cat((counts[top], (n - counts[top].sum()).view(1)))
        exp = torch.cat((p[top], (1 - p[top].sum()).view(1))) * n
        return float(((obs - exp) ** 2 / exp).sum())

    rule = [accept_or_resample(p, d, g)[1] for _ in range(n)]
    assert chi2(rule) < crit, f"lossless rule rejected: chi2 {chi2(rule):.1f} >= {crit:.1f}"

    def resample_from_p(p, d, g):  # the bug: the rejected draft's mass not removed
        return (False, int(torch.multinomial(p, 1, generator=g))) if bool(torch.rand((), generator=g) >= p[d]) \
            else (True, d)
    # resampling from p shifts mass only where the draft is likely (p(d)^2 extra on d): no power for the unlikely one
    for bad in ((lambda p, d, g: (True, d)),) + ((resample_from_p,) if which == "likely_draft" else ()):
        draws = [bad(p, d, g)[1] for _ in range(n)]
        assert chi2(draws) > crit, "control: a wrong rule must be rejected"


def test_speculative_sampling_runs_and_is_seeded(run):
    """End to end at T = 0.9 with the oracle drafter: seeded (the same seed gives the same tokens, another seed
    other tokens), not greedy, and the accepted-draft counts are within 0..k."""
    from dsv4.speculative import speculative_sample
    m, prompt, plain, _ = run
    dr = ContinuationDrafter(len(prompt), plain)
    a = speculative_sample(m, prompt, dr, k=3, max_tokens=40, temperature=0.9, seed=1, eos=EOS)
    b = speculative_sample(m, prompt, dr, k=3, max_tokens=40, temperature=0.9, seed=1, eos=EOS)
    c = speculative_sample(m, prompt, dr, k=3, max_tokens=40, temperature=0.9, seed=2, eos=EOS)
    assert a.ids == b.ids and a.ids != c.ids and a.ids != plain[:40] and len(a.ids) == 40
    assert all(0 <= x <= 3 for x in a.accepted)
    with pytest.raises(ValueError, match="temperature=0"):
        speculative_sample(m, prompt, dr, k=3, max_tokens=4, temperature=0)


# ------------------------------------------------------------------------------------- a batch (issue 26 item 2)
def test_speculative_greedy_batch_equals_each_row_alone(run, mtp_model, seed):
    """Four rows of one batch (prompts of 21, 9, 34 and 50 tokens: ragged positions; fresh random prompts but
    row 0's) decode speculatively with k = 3 and a different drafter each: the oracle, the adversary, the MTP
    block and an EOS-drafting oracle. Each row's tokens must equal plain greedy decoding of its prompt alone,
    token for token (near-ties counted as in the batch-1 test, none measured). The rows stop at different times:
    max_tokens 150 / 40 / 110 / 120 per row, and an EOS id taken from row 2's own greedy continuation (its
    first occurrence, >= 20 tokens in), so row 2 ends at EOS while the others run on; a row that stopped still
    runs in the verify step and must change nothing of the others'. The oracle row accepts every draft, the
    adversary row none (not vacuous). Killed by mutant `speculative_batch_reads_another_rows_logits`."""
    from dsv4.speculative import MTPDrafter, speculative_greedy_batch
    m = mtp_model  # `run`'s main weights: row 0's plain run is the fixture's
    _, prompt0, plain0, logits0 = run
    g = torch.Generator().manual_seed(seed)
    prompts = [prompt0] + [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 34, 50)]
    limits = [150, 40, 110, 120]
    plains = [(plain0[:limits[0]], logits0[:limits[0]])] + [_plain(m, p, n) for p, n in
                                                              zip(prompts[1:], limits[1:])]
    p2 = plains[2][0]
    eos = next(t for j, t in enumerate(p2) if j >= 20 and t not in p2[:j])
    want = [p[:p.index(eos) + 1] if eos in p else p for p, _ in plains]
    assert len(want[2]) < limits[2] and len(want[0]) > len(want[1]), "rows must stop at different times"
    drafters = [ContinuationDrafter(len(prompts[0]), plains[0][0]),
                AdversaryDrafter(len(prompts[1]), plains[1][0], VOCAB), MTPDrafter(m),
                ContinuationDrafter(len(prompts[3]), [eos if j % 5 == 2 else t for j, t in enumerate(plains[3][0])])]
    res = speculative_greedy_batch(m, prompts, drafters, k=3, max_tokens=limits, eos=eos)
    ties = [_check(r.ids, w, lg, f"row {i}") for i, (r, w, (_, lg)) in enumerate(zip(res, want, plains))]
    for i, r in enumerate(res):
        assert r.stop == ("eos" if want[i][-1] == eos else "max_tokens"), f"row {i}: stop {r.stop}"
    if not ties[0]:
        assert all(a == 3 for a in res[0].accepted[:-1]), f"row 0 (oracle): {res[0].accepted}"
    assert set(res[1].accepted) == {0} and len(res[1].accepted) == limits[1] - 1, "row 1 (adversary)"
    assert ties[2] or drafters[2].pos == len(prompts[2]) + sum(a + 1 for a in res[2].accepted)
    assert 0 in res[3].accepted and max(res[3].accepted) > 0, f"row 3 (EOS drafts): {res[3].accepted}"
    print(f"batch of 4: rounds {[len(r.accepted) for r in res]}, mean accepted lengths "
          f"{[round(r.mean_accepted_length, 2) for r in res]}, near-tie divergences {sum(ties)}")


class _ModelDrafter:
    """Drafts the model's own greedy chain after the context (a fresh state each call): likely tokens, so that
    speculative sampling accepts some and rejects others."""

    def __init__(self, m: Transformer):
        self.m = m

    def draft(self, context: list[int], k: int) -> list[int]:
        st, out = self.m.new_state(1), []
        lg = self.m(torch.tensor([context]), st)
        for _ in range(k):
            out.append(int(lg.argmax(-1)))
            lg = self.m(torch.tensor([[out[-1]]]), st)
        return out


def test_speculative_sample_batch_rows_equal_each_row_alone(run, seed):
    """Speculative sampling of a batch (T = 0.3, k = 3, three prompts of 21 / 9 / 30 tokens, max_tokens 30 / 12
    / 25, a seed per row; drafters: the model's own greedy chain on row 0, random ids on rows 1 and 2): each
    row's tokens and acceptance counts equal `speculative_sample` of its prompt alone with its seed (every row
    draws from its own generator; the batched logits round differently, so a draw within fp32 rounding of a
    probability boundary could differ: none here, the test is seeded), and some draft is accepted (the rule's
    accept path ran). Killed by mutant `speculative_batch_reads_another_rows_logits` (a row accepting against
    another row's logits)."""
    from dsv4.speculative import speculative_sample, speculative_sample_batch
    m, prompt0, plain0, _ = run
    g = torch.Generator().manual_seed(seed)
    prompts = [prompt0] + [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 30)]
    limits, seeds = [30, 12, 25], [seed % 1000, seed % 1000 + 1, seed % 1000 + 2]

    def drafters():
        return [_ModelDrafter(m), RandomDrafter(VOCAB, seed=1), RandomDrafter(VOCAB, seed=2)]
    batch = speculative_sample_batch(m, prompts, drafters(), k=3, max_tokens=limits, temperature=0.3, seed=seeds,
                                     eos=EOS)
    for i, (p, d, n, s) in enumerate(zip(prompts, drafters(), limits, seeds)):
        alone = speculative_sample(m, p, d, k=3, max_tokens=n, temperature=0.3, seed=s, eos=EOS)
        assert batch[i].ids == alone.ids and batch[i].accepted == alone.accepted, f"row {i}"
        assert len(alone.ids) == n or alone.ids[-1] == EOS
    assert any(a for r in batch for a in r.accepted), "some draft accepted somewhere (the rule's accept path ran)"


def test_speculative_batch_names_misuse(run, mtp_model):
    """Bad batch arguments raise ValueError naming the argument (and the row), a batch over MAX_BATCH LimitError,
    before any model work."""
    from dsv4.memory_plan import LimitError
    from dsv4.speculative import MTPDrafter, speculative_greedy_batch, speculative_sample_batch
    m = run[0]
    d = RandomDrafter(VOCAB)
    with pytest.raises(ValueError, match="prompts: expected a non-empty list"):
        speculative_greedy_batch(m, [], [], k=2, max_tokens=4)
    with pytest.raises(ValueError, match=r"prompts\[1\]: expected a non-empty list of token ids in \[0, 512\)"):
        speculative_greedy_batch(m, [[1, 2], [3, VOCAB]], [d, d], k=2, max_tokens=4)
    with pytest.raises(ValueError, match=r"max_tokens=\[4\]: expected an int >= 1 or a list of 2"):
        speculative_greedy_batch(m, [[1, 2], [3]], [d, d], k=2, max_tokens=[4])
    with pytest.raises(ValueError, match=r"max_tokens=0: expected an int >= 1 \(row 1\)"):
        speculative_greedy_batch(m, [[1, 2], [3]], [d, d], k=2, max_tokens=[4, 0])
    with pytest.raises(ValueError, match="drafters: expected a list of 2 drafters"):
        speculative_greedy_batch(m, [[1, 2], [3]], [d], k=2, max_tokens=4)
    mtp = MTPDrafter(mtp_model)
    with pytest.raises(ValueError, match="drafters: one drafter object serves two rows"):
        speculative_greedy_batch(mtp_model, [[1, 2], [3]], [mtp, mtp], k=2, max_tokens=4)
    with pytest.raises(ValueError, match=r"seed=\[1\]: expected an int or a list of 2 ints"):
        speculative_sample_batch(m, [[1, 2], [3]], [d, d], k=2, max_tokens=4, temperature=1.0, seed=[1])
    with pytest.raises(ValueError, match="temperature=-1"):
        speculative_sample_batch(m, [[1, 2], [3]], [d, d], k=2, max_tokens=4, temperature=-1)
    with pytest.raises(LimitError, match="MAX_BATCH"):
        speculative_greedy_batch(m, [[1]] * 65, [d] * 65, k=2, max_tokens=4)


# ------------------------------------------------------- speculative sampling end to end (issue 26 item 3)
DV, DT, DK, DROWS, DN = 16, 0.5, 2, 64, 2560  # vocab, temperature, drafts, rows per batch, samples per test


@pytest.fixture(scope="module")
def small():
    """The tiny architecture with a 16-token vocabulary (4 layers), a 5-token prompt, and the exact probabilities
    of plain sampling's first three tokens at T = 0.5: P[a, b, c] = p(a | prompt) p(b | prompt a) p(c | prompt a b),
    float64, each factor softmax(logits / T) of the model's own prefill logits (all V^2 contexts in one call)."""
    args = tiny_args(vocab_size=DV, index_topk=4)
    m = Transformer(args)
    m.load_weights({k: v for k, v in random_state_dict(args, seed=2611).items() if not k.startswith("mtp.")})
    prompt = torch.randint(0, DV, (5,), generator=torch.Generator().manual_seed(2611)).tolist()
    a, b = torch.arange(DV).repeat_interleave(DV), torch.arange(DV).repeat(DV)
    with torch.no_grad():
        p1 = (m(torch.tensor([prompt]), m.new_state(1)) / DT).double().softmax(-1)[0]
        p2 = (m(torch.tensor([prompt + [t] for t in range(DV)]), m.new_state(DV)) / DT).double().softmax(-1)
        ids = torch.cat((torch.tensor(prompt).expand(DV * DV, 5), a[:, None], b[:, None]), 1)
        p3 = (m(ids, m.new_state(DV * DV, 128)) / DT).double().softmax(-1).view(DV, DV, DV)
    P = p1[:, None, None] * p2[:, :, None] * p3
    return m, prompt, P, p2, p3


class _ModeDrafter:
    """Drafts the most likely token(s) of the model's exact distribution after the first one or two generated
    tokens (a point mass, not the model's distribution: accepted with probability p(mode) ~ 0.2-0.6, so both the
    accept and the resample paths run, and round 2 follows a rollback), token 0 elsewhere."""

    def __init__(self, n: int, p2: torch.Tensor, p3: torch.Tensor):
        self.n, self.p2, self.p3 = n, p2, p3

    def draft(self, context: list[int], k: int) -> list[int]:
        s = context[self.n:]
        if len(s) == 1:
            d1 = int(self.p2[s[0]].argmax())
            return ([d1, int(self.p3[s[0], d1].argmax())] + [0] * k)[:k]
        if len(s) == 2:
            return ([int(self.p3[s[0], s[1]].argmax())] + [0] * k)[:k]
        return [0] * k


def _first_three(m, prompt, drafters, seeds) -> torch.Tensor:
    """Counts [V^3] of the first three tokens of `speculative_sample_batch` over the seeds (one row each,
    batches of DROWS; rows stop at different rounds: 1 or 2 verify steps)."""
    from dsv4.speculative import speculative_sample_batch
    counts = torch.zeros(DV ** 3, dtype=torch.float64)
    for c in range(0, len(seeds), DROWS):
        ss = seeds[c:c + DROWS]
        res = speculative_sample_batch(m, [prompt] * len(ss), [drafters(s) for s in ss], k=DK, max_tokens=3,
                                       temperature=DT, seed=ss, eos=-1)
        for r in res:
            counts[(r.ids[0] * DV + r.ids[1]) * DV + r.ids[2]] += 1
    return counts


def _gof(counts: torch.Tensor, P: torch.Tensor) -> tuple[float, float]:
    """Pearson's chi-square of counts against N * P: every cell expecting >= 5 on its own, the rest pooled ->
    (statistic, critical value at the false-alarm rate 1e-4: z = 3.719, Wilson-Hilferty)."""
    n, p = counts.sum(), P.flatten()
    big = n * p >= 5
    obs = torch.cat((counts[big], counts[~big].sum().view(1)))
    exp = torch.cat((p[big], p[~big].sum().view(1))) * n
    return float(((obs - exp) ** 2 / exp).sum()), _chi2_critical(int(big.sum()), 3.719)


@pytest.mark.parametrize("drafter", ["mode", "random"])
def test_speculative_sampling_end_to_end_draws_plain_samplings_distribution(small, seed, drafter, monkeypatch):
    """The whole loop (`speculative_sample_batch`: prefill, k = 2 drafts, verify steps, the acceptance rule,
    rollbacks, rows finishing at different rounds) at T = 0.5 draws its first three tokens from plain
    sampling's distribution, computed exactly from the model's logits (`small`): Pearson's chi-square over
    2,560 seeds (fresh per test id), cells expecting >= 5 (the rest pooled), false-alarm rate 1e-4 per
    assertion (the test fails on correct code once in 10,000 seed sets; two parameters: 2e-4). Drafters: the
    exact distribution's mode (accepted ~ half the time) and uniform random ids (mostly rejected). Negative
    controls through the same loop and test (mode drafter, where they have power): a rule that accepts every
    draft, and a resample from p itself (the rejected draft's mass not removed) must be rejected."""
    from dsv4 import speculative
    m, prompt, P, p2, p3 = small
    seeds = [seed % 100_000 * 10_000 + i for i in range(DN)]
    make = (lambda s: _ModeDrafter(len(prompt), p2, p3)) if drafter == "mode" else \
        (lambda s: RandomDrafter(DV, seed=s))
    stat, crit = _gof(_first_three(m, prompt, make, seeds), P)
    assert stat < crit, f"{drafter}: speculative sampling's first three tokens rejected, chi2 {stat:.1f} >= {crit:.1f}"
    if drafter != "mode":
        return

    def accept_all(p, d, g):
        return True, d

    def resample_from_p(p, d, g):  # the bug: the rejected draft's mass not removed before the resample
        if bool(torch.rand((), generator=g, device=p.device) < p[d]):
            return True, d
        return False, int(torch.multinomial(p, 1, generator=g))
    for bad in (accept_all, resample_from_p):
        monkeypatch.setattr(speculative, "accept_or_resample", bad)
        bstat, bcrit = _gof(_first_three(m, prompt, make, seeds), P)
        assert bstat > bcrit, f"control {bad.__name__}: chi2 {bstat:.1f} <= {bcrit:.1f} (the test has no power)"
    print(f"{drafter}: chi2 {stat:.1f} < {crit:.1f}; controls rejected (last: {bstat:.1f})")


def test_speculative_misuse_names_the_value_its_index_and_the_count(run):
    """User trial: `speculative_greedy(model, [0, 999999], ...)` said `... got list` without the bad id or its
    place; a short `drafters` list said `got list` without its length; an `eos` outside the vocabulary never
    matched (the decode silently ran to max_tokens); a row over the context reported the state's rounded size."""
    from dsv4.memory_plan import LimitError, max_context
    from dsv4.speculative import speculative_greedy_batch, speculative_sample

    m = run[0]
    d = RandomDrafter(VOCAB)
    with pytest.raises(ValueError, match=r"^prompt: expected a non-empty list of token ids in \[0, 512\) \(ints\), "
                                         r"got prompt\[1\]=999999 \(1 bad of 2\)$"):
        speculative_greedy(m, [0, 999999], d, k=2, max_tokens=4)
    with pytest.raises(ValueError, match=r"^prompt: .*, got prompt\[2\]=True \(bool\) \(2 bad of 4\)$"):
        speculative_sample(m, [0, 1, True, -3], d, k=2, max_tokens=4, temperature=1.0)
    with pytest.raises(ValueError, match=r"^prompt: .*, got an empty list$"):
        speculative_greedy(m, [], d, k=2, max_tokens=4)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: .*, got prompts\[1\]\[0\]=512 \(1 bad of 1\)$"):
        speculative_greedy_batch(m, [[1], [VOCAB]], [d, d], k=2, max_tokens=4)
    with pytest.raises(ValueError, match=r"^drafters: expected a list of 3 drafters \(objects with draft\(context, "
                                         r"k\)\), one per prompt, got a list of 1 for 3 prompt\(s\)$"):
        speculative_greedy_batch(m, [[1], [2], [3]], [d], k=2, max_tokens=4)
    with pytest.raises(ValueError, match=r"^drafters\[1\]: expected a drafter \(an object with draft\(context, k\)\), "
                                         r"got str$"):
        speculative_greedy_batch(m, [[1], [2]], [d, "d"], k=2, max_tokens=4)
    with pytest.raises(ValueError, match=r"^drafter returned \[1, 600\]: expected a list of 2 token ids \(ints\) in "
                                         r"\[0, 512\), got drafts\[1\]=600 \(1 bad of 2\) \(row 1\)$"):
        speculative_greedy_batch(m, [[1, 2], [3, 4]], [d, ContinuationDrafter(3, [1, 600] * 8)], k=2,
                                 max_tokens=4)
    for eos in (VOCAB, -2, 1.0):
        with pytest.raises(ValueError, match=rf"^eos={eos!r}: expected None \(the model's EOS, 1\), a token id in "
                                             r"\[0, 512\) \(an int\), or -1 \(no EOS: run to max_tokens\)$"):
            speculative_greedy(m, [1, 2], d, k=2, max_tokens=4, eos=eos)
    ctx = max_context(m.args)
    n = ctx - 5 - 3 + 7  # prompt 5 + max_tokens n + k + 1 = 3: 7 over the context (rounded up: ctx + 128)
    with pytest.raises(LimitError, match=rf"^prompts\[0\]: a row needs {ctx + 7} tokens \(prompt 5 \+ max_tokens "
                                         rf"{n} \+ 3 \(k \+ 1 for the verify step\)\), over the model's context of "
                                         rf"{ctx} tokens per row"):
        speculative_greedy(m, [1, 2, 3, 4, 5], d, k=2, max_tokens=n)
