"""The triton backend at Flash width on CUDA (issue 13): parity with the reference, the CUDA-graph decode, no
host sync, and the final-norm hard stop through the graph-captured decode.

Model: Flash geometry, first 4 layers (compress ratios 0/0/4/128: SWA, SWA, CSA, HCA; layers 0-2 hash-routed),
`weights="quantized"` with random codes in the on-disk formats filled on the GPU
(`dsv4.testing.fill_random_quantized_`), with `index_topk` lowered from 512 to 64 so that a 300-token prompt
(75 CSA entries) exercises the indexer's selection; every width is the real one. Criteria:
  * fp32 (exact mode): triton vs reference logits within 1e-4 relative (max |delta| / max |logit|; kernels differ
    from the reference by fp32 summation order only) at the prefill and at every decode step; equal greedy tokens.
  * bf16 (official numerics): the triton backend with graph-captured decode is no further from the bf16
    reference than twice the bf16 reference's own distance from the fp32 reference (mean over the prefill's
    last position and the decode steps of max |delta logit|; same teacher-forced tokens for all three).
  * graph replay == the same decode step (`Transformer.decode_step`) run eagerly, bitwise, with tokens and
    positions different from the capture (the kernels are deterministic: fixed split orders, no atomics in value
    sums).
  * a decode step (eager and graph replay) under `torch.cuda.set_sync_debug_mode("error")`.
  * a prefill and an appended call each read the device exactly once (the token-id check; issue 23).
  * appended multi-token calls (issue 24): equal to one prefill (fp32, 1e-4 relative), and a graph state that
    takes one between replays equals an eager state bitwise.
  * the final-norm check passes on the triton backend whose decode replays the graph (hard stop), and fails
    when the final norm is removed (negative control).
  * speculative decoding on graph states (issue 26): verify steps replaying a recording capture and their
    rollbacks with per-row keeps equal an eager state bitwise (negative control: no rollback differs), and the
    speculative decoders on a graph model equal the eager ones bitwise and plain greedy token for token.
"""

from __future__ import annotations

import dataclasses
import traceback
import warnings
from pathlib import Path

import pytest
import torch

import dsv4
import kernels
from dsv4.config import ModelArgs
from dsv4.final_norm import final_norm_check
from dsv4.graph import GraphDecodeState
from dsv4.model import Transformer
from dsv4.testing import fill_random_quantized_

pytestmark = [pytest.mark.gpu, pytest.mark.hardstop,  # kernel / backend vs reference on CUDA (issue 22 item 4)
              pytest.mark.flash_width,  # shares the GPU with at most one other (tests/gpu/conftest.py)
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")]

FLASH = Path(__file__).resolve().parents[2] / "fixtures/configs/deepseek_v4_flash.config.json"
PROMPT_LEN, STEPS, MAX_LEN = 300, 4, 512


@pytest.fixture(scope="module")
def args() -> ModelArgs:
    return dataclasses.replace(ModelArgs.from_hf_config(FLASH).with_layers(4), index_topk=64)


@pytest.fixture(scope="module")
def models(args):
    """Lazily built models sharing one set of random codes: key (dtype, backend)."""
    cache: dict = {}

    def get(dtype, backend):
        if (dtype, backend) not in cache:
            m = Transformer(args, dtype=dtype, device="cuda", backend=backend, weights="quantized").eval()
            if not cache:
                fill_random_quantized_(m, seed=13)
            else:
                m.load_weights(next(iter(cache.values())).state_dict())
            cache[(dtype, backend)] = m
        return cache[(dtype, backend)]

    yield get
    cache.clear()
    torch.cuda.empty_cache()


def _ids(args, n, seed):
    return torch.randint(0, args.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed)).cuda()


def _run(model, ids, tokens, state=None):
    """Prefill `ids`, then decode the given tokens (teacher forcing) -> logits [1 + len(tokens), V] fp32."""
    st = state if state is not None else model.new_state(1)
    out = [model(ids, st)]
    for t in tokens:
        out.append(model(t.view(1, 1), st))
    return torch.cat(out)


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_fp32_triton_equals_reference_at_flash_width(args, models):
    ref, tri = models(torch.float32, "reference"), models(torch.float32, "triton")
    ids = _ids(args, PROMPT_LEN, 1)
    sr, st = ref.new_state(1), tri.new_state(1)
    a, b = ref(ids, sr), tri(ids, st)
    assert _rel(b, a) <= 1e-4, f"prefill: relative max |delta| {_rel(b, a):.2e} > 1e-4"
    for i in range(STEPS):
        ta, tb = a.argmax(-1, keepdim=True), b.argmax(-1, keepdim=True)
        assert torch.equal(ta, tb), f"greedy token differs at decode step {i}"
        a, b = ref(ta, sr), tri(tb, st)
        assert _rel(b, a) <= 1e-4, f"decode step {i}: relative max |delta| {_rel(b, a):.2e} > 1e-4"


def test_bf16_triton_graph_decode_within_model_noise(args, models):
    f32, ref, tri = (models(torch.float32, "reference"), models(torch.bfloat16, "reference"),
                     models(torch.bfloat16, "triton"))
    ids = _ids(args, PROMPT_LEN, 2)
    st = ref.new_state(1)
    toks, out = [], [ref(ids, st)]
    for _ in range(STEPS):  # the bf16 reference's greedy path, fed to all three models
        toks.append(out[-1].argmax(-1))
        out.append(ref(toks[-1].view(1, 1), st))
    b = torch.cat(out)
    a = _run(f32, ids, toks)
    tri.use_decode_graphs(MAX_LEN)
    try:
        gst = tri.new_state(1)
        c = _run(tri, ids, toks, gst)
        assert gst.graphs, "the triton decode did not run through a CUDA graph"
    finally:
        tri.use_decode_graphs(None)
    assert torch.isfinite(c).all()
    kernel_err = float((c - b).abs().amax(-1).mean())
    noise = float((b - a).abs().amax(-1).mean())
    assert kernel_err <= 2 * noise, f"triton-vs-reference {kernel_err:.3f} > 2 x bf16-vs-fp32 {noise:.3f}"


def test_graph_replay_equals_eager_step(args, models):
    tri = models(torch.bfloat16, "triton")
    ids = _ids(args, PROMPT_LEN, 3)
    g_st, e_st = GraphDecodeState(tri, 1, MAX_LEN), tri.new_state(1, MAX_LEN)  # e_st: the same step, eagerly
    assert torch.equal(tri(ids, g_st), tri(ids, e_st))
    gen = torch.Generator().manual_seed(4)
    for i in range(STEPS + 1):  # step 0 captures (token t0); later replays get other tokens and positions
        tok = torch.randint(0, args.vocab_size, (1, 1), generator=gen).cuda()
        lg, le = tri(tok, g_st), tri(tok, e_st)
        assert torch.equal(lg, le), f"step {i}: replay differs from the eager static step by {(lg - le).abs().max()}"
    assert g_st.graphs and not isinstance(e_st, GraphDecodeState)


@pytest.mark.parametrize("ragged", [False, True], ids=["lockstep", "ragged"])
def test_decode_step_is_sync_free(args, models, ragged):
    """The decode step (eager and graph replay) under sync-debug "error"; ragged: the rows at 140 and 139
    (per-row positions reach the device by an asynchronous copy from pinned memory, `load_positions`)."""
    tri = models(torch.bfloat16, "triton")
    ids = _ids(args, 140, 5)
    for capture in (False, True):
        st = GraphDecodeState(tri, 2, MAX_LEN) if capture else tri.new_state(2, MAX_LEN)
        if ragged:
            tri(ids, st.row(0)), tri(ids[:, :139], st.row(1))
            assert st.row_pos == [140, 139]
        else:
            tri(ids.expand(2, -1).contiguous(), st)
        tok = torch.tensor([[7], [11]], device="cuda")
        tri(tok, st)  # first step: warm-up, capture
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(2):
                if capture:
                    out = tri(tok, st)
                else:  # the step itself (Transformer.forward checks eager ids on the host: one read, by design)
                    out = st.decode_step(tri, tok)
                    st.row_pos = [p + 1 for p in st.row_pos]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.isfinite(out).all()


def _host_reads(fn) -> list[str]:
    """The synchronizing CUDA operations `fn()` makes (torch's sync-debug "warn" mode, one warning each), each as
    the innermost dsv4 / kernels source lines that made it."""
    torch.cuda.synchronize()
    seen: list[str] = []

    ours = tuple(str(Path(m.__file__).parent) + "/" for m in (dsv4, kernels))  # the two packages' directories

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(ours)]
            seen.append(" < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-3:])))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return seen


def test_prefill_and_append_read_the_device_once(args, models, monkeypatch):
    """bf16 (the production mode): a prefill (1024 tokens, past the indexer's top-k) and an appended 200-token
    call each read the device exactly once from dsv4's code: `Transformer.forward`'s check of the token ids (one
    aminmax read). The count of 1 is also the check's own control: a counter blind to syncs would see 0. The 4
    Flash layers hold a CSA layer (indexer top-k: k from the host-known positions, no read of the visible-entry
    count) and an HCA layer. Steady state: the same calls run once first (a first call at a shape also compiles,
    autotunes and makes constant tables). Counted: reads made under a dsv4 / kernels frame (a read with none, seen
    once in a fresh process on an H200, is not this call's code). Not covered: the fp32 mode, whose MoE is the
    per-expert reference loop (`kernels.moe.moe_routed_ref`: a host read per expert; measured 1033 per prefill).
    Negative case: the indexer's old read of the visible-entry count, put back, is counted (2 reads, the second
    under `Attention.extend`)."""
    tri = models(torch.bfloat16, "triton")
    ids, more = _ids(args, 1024, 6), _ids(args, 200, 7)
    warm = tri.new_state(1)
    tri(ids, warm), tri(more, warm)
    st = tri.new_state(1)
    for what, call in (("prefill", lambda: tri(ids, st)), ("appended call", lambda: tri(more, st))):
        reads = [r for r in _host_reads(call) if r]
        assert len(reads) == 1 and "model.py" in reads[0], f"{what}: expected one host read (ids check): {reads}"
    assert st.row_pos == [1224]

    from dsv4.model import Indexer
    select = Indexer.select

    def reads_the_count(self, x, qr, pos, keys, backend, ops, k):  # the pre-fix `int(n_valid.max())`
        int(((pos + 1) // 4).clamp(max=keys.shape[1]).max())
        return select(self, x, qr, pos, keys, backend, ops, k)

    monkeypatch.setattr(Indexer, "select", reads_the_count)
    reads = [r for r in _host_reads(lambda: tri(ids, tri.new_state(1))) if r]
    assert len(reads) == 2 and "extend" in reads[1], f"negative case: the extra read not seen: {reads}"


PROMPT = [0, 128803, 3085, 344, 270, 6102, 294, 8760, 33, 128804, 128821]


def test_final_norm_with_graph_decode(models, monkeypatch):
    tri = models(torch.bfloat16, "triton")
    replays = []
    real = GraphDecodeState.decode_step

    def counted(self, model, input_ids, observer=None):
        out = real(self, model, input_ids, observer)
        replays.append(bool(self.graphs))
        return out

    monkeypatch.setattr(GraphDecodeState, "decode_step", counted)
    tri.use_decode_graphs(MAX_LEN)
    try:
        r = final_norm_check(tri, PROMPT, decode_steps=2, test_layers=4)
        assert r.passed, f"{r.verdict}; problems={r.chain_problems}; comparisons={r.comparisons}"
        assert r.norm_calls == 3 and replays == [True, True]
        norm = tri.norm  # negative control: the same check on the same graph path fails without the final norm
        tri.norm = torch.nn.Identity()
        try:
            bad = final_norm_check(tri, PROMPT, decode_steps=1, test_layers=4)
        finally:
            tri.norm = norm
        assert not bad.passed and bad.comparisons[0].rel_l2 > 0.5
    finally:
        tri.use_decode_graphs(None)


def test_append_equals_one_prefill_at_flash_width(args, models):
    """Issue 24 item 1 at real width: calls of several tokens after the prefill (ending inside a CSA window, on a
    ratio-4 boundary, 1-token steps between them, more than index_topk = 64 entries visible) give the rows of one
    prefill of the whole sequence, triton fp32, within the module's 1e-4 relative criterion; equal greedy tokens."""
    tri = models(torch.float32, "triton")
    ids = _ids(args, PROMPT_LEN, 6)
    full = tri(ids, tri.new_state(1), all_logits=True)[0]
    st, got, p = tri.new_state(1), [], 0
    for c in (130, 7, 1, 1, 97, 64):  # 130 + 7 = 137 (inside a window), 139, 236 (a ratio-4 boundary), 300
        got.append(tri(ids[:, p:p + c], st, all_logits=True)[0])
        p += c
    got = torch.cat(got)
    assert p == PROMPT_LEN and st.pos == PROMPT_LEN
    assert _rel(got, full) <= 1e-4, f"split run vs one prefill: relative max |delta| {_rel(got, full):.2e} > 1e-4"
    assert torch.equal(got.argmax(-1), full.argmax(-1))


def test_graph_decode_after_an_appended_call(args, models):
    """A CUDA-graph state takes a multi-token call between graph decode steps (run eagerly on the graph's
    buffers) and the replays after it equal the same calls on an eager fixed state, bitwise."""
    tri = models(torch.bfloat16, "triton")
    ids = _ids(args, 140, 7)
    g_st, e_st = GraphDecodeState(tri, 1, MAX_LEN), tri.new_state(1, MAX_LEN)
    gen = torch.Generator().manual_seed(8)
    for s in (140, 1, 1, 9, 1, 1, 12, 1):  # 9 and 12 > MAX_STEP_TOKENS: eager appends on the graph's buffers
        x = ids if s == 140 else torch.randint(0, args.vocab_size, (1, s), generator=gen).cuda()
        lg, le = tri(x, g_st), tri(x, e_st)
        assert torch.equal(lg, le), f"call of {s} token(s) at {g_st.pos - s}: graph state differs from eager"
    assert g_st.graphs and g_st.pos == 140 + 26


def _ragged_prefill(model, st, prompts):
    """Each prompt [1, n_i] into its row view of `st` -> first logits [b, V] (rows at positions n_i)."""
    return torch.cat([model(p, st.row(i)) for i, p in enumerate(prompts)])


def test_ragged_rows_equal_each_alone_at_flash_width(args, models):
    """Issue 24 item 2 at Flash width: rows prefilled to 300 / 137 / 9 tokens decode together through the one
    decode step with per-row positions (triton fp32: per-row compress_pool / compress_commit / rope_tail_ /
    indexer top-k lengths); each row equals the fp32 reference run alone within 1e-4 relative at every step,
    with equal greedy tokens."""
    ref, tri = models(torch.float32, "reference"), models(torch.float32, "triton")
    prompts = [_ids(args, n, 20 + n) for n in (PROMPT_LEN, 137, 9)]
    gen = torch.Generator().manual_seed(21)
    feeds = [torch.randint(0, args.vocab_size, (3, 1), generator=gen).cuda() for _ in range(STEPS)]
    st = tri.new_state(3, MAX_LEN)
    got = [_ragged_prefill(tri, st, prompts)] + [tri(f, st) for f in feeds]
    assert st.row_pos == [PROMPT_LEN + STEPS, 137 + STEPS, 9 + STEPS]
    for i, p in enumerate(prompts):
        want = _run(ref, p, [f[i] for f in feeds])
        for k, g in enumerate(got):
            assert _rel(g[i:i + 1], want[k:k + 1]) <= 1e-4, f"row {i} call {k}: {_rel(g[i:i + 1], want[k:k + 1]):.2e}"
            assert torch.equal(g[i].argmax(), want[k].argmax()), f"row {i} call {k}: greedy token"


def test_graph_ragged_decode_and_row_replacement_equal_eager(args, models):
    """A CUDA-graph state of 3 rows at different positions (per-row pos_buf) replays the same decode step (1, 3
    and 4 tokens per row: one capture per s) as an eager fixed state, bitwise, and a row replaced between replays (reset_row + a new prefill into its view:
    continuous batching) leaves the replays bitwise equal to the eager state's."""
    tri = models(torch.bfloat16, "triton")
    prompts = [_ids(args, n, 30 + n) for n in (140, 61, 7)]
    g_st, e_st = GraphDecodeState(tri, 3, MAX_LEN), tri.new_state(3, MAX_LEN)
    assert torch.equal(_ragged_prefill(tri, g_st, prompts), _ragged_prefill(tri, e_st, prompts))
    gen = torch.Generator().manual_seed(31)
    for step, n in enumerate((1, 1, 3, 1, 4, 1)):  # verify-sized steps: one capture per s
        if step == 3:
            newcomer = _ids(args, 33, 32)
            for st in (g_st, e_st):
                st.reset_row(1)
            assert torch.equal(tri(newcomer, g_st.row(1)), tri(newcomer, e_st.row(1)))
        tok = torch.randint(0, args.vocab_size, (3, n), generator=gen).cuda()
        lg, le = tri(tok, g_st, all_logits=True), tri(tok, e_st, all_logits=True)
        assert torch.equal(lg, le), f"step {step} ({n} tokens) at {g_st.row_pos}: replay differs from eager"
    assert {k[1] for k in g_st.graphs} == {1, 3, 4} and g_st.row_pos == [151, 33 + 6, 18]


def test_speculative_greedy_equals_plain_greedy_at_flash_width(args, models):
    """Issue 26 at Flash width (triton fp32, eager verify steps with rollback): speculative greedy with the oracle
    (k = 3) and the adversary (k = 2) drafters emits the plain greedy tokens of the same model for 48 tokens from
    a 300-token prompt (verify windows across ratio-4 boundaries; a near-tie within 1e-4 relative is allowed)."""
    from dsv4.speculative import AdversaryDrafter, ContinuationDrafter, speculative_greedy
    tri = models(torch.float32, "triton")
    ids = _ids(args, PROMPT_LEN, 40)
    st = tri.new_state(1, MAX_LEN)
    lg, plain, logits = tri(ids, st), [], []
    for _ in range(48):
        logits.append(lg[0])
        plain.append(int(lg.argmax(-1)))
        lg = tri(torch.tensor([[plain[-1]]], device="cuda"), st)
    prompt = ids[0].tolist()
    for drafter, k in ((ContinuationDrafter(len(prompt), plain), 3),
                       (AdversaryDrafter(len(prompt), plain, args.vocab_size), 2)):
        got = speculative_greedy(tri, prompt, drafter, k=k, max_tokens=48, eos=-1).ids
        for i, (g, p) in enumerate(zip(got, plain)):
            if g != p:
                top = logits[i].topk(2).values
                assert float(top[0] - top[1]) <= 1e-4 * float(logits[i].abs().max()), f"token {i}: {g} vs {p}"
                break


def test_graph_verify_and_rollback_equal_eager(args, models):
    """Issue 26 item 2, CUDA-graph captured: verify steps (`Transformer.verify`) on a `GraphDecodeState` of 3
    ragged rows (prefilled to 140 / 61 / 7 tokens) replay a recording capture per s, and each rollback with
    per-row keeps (rows accept different lengths) leaves the state the eager fixed state has after the same
    calls: every verify's logits (all s positions) and every decode step's logits after it are bitwise equal
    (bf16 triton, the same kernels; the record's windows are the capture's static outputs). The s = 4 capture is
    replayed twice (its outputs refilled). Negative control: the graph state whose last verify is not rolled
    back (positions set by hand, rejected tokens left in ring and windows) differs from the eager state."""
    tri = models(torch.bfloat16, "triton")
    prompts = [_ids(args, n, 50 + n) for n in (140, 61, 7)]
    g_st, e_st = GraphDecodeState(tri, 3, MAX_LEN), tri.new_state(3, MAX_LEN)
    assert torch.equal(_ragged_prefill(tri, g_st, prompts), _ragged_prefill(tri, e_st, prompts))
    gen = torch.Generator().manual_seed(51)
    plan = [(4, [1, 4, 2]), (None, None), (3, [3, 1, 2]), (4, [2, 2, 4]), (None, None), (2, [1, 2, 1])]
    for step, (s, keep) in enumerate(plan):
        tok = torch.randint(0, args.vocab_size, (3, s or 1), generator=gen).cuda()
        if s is None:  # a one-token decode step after a rollback
            lg, le = tri(tok, g_st), tri(tok, e_st)
        else:
            (lg, rg), (le, re) = tri.verify(tok, g_st), tri.verify(tok, e_st)
            assert torch.equal(lg, le), f"step {step}: verify logits (s = {s}) at {g_st.row_pos} differ"
            tri.rollback(g_st, rg, keep)
            tri.rollback(e_st, re, keep)
        assert torch.equal(lg, le), f"step {step}: graph state differs from eager at {g_st.row_pos}"
    assert g_st.row_pos == e_st.row_pos == [149, 72, 18]
    assert {k[1:] for k in g_st.graphs} >= {(4, True), (3, True), (2, True), (1, False)}
    # negative control: one more verify, rolled back on the eager state only
    tok = torch.randint(0, args.vocab_size, (3, 4), generator=gen).cuda()
    (_, rg), (_, re) = tri.verify(tok, g_st), tri.verify(tok, e_st)
    tri.rollback(e_st, re, [1, 1, 1])
    g_st.row_pos = [p + 1 for p in rg.pos0]
    nxt = torch.randint(0, args.vocab_size, (3, 1), generator=gen).cuda()
    assert not torch.equal(tri(nxt, g_st), tri(nxt, e_st)), "control: a verify left un-rolled-back must differ"


def test_graph_speculative_greedy_equals_eager_and_plain(args, models):
    """Issue 26 items 2 and CUDA graphs end to end (bf16 triton, Flash width): speculative greedy on a model that
    decodes through CUDA graphs (`use_decode_graphs`: verify steps replay recording captures, rollbacks restore
    from their static outputs) gives the SAME tokens and acceptance counts as on eager states (bitwise: the same
    kernels; both states hold MAX_LEN = 512 tokens, max_tokens 96 makes the eager one 512 too), for a ragged
    batch of two rows (k = 3: the oracle on a 300-token prompt, a random drafter on a 140-token one) and for batch
    1 with the adversary (k = 2); and each row equals plain greedy decoding of its prompt (one token per step,
    eager), token for token, except from a step whose top two logits lie within bf16's 1e-2 of the largest
    |logit| or twice the measured difference between verify-step and one-token logits on the plain tokens
    (whichever is larger: the verify step's k + 1 positions round differently in bf16); the oracle must accept
    every draft until then, the adversary none."""
    from dsv4.speculative import (AdversaryDrafter, ContinuationDrafter, RandomDrafter, speculative_greedy,
                                  speculative_greedy_batch)
    tri = models(torch.bfloat16, "triton")
    n_tok = 96
    prompts = [_ids(args, PROMPT_LEN, 60)[0].tolist(), _ids(args, 140, 61)[0].tolist()]
    plains = []
    for p in prompts:
        st = tri.new_state(1, MAX_LEN)
        lg, out, logits = tri(torch.tensor([p], device="cuda"), st), [], []
        for _ in range(n_tok):
            logits.append(lg[0].float())
            out.append(int(lg.argmax(-1)))
            lg = tri(torch.tensor([[out[-1]]], device="cuda"), st)
        plains.append((out, logits))

    def verify_noise(p, plain, logits):
        """max |logit difference| between the verify step (4 tokens per call, teacher-forced on the plain tokens)
        and the one-token steps at the same positions: what the two paths' bf16 roundings differ by."""
        st, d = tri.new_state(1, MAX_LEN), 0.0
        tri(torch.tensor([p], device="cuda"), st)
        for c in range(0, n_tok - 4, 4):
            lg, rec = tri.verify(torch.tensor([plain[c:c + 4]], device="cuda"), st)
            tri.rollback(st, rec, [4])
            d = max(d, float((lg[0] - torch.stack(logits[c + 1:c + 5])).abs().max()))
        return d

    tol = max(verify_noise(p, *pl) for p, pl in zip(prompts, plains))

    def check(got, plain, logits, what):
        for i, (g, p) in enumerate(zip(got, plain)):
            if g != p:
                top = logits[i].topk(2).values
                gap = float(top[0] - top[1])
                assert gap <= max(2 * tol, 1e-2 * float(logits[i].abs().max())), \
                    f"{what} token {i}: {g} vs plain {p}, top-2 gap {gap:.3g} > 2 x the verify noise {tol:.3g}"
                return i
        assert len(got) == len(plain)
        return None

    def runs():
        batch = speculative_greedy_batch(
            tri, prompts, [ContinuationDrafter(len(prompts[0]), plains[0][0]), RandomDrafter(args.vocab_size, 62)],
            k=3, max_tokens=n_tok, eos=-1)
        alone = speculative_greedy(tri, prompts[0], AdversaryDrafter(len(prompts[0]), plains[0][0], args.vocab_size),
                                   k=2, max_tokens=n_tok, eos=-1)
        return batch + [alone]

    eager = runs()
    tri.use_decode_graphs(MAX_LEN)
    try:
        graph = runs()
    finally:
        tri.use_decode_graphs(None)
    for i, (g, e) in enumerate(zip(graph, eager)):
        assert g.ids == e.ids and g.accepted == e.accepted, f"run {i}: graph state differs from eager"
    for i, (res, (plain, logits)) in enumerate(zip(graph, [plains[0], plains[1], plains[0]])):
        tie = check(res.ids, plain, logits, f"run {i}")
        if i == 0 and tie is None:
            assert all(a == 3 for a in res.accepted[:-1]), f"oracle: {res.accepted}"
        if i == 2:
            assert set(res.accepted[:tie]) == {0}, f"adversary: {res.accepted}"
