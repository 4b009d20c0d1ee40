"""Test 2, the final-norm check: is a final RMSNorm applied between hc_head and the LM head, and does it run?

The model's last path is  X (last residual streams, [b, hc, d]) -> hc_head -> norm (RMSNorm) -> head
(reference spec §3 step 4, §9). hc_head's mixing weights see X through an RMS normalisation and the final
RMSNorm divides the magnitude out, so the logits of X, X/c and X*c must match up to the eps terms (spec §9
"Scale invariance"). This is the decisive answer to "the residual grows to |X| ~ 860, clip it?": if the
logits are scale-invariant, the magnitude of X cannot be what breaks decode, and the fix is never clipping.

Two traps the playbook fell into, and how this check avoids them:
  (a) argmax and cosine are invariant to scaling the *logits*: with no final norm at all, logits(X/100) =
      logits(X)/100 and both still agree. So the verdict also requires the magnitudes to match: relative L2
      error, max |delta logit| and the KL divergence of the softmaxes (which a logit scale does change).
  (b) "a norm module exists" is not "the norm runs": forward hooks on `hc_head`, `norm` and `head` record
      every execution during a real prefill + decode, and the verdict requires, for every step, exactly one
      hc_head -> norm -> head chain in that order, each consuming the previous one's output (a norm applied
      per stream before hc_head, or skipped, fails here even though the invariance alone cannot see it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from dsv4.generate import ResidualTrace
from dsv4.model import Transformer

__all__ = ["FinalNormReport", "ScaleComparison", "final_norm_check", "compare_logits", "nonorm_logits", "PASS",
           "HARD_STOP", "INCONCLUSIVE", "REL_TOL", "KL_TOL", "TIE_FACTOR", "POWER_MARGIN"]

# Tolerances for logits compared across a rescale of X, per model dtype (written down once):
#   float32: rel L2 1e-4, KL 1e-6   (fp32 rounding through hc_head, RMSNorm and a d x V matmul)
#   bfloat16: rel L2 2e-2, KL 1e-3  (y is rounded to bf16 at different points for X and X/c: ~2^-8 per element)
# plus the eps allowance below. A missing final norm gives rel L2 = |1 - 1/c| (0.99 for c = 100).
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
KL_TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3}
# Near-tie rule for the argmax criterion: the logits of X and X*c may differ per element by about the allowed
# relative L2 error times rms(logits) (rel L2 = rms(dlogit) / rms(logits)), so an argmax flip between two ids
# whose logits are closer than TIE_FACTOR * REL_TOL[dtype] * rms(logits_A) in BOTH logit vectors is rounding,
# not a missing norm: it is counted and reported (`near_tie`), not failed. A flip beyond it fails. (Two ids whose
# difference moves by 2 * rms(dlogit) flip a gap of that size; the dtype part only, never the eps allowance.)
TIE_FACTOR = 2.0
# Power rule: before a comparison may pass, the same tolerances must reject what a model WITHOUT a final norm
# gives for the same X through the same hc_head and head (logits' = head(norm.weight * hc_head(X)), linear in
# |X|): its rel L2 or its KL must exceed the tolerance by POWER_MARGIN. Where they cannot (a huge eps, a tiny |X|
# whose eps allowance swallows the tolerance, zero weights, constant logits), that comparison cannot tell a
# missing norm from a present one and Test 2 is INCONCLUSIVE, never PASS.
POWER_MARGIN = 4.0

PASS, HARD_STOP, INCONCLUSIVE = "PASS", "HARD STOP", "INCONCLUSIVE"


@dataclass
class ScaleComparison:
    """logits_A = final(X) against logits_B = final(X * factor); all floats are fp64 metrics of fp32 logits.

    rel_l2 = |A - B|_2 / |A|_2; kl = KL(softmax(A) || softmax(B)) in nats; max_abs_diff in logit units.
    `passed` is the metrics verdict (argmax equal or a near-tie flip, rel_l2 <= rel_tol, kl <= kl_tol, all
    finite). `near_tie`: the argmax flipped between ids closer than `tie_tol` in both A and B (counted, not
    failed); `top2_gap`: A's top-1 minus top-2 logit; `flip_gap`: A[argmax_A] - A[argmax_B] (0 without a flip). The power fields are filled by `final_norm_check`:
    `nonorm_rel_l2` / `nonorm_kl` are the same metrics for the model without a final norm, `decisive` says
    whether the tolerances reject it by POWER_MARGIN, `power_reason` why not (empty when decisive).
    """

    factor: float
    argmax_A: int
    argmax_B: int
    cosine: float
    rel_l2: float
    max_abs_diff: float
    kl: float
    rel_tol: float
    kl_tol: float
    passed: bool
    near_tie: bool = False
    top2_gap: float = math.nan
    flip_gap: float = 0.0
    tie_tol: float = 0.0
    eps_allowance: float = 0.0
    nonorm_rel_l2: float = math.nan
    nonorm_kl: float = math.nan
    decisive: bool = True
    power_reason: str = ""


@dataclass
class FinalNormReport:
    """Everything Test 2 reports. `chain_ok` is the execution check (b); `comparisons` the invariance (a).

    `outcome` is "PASS", "HARD STOP" or "INCONCLUSIVE" (the check could not tell a missing norm from a present
    one: see POWER_MARGIN); `passed` is `outcome == "PASS"`, so every consumer of `passed` (diagnose's exit
    status, the gate, the banner) treats INCONCLUSIVE as not passing. `near_tie_flips` counts comparisons
    whose argmax flipped within the near-tie tolerance (reported, not failed).
    """

    steps: int
    norm_calls: int  # executions of the final norm counted by its hook over all steps (expected: steps)
    chain_ok: bool
    chain_problems: list[str]
    logits_match_model: bool
    x_max_abs: float
    x_rms: float
    x_stream_rms: list[float]
    eps_allowance: float
    comparisons: list[ScaleComparison]
    test_layers: int | None
    verdict: str
    rule: str
    passed: bool
    residual_max_abs_per_layer: list[float] = field(default_factory=list)
    greedy_ids: list[int] = field(default_factory=list)  # argmax after the prefill and each decode step
    outcome: str = PASS
    near_tie_flips: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def compare_logits(a: torch.Tensor, b: torch.Tensor, factor: float, rel_tol: float, kl_tol: float,
                   tie_tol: float = 0.0) -> ScaleComparison:
    """Compare logits a, b ([V] or [1, V], fp32) with argmax, cosine and the magnitude metrics.

    tie_tol (logit units, >= 0; default 0 = any argmax flip fails): an argmax flip between ids i = argmax(a),
    j = argmax(b) with a[i] - a[j] <= tie_tol and b[j] - b[i] <= tie_tol is a near-tie (`near_tie`), which does
    not fail the comparison; the magnitude criteria still apply. Raises ValueError for a negative tie_tol.
    """
    if not tie_tol >= 0:
        raise ValueError(f"tie_tol={tie_tol}: expected a finite value >= 0")
    a, b = a.double().flatten(), b.double().flatten()
    rel = float((a - b).norm() / a.norm().clamp_min(1e-300))
    kl = float((a.log_softmax(-1).exp() * (a.log_softmax(-1) - b.log_softmax(-1))).sum())
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    am, bm = int(a.argmax()), int(b.argmax())
    top2 = a.topk(min(2, a.numel())).values
    gap = float(top2[0] - top2[-1]) if a.numel() > 1 else math.inf
    flip_gap = float(a[am] - a[bm])
    near_tie = am != bm and flip_gap <= tie_tol and float(b[bm] - b[am]) <= tie_tol
    ok = ((am == bm or near_tie) and rel <= rel_tol and kl <= kl_tol and math.isfinite(rel) and math.isfinite(kl))
    return ScaleComparison(factor, am, bm, cos, rel, float((a - b).abs().max()), kl, rel_tol, kl_tol, ok,
                           near_tie=near_tie, top2_gap=gap, flip_gap=flip_gap, tie_tol=tie_tol)


class _ChainRecorder:
    """Forward hooks on hc_head, norm and head: the sequence of (module, input, output) per forward call."""

    def __init__(self, model: Transformer):
        self.calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self.handles = [getattr(model, name).register_forward_hook(self._hook(name))
                        for name in ("hc_head", "norm", "head")]

    def _hook(self, name: str):
        def hook(module, args, output):
            self.calls.append((name, args[0].detach(), output.detach()))
        return hook

    def take(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        calls, self.calls = self.calls, []
        return calls

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same tensor data (NaN equal to NaN in the same places: identity of the data flow, not of values)."""
    if a.shape != b.shape:
        return False
    b = b.to(a.dtype)
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _check_chain(step: int, calls: list[tuple[str, torch.Tensor, torch.Tensor]], dim: int) -> list[str]:
    names = [c[0] for c in calls]
    if names != ["hc_head", "norm", "head"]:
        return [f"step {step}: final path ran {names or 'nothing'}, expected ['hc_head', 'norm', 'head'] once each"]
    (_, _, hc_out), (_, n_in, n_out), (_, h_in, _) = calls
    problems = []
    if n_in.shape[-1] != dim or not _same(n_in, hc_out):
        problems.append(f"step {step}: norm input {tuple(n_in.shape)} is not hc_head's output {tuple(hc_out.shape)}")
    if not _same(h_in, n_out):
        problems.append(f"step {step}: head input is not the norm's output")
    return problems


@torch.no_grad()
def final_norm_check(model: Transformer, prompt_ids: list[int], decode_steps: int = 2, scale: float = 100.0,
                     test_layers: int | None = None) -> FinalNormReport:
    """Run Test 2 on `model` (batch 1): prefill `prompt_ids`, then `decode_steps` greedy decode steps.

    Captures the last layer's residual streams X [1, hc, d] at the last decode step (through the model's
    observer), then logits_A = head(norm(hc_head(X))) via `model.final_logits`, logits_B with X/scale and
    logits_C with X*scale. `test_layers` is only reported (the caller loaded that many layers).

    Verdict (`outcome`): HARD STOP when (1) some step did not run hc_head -> norm -> head exactly once, in that
    order, each consuming the previous output (forward hooks), (2) logits_A differs from the model's own last
    logits (X is not the real input of the final path), (3) a value is non-finite, or (4) for X/scale or X*scale
    the logits differ in argmax beyond a near-tie (TIE_FACTOR), in rel L2 beyond REL_TOL[dtype] + eps_allowance
    or in KL beyond KL_TOL[dtype] + eps_allowance, where eps_allowance = 10 * norm_eps / min(mean(X^2),
    mean((X*f)^2)) bounds the effect of the eps inside the two rsqrt's (spec §9; negligible at |X| ~ 860, not
    at tiny |X|). Otherwise INCONCLUSIVE when a comparison lacks power (a model without a final norm would pass
    it too: POWER_MARGIN), else PASS. An argmax flip within the near-tie tolerance is counted
    (`near_tie_flips`), not failed.

    Raises ValueError for decode_steps < 1, scale <= 1 or an empty prompt.
    """
    if decode_steps < 1:
        raise ValueError(f"decode_steps={decode_steps}: the check needs prefill plus at least one decode step")
    if not scale > 1:
        raise ValueError(f"scale={scale}: expected a factor > 1")
    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    dev, dim = model.device, model.args.dim
    trace = ResidualTrace(capture_last=True).bind(model)
    rec = _ChainRecorder(model)
    problems: list[str] = []
    norm_calls, nonfinite_steps, greedy = 0, [], []
    try:
        state = model.new_state(1)
        x = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
        for step in range(decode_steps + 1):
            logits = model(x, state, observer=trace)
            calls = rec.take()
            norm_calls += sum(1 for c in calls if c[0] == "norm")
            problems += _check_chain(step, calls, dim)
            if not bool(torch.isfinite(logits).all()):
                nonfinite_steps.append(step)
            x = logits.argmax(-1, keepdim=True)
            greedy.append(int(x[0, 0]))
    finally:
        rec.remove()
    X = trace.last_residual  # [1, hc, d]
    if X is None:
        raise RuntimeError("the model's observer never reported the last layer's residual streams")
    A = model.final_logits(X[:, None])[:, 0]
    logits_match = bool(torch.allclose(A, logits, rtol=1e-6, atol=1e-6))
    Xf = X.float()
    ms = float(Xf.pow(2).mean())
    comps = [_judge(model, X, A, f, ms) for f in (1 / scale, scale)]
    eps_allow = max(c.eps_allowance for c in comps)
    chain_ok = not problems
    finite = not nonfinite_steps and bool(torch.isfinite(X).all())
    ties = sum(c.near_tie for c in comps)
    rule = ("PASS iff every step ran hc_head -> norm -> head once in order (hooks), the captured X reproduces the "
            "model's logits, and logits(X/c), logits(X*c) match logits(X) in argmax (a flip within the near-tie "
            "tolerance is counted, not failed) AND magnitude (rel L2, KL within the dtype tolerance + eps "
            f"allowance), with tolerances that reject a model without a final norm by {POWER_MARGIN:g}x "
            "(else INCONCLUSIVE)")
    if not finite:
        outcome, verdict = HARD_STOP, (
            f"HARD STOP: non-finite values (NaN/inf) in the logits at steps {nonfinite_steps} or in the last "
            "residual - the weights or activations are broken; the final-norm question cannot be decided")
    elif not chain_ok:
        outcome, verdict = HARD_STOP, "HARD STOP: the final norm is not applied between hc_head and the head on every step"
    elif not logits_match:
        outcome, verdict = HARD_STOP, "HARD STOP: the captured residual does not reproduce the model's logits"
    elif not all(c.passed for c in comps):
        outcome, verdict = HARD_STOP, ("HARD STOP: logits depend on the residual magnitude - the final norm is missing "
                                       "or misapplied (fix the norm; never clip the residual)")
    elif not all(c.decisive for c in comps):
        why = "; ".join(f"{_label(c.factor)}: {c.power_reason}" for c in comps if not c.decisive)
        outcome, verdict = INCONCLUSIVE, (
            "INCONCLUSIVE: these tolerances would also pass a model without a final norm, so the invariance "
            f"proves nothing here ({why}). Not a pass: it neither exonerates the residual nor blames the norm")
    else:
        outcome = PASS
        verdict = "PASS: the final RMSNorm runs on the path to the head and the logits are invariant to |X|"
        if ties:
            verdict += (f" ({ties} argmax flip(s) at a near-tie within {TIE_FACTOR:g} x REL_TOL x rms(logits), "
                        "counted, not failed)")
    return FinalNormReport(
        steps=decode_steps + 1, norm_calls=norm_calls, chain_ok=chain_ok, chain_problems=problems,
        logits_match_model=logits_match, x_max_abs=float(Xf.abs().max()), x_rms=math.sqrt(ms),
        x_stream_rms=[float(v) for v in Xf[0].pow(2).mean(-1).sqrt()], eps_allowance=eps_allow,
        comparisons=comps, test_layers=test_layers, verdict=verdict, rule=rule, passed=outcome == PASS,
        residual_max_abs_per_layer=trace.max_abs[-1] if trace.max_abs else [], greedy_ids=greedy,
        outcome=outcome, near_tie_flips=ties)


def _label(factor: float) -> str:
    return f"X*{factor:g}" if factor >= 1 else f"X/{1 / factor:g}"


def nonorm_logits(model: Transformer, H: torch.Tensor) -> torch.Tensor:
    """What a model WITHOUT a final RMSNorm gives on the same path: head(norm.weight * hc_head(H)).

    H [b, s, hc, dim] (model dtype) -> logits [b, s, V] fp32; the norm's weight multiplies y in fp32 and the
    product is cast back to y's dtype as the norm's output would be (y itself where `model.norm` has no weight). Linear in |H| (hc_head's mixing weights see
    H through an RMS normalisation), so logits(H * f) = f * logits(H): the signature the power check must see.
    """
    y = model.hc_head(H, model.hc_head_fn, model.hc_head_base, model.hc_head_scale, model.backend)
    w = getattr(model.norm, "weight", None)  # a norm replaced by a module without a weight: the plain product
    return model.head(y if w is None else (w.float() * y.float()).to(y.dtype))


def _judge(model: Transformer, X: torch.Tensor, A: torch.Tensor, factor: float, ms: float) -> ScaleComparison:
    """One rescale comparison of Test 2 with its near-tie tolerance and its power check (module constants)."""
    eps = model.args.norm_eps
    allow = 10 * eps / max(min(ms, ms * factor ** 2), 1e-300)
    rt, kt = REL_TOL[model.dtype] + allow, KL_TOL[model.dtype] + allow
    a64 = A.double()
    tie_tol = TIE_FACTOR * REL_TOL[model.dtype] * float(a64.pow(2).mean().sqrt())
    tie_tol = tie_tol if math.isfinite(tie_tol) else 0.0  # non-finite logits: no near-tie excuse (HARD STOP)
    c = compare_logits(A, model.final_logits((X * factor)[:, None])[:, 0], factor, rt, kt, tie_tol)
    na = nonorm_logits(model, X[:, None])[:, 0]
    nb = nonorm_logits(model, (X * factor)[:, None])[:, 0]
    nn = compare_logits(na, nb, factor, rt, kt)
    c.eps_allowance, c.nonorm_rel_l2, c.nonorm_kl = allow, nn.rel_l2, nn.kl
    spread = float(a64.std()) if a64.numel() > 1 else 0.0
    rejects = nn.rel_l2 >= POWER_MARGIN * rt or nn.kl >= POWER_MARGIN * kt
    if not (math.isfinite(spread) and spread > 0):
        c.decisive, c.power_reason = False, (
            "logits(X) are constant (std 0: zero or degenerate head / hc_head weights, placeholder data?) - "
            "there is nothing whose magnitude could differ")
    elif not (math.isfinite(nn.rel_l2) and rejects):
        cause = (f"the eps allowance {allow:.3g} (norm_eps {eps:g} against mean(X^2) {min(ms, ms * factor ** 2):.3g}) "
                 "swallows the tolerance" if allow > REL_TOL[model.dtype] else "the tolerance is too loose")
        c.decisive, c.power_reason = False, (
            f"a model without a final norm would give rel_L2 {nn.rel_l2:.3g} and KL {nn.kl:.3g} against the "
            f"tolerances {rt:.3g} / {kt:.3g} (rejection needs {POWER_MARGIN:g}x): {cause}")
    return c
