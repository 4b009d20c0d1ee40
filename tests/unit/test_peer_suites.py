"""Peer suites run as data (issue 22 item 6): the DeepSeek-V4 chat-format cases of public test suites, restated in
fixtures/peer_suites/<suite>.json (provenance, input, expectation, kind encode/parse), run against dsv4.encoding.

Every case states what the official April encoder/parser does. `status`:
  official         the peer expects what the official code does; dsv4 must do it.
  peer_differs     the peer expects something else (its leniency, strictness or bug; `reason` says which): dsv4 must
  later_revision   do what the official code does (`expect`) and must NOT meet the peer's expectation (`peer_expect`).
  dsv4_difference  dsv4 deliberately differs from the official code (`difference`: a row of docs/differences.md,
                   `official`: what the official code does); dsv4 must do what the row says (`expect`).
  dsv4_option      an opt-in keyword of dsv4 (row `difference`); `expect` is dsv4's behaviour under it.
Nothing is skipped: tests of a peer file that are no encoder/parser case are listed under `not_cases` with a reason.
fixtures/peer_suites/README.md lists the suites, and the public suites searched for that hold no case.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dsv4.encoding import encode_messages, parse_message_from_completion_text

pytestmark = pytest.mark.hardstop

ROOT = Path(__file__).resolve().parents[2]
SUITES = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted((ROOT / "fixtures" / "peer_suites").glob("*.json"))}
CASES = [(s, c) for s, doc in SUITES.items() for c in doc["cases"]]
N_SUITES, N_CASES = 17, 227  # also stated in docs/differences.md and fixtures/peer_suites/README.md
STATUSES = ("official", "peer_differs", "later_revision", "dsv4_difference", "dsv4_option")
ROWS = set(re.findall(r"^\| ([A-Z]\d+) \|", (ROOT / "docs" / "differences.md").read_text(encoding="utf-8"), re.M))


def _run(case: dict):
    """(result, error): the prompt string or parsed message, or the ValueError raised."""
    i = case["input"]
    try:
        if case["kind"] == "encode":
            return encode_messages(i["messages"], i["thinking_mode"], **i["kwargs"]), None
        return parse_message_from_completion_text(i["text"], i["thinking_mode"], **i["kwargs"]), None
    except ValueError as e:
        return None, e


def _calls(calls: list[dict]) -> list[dict]:
    return [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in calls]


def _holds(expect: dict, result, error, suite: str) -> list[str]:
    """The parts of `expect` that the outcome fails ([] when it holds)."""
    if "error" in expect:
        if error is None:
            return [f"expected a ValueError, got {result!r}"[:300]]
        want = expect["error"]
        if isinstance(want, str) and want.lower() not in str(error).lower():
            return [f"error {str(error)!r} does not mention {want!r}"]
        return []
    if error is not None:
        return [f"raised {error}"]
    bad = []
    if isinstance(result, str):
        if "prompt" in expect and result != expect["prompt"]:
            bad.append("prompt differs")
        bad += [f"missing {s!r}" for s in expect.get("contains", []) if s not in result]
        bad += [f"holds {s!r}" for s in expect.get("not_contains", []) if s in result]
        if "startswith" in expect and not result.startswith(expect["startswith"]):
            bad.append(f"does not start with {expect['startswith']!r}")
        if "endswith" in expect and not result.endswith(expect["endswith"]):
            bad.append(f"does not end with {expect['endswith']!r}")
        if "not_endswith" in expect and result.endswith(expect["not_endswith"]):
            bad.append(f"ends with {expect['not_endswith']!r}")
        if "order" in expect:
            pos = [result.find(s) for s in expect["order"]]
            if -1 in pos or pos != sorted(pos):
                bad.append(f"not in order {expect['order']}")
        if "same_as" in expect:
            other = next(c for c in SUITES[suite]["cases"] if c["test"] == expect["same_as"])
            if _run(other)[0] != result:
                bad.append(f"differs from {expect['same_as']!r}")
        if "message" in expect:
            bad.append("an encode result cannot meet a message expectation")
    else:
        for key, want in expect.get("message", {}).items():
            got = _calls(result["tool_calls"]) if key == "tool_calls" else result[key]
            if got != want:
                bad.append(f"{key}: {got!r} != {want!r}")
    return bad


def test_suites_and_cases_are_counted():
    assert (len(SUITES), len(CASES)) == (N_SUITES, N_CASES), (len(SUITES), len(CASES))
    for name, doc in SUITES.items():
        src = doc["source"]
        assert src["repo"] and src["path"] and re.fullmatch(r"[0-9a-f]{40}", src["commit"]), name
        assert doc["suite"] == name and doc["mapping"] and doc["cases"], name
        assert all(nc["test"] and nc["reason"] for nc in doc["not_cases"]), name
        tests = [c["test"] for c in doc["cases"]]
        assert len(tests) == len(set(tests)), f"{name}: duplicate case names"


@pytest.mark.parametrize("suite,case", CASES, ids=[f"{s}::{c['test']}" for s, c in CASES])
def test_peer_case(suite, case):
    status = case["status"]
    assert status in STATUSES and case["kind"] in ("encode", "parse")
    result, error = _run(case)
    bad = _holds(case["expect"], result, error, suite)
    assert not bad, f"{suite} {case['test']} ({status}): {bad}"
    if status != "official":
        assert case.get("reason"), "every case that is not plainly official says why"
    if status in ("peer_differs", "later_revision"):
        assert "peer_expect" in case
    if "peer_expect" in case:  # recorded as a difference: the peer's expectation must really not be met
        assert _holds(case["peer_expect"], result, error, suite), f"{case['test']}: the peer's expectation holds too"
    if status.startswith("dsv4_"):
        assert case["difference"] in ROWS, f"{case['difference']} is not a row of docs/differences.md"
        if status == "dsv4_difference":  # it must really differ from the official behaviour it records
            official = case["official"]
            assert error is None if "error" in official else _holds(official, result, error, suite), case["test"]


@pytest.fixture(scope="module")
def tok():
    from dsv4.tokenizer import load_tokenizer
    return load_tokenizer()


ENCODE = [(s, c) for s, c in CASES if c["kind"] == "encode"]


@pytest.mark.parametrize("suite,case", ENCODE, ids=[f"{s}::{c['test']}" for s, c in ENCODE])
def test_template_equals_encoder_on_peer_cases(tok, suite, case):
    """dsv4/chat_template.jinja gives the encoder's prompt (or an error where the encoder raises) on every case."""
    i = case["input"]
    prompt, error = _run(case)
    kw = {"thinking": i["thinking_mode"] == "thinking", **i["kwargs"]}
    if error is not None:
        with pytest.raises(Exception):
            tok.apply_chat_template(i["messages"], add_generation_prompt=True, tokenize=False, **kw)
        return
    assert tok.apply_chat_template(i["messages"], add_generation_prompt=True, tokenize=False, **kw) == prompt
