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

__all__ = ["FinalNormReport", "ScaleComparison", "final_norm_check", "compare_logits"]

# Tolerances for logits compared across a rescale of X, per model dtype (written down once):
#   float32: rel L2 1e-4, KL 1e-6   (fp32 rounding through hc_head, RMSNorm and a d x V matmul)
#   bfloat16: rel L2 2e-2, KL 1e-3  (y is rounded to bf16 at different points for X and X/c: ~2^-8 per element)
# plus the eps allowance below. A missing final norm gives rel L2 = |1 - 1/c| (0.99 for c = 100).
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
KL_TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-3}


@dataclass
class ScaleComparison:
    """logits_A = final(X) against logits_B = final(X * factor); all floats are fp64 metrics of fp32 logits."""

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


@dataclass
class FinalNormReport:
    """Everything Test 2 reports. `chain_ok` is the execution check (b); `comparisons` the invariance (a)."""

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

    def to_dict(self) -> dict:
        return asdict(self)


def compare_logits(a: torch.Tensor, b: torch.Tensor, factor: float, rel_tol: float, kl_tol: float
                   ) -> ScaleComparison:
    """Compare logits a, b ([V] or [1, V], fp32) with argmax, cosine and the magnitude metrics."""
    a, b = a.double().flatten(), b.double().flatten()
    rel = float((a - b).norm() / a.norm().clamp_min(1e-300))
    kl = float((a.log_softmax(-1).exp() * (a.log_softmax(-1) - b.log_softmax(-1))).sum())
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    am, bm = int(a.argmax()), int(b.argmax())
    ok = am == bm and rel <= rel_tol and kl <= kl_tol and math.isfinite(rel) and math.isfinite(kl)
    return ScaleComparison(factor, am, bm, cos, rel, float((a - b).abs().max()), kl, rel_tol, kl_tol, ok)


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

    Verdict rule (all must hold): (1) every step ran hc_head -> norm -> head exactly once, in that order, each
    consuming the previous output (forward hooks); (2) logits_A equals the model's own last logits (X is the
    real input of the final path); (3) for X/scale and X*scale: equal argmax, rel L2 <= REL_TOL[dtype] +
    eps_allowance, KL <= KL_TOL[dtype] + eps_allowance, where eps_allowance = 10 * norm_eps / mean(X^2/scale^2)
    bounds the effect of the eps inside the two rsqrt's (spec §9; negligible at |X| ~ 860, not at tiny |X|).

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
    ms_small = float(Xf.pow(2).mean()) / scale ** 2
    eps_allow = 10 * model.args.norm_eps / max(ms_small, 1e-300)
    rt, kt = REL_TOL[model.dtype] + eps_allow, KL_TOL[model.dtype] + eps_allow
    comps = [compare_logits(A, model.final_logits((X / scale)[:, None])[:, 0], 1 / scale, rt, kt),
             compare_logits(A, model.final_logits((X * scale)[:, None])[:, 0], scale, rt, kt)]
    chain_ok = not problems
    finite = not nonfinite_steps and bool(torch.isfinite(X).all())
    passed = finite and chain_ok and logits_match and all(c.passed for c in comps)
    rule = ("PASS iff every step ran hc_head -> norm -> head once in order (hooks), the captured X reproduces the "
            "model's logits, and logits(X/c), logits(X*c) match logits(X) in argmax AND magnitude "
            "(rel L2, KL within the dtype tolerance + eps allowance)")
    if passed:
        verdict = "PASS: the final RMSNorm runs on the path to the head and the logits are invariant to |X|"
    elif not finite:
        verdict = (f"HARD STOP: non-finite values (NaN/inf) in the logits at steps {nonfinite_steps} or in the last "
                   "residual - the weights or activations are broken; the final-norm question cannot be decided")
    elif not chain_ok:
        verdict = "HARD STOP: the final norm is not applied between hc_head and the head on every step"
    elif not logits_match:
        verdict = "HARD STOP: the captured residual does not reproduce the model's logits"
    else:
        verdict = ("HARD STOP: logits depend on the residual magnitude - the final norm is missing or misapplied "
                   "(fix the norm; never clip the residual)")
    return FinalNormReport(
        steps=decode_steps + 1, norm_calls=norm_calls, chain_ok=chain_ok, chain_problems=problems,
        logits_match_model=logits_match, x_max_abs=float(Xf.abs().max()), x_rms=float(Xf.pow(2).mean().sqrt()),
        x_stream_rms=[float(v) for v in Xf[0].pow(2).mean(-1).sqrt()], eps_allowance=eps_allow,
        comparisons=comps, test_layers=test_layers, verdict=verdict, rule=rule, passed=passed,
        residual_max_abs_per_layer=trace.max_abs[-1] if trace.max_abs else [], greedy_ids=greedy)
