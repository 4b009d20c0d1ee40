"""Bad input found by trying dsv4 as a new user: each is a whole class of fault, refused with a message naming
the file / field / value and what was expected, never silently accepted.

* JSON objects with a key twice (config.json, the index, a safetensors header): Python's json keeps the last
  value silently, so `"num_hidden_layers": 4, "num_hidden_layers": 2` loaded as 2.
* config.json keys whose released value is the only one dsv4 implements (`norm_topk_prob`, `hidden_act`,
  `tie_word_embeddings`, biases, `topk_method`, BOS/EOS ids, `activation_scheme`) were ignored whatever they
  said; YaRN betas <= 0 died in `math.log` ("math domain error", no file or field named).
* CLI values: a seed outside 64 bits (traceback from torch), an empty path (silently the current directory), an
  empty prompt, a `--json` path that cannot be written (traceback after the whole run).
* API: a decode state from another model (`zip` over the layers ran only the common prefix: silently wrong
  logits), `new_state(0)`, `prompt_ids` given one dict / a string / a batch (transformers' confusing errors),
  text with a lone surrogate (tokenizers' TypeError naming nothing).
* `make-checkpoint --shard-gb` below one tensor's size produced larger shards without a word; below one byte it
  named the internal `max_shard_bytes=0`, after importing torch.
* `--weights quantized` on a bf16 checkpoint named only the API argument `dequantize=False`.
* An output directory that cannot be made (`/proc/x`, a path under a file) gave `[Errno 2] No such file or
  directory`; a file given as the output directory was called "not an empty directory".
(More in test_config.py (config.json keys in ModelArgs errors, a bad layer count taken for a later revision),
test_checkpoint.py (a wrong tensor hidden by a stale total_size), test_corrupt_bytes.py (`load_weights` with
NaN / inf), test_cli.py (`| head -1`), test_diagnose.py (the special-string warning logged twice).)
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
from pathlib import Path

import pytest
import torch

from dsv4.checkpoint import Checkpoint, CheckpointError
from dsv4.cli import main
from dsv4.config import FIXED_CONFIG_VALUES, ModelArgs
from dsv4.tiny import tiny_args


def _edit_config(ckpt, text_edit):
    p = ckpt / "config.json"
    p.write_text(text_edit(p.read_text()))
    return p


# ---------------------------------------------------------------------------------------------- duplicate keys
def test_duplicate_key_in_config_is_refused(tiny_ckpt, copy_ckpt):
    ck = copy_ckpt(tiny_ckpt)
    p = _edit_config(ck, lambda t: t.replace('"num_hidden_layers": 4,', '"num_hidden_layers": 4, "num_hidden_layers": 2,'))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}: duplicate key 'num_hidden_layers'"):
        ModelArgs.from_hf_config(ck)


def test_duplicate_key_in_index_is_refused(tiny_ckpt, copy_ckpt):
    ck = copy_ckpt(tiny_ckpt)
    idx = ck / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    name, shard = next(iter(doc["weight_map"].items()))
    other = next(s for s in doc["weight_map"].values() if s != shard)
    text = json.dumps(doc).replace('"weight_map": {', f'"weight_map": {{"{name}": "{other}", ', 1)
    idx.write_text(text)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(idx))}: duplicate key '{re.escape(name)}'"):
        Checkpoint(ck)


def test_tensor_named_twice_in_a_header_is_refused(tiny_ckpt, copy_ckpt):
    ck = copy_ckpt(tiny_ckpt)
    shard = sorted(ck.glob("*.safetensors"))[0]
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    first = next(k for k in header if k != "__metadata__")
    text = json.dumps(header)[:-1] + ", " + json.dumps({first: header[first]})[1:-1] + "}"
    hb = text.encode() + b" " * (-len(text) % 8)
    shard.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(shard))}: safetensors header: duplicate key "
                                              rf"'{re.escape(first)}'"):
        Checkpoint(ck)


# ---------------------------------------------------------------------------------------------- config values
_OTHER_STR = {"silu": "gelu", "noaux_tc": "greedy", "dynamic": "static"}


def _other(want):
    """A value other than the released one, of the same type (a dict keyed by values would merge True with 1 and
    False with 0, testing `norm_topk_prob: 2` instead of `false`)."""
    if isinstance(want, bool):
        return not want
    if isinstance(want, int):
        return want + 5
    return _OTHER_STR[want]


@pytest.mark.parametrize("key", sorted(FIXED_CONFIG_VALUES))
def test_config_key_with_an_unimplemented_value_is_refused(key):
    cfg = tiny_args().to_hf_config()
    want = FIXED_CONFIG_VALUES[key]
    bad = _other(want)
    *outer, last = key.split(".")
    d = cfg
    for part in outer:
        d = d[part]
    d[last] = bad
    with pytest.raises(ValueError, match=rf"key '{re.escape(key)}'={re.escape(json.dumps(bad))} \(\w+\): dsv4 "
                                         rf"implements only {re.escape(json.dumps(want))}"):
        ModelArgs.from_hf_config(cfg)
    d[last] = want  # the released value (and an absent key) loads
    ModelArgs.from_hf_config(cfg)
    del d[last]
    ModelArgs.from_hf_config(cfg)


def _equal_of_another_type(want):
    """Values Python's `==` takes for `want` that are another JSON type (True == 1 == 1.0, False == 0 == 0.0)."""
    if isinstance(want, bool):
        return [int(want), float(want)]
    if isinstance(want, int):
        return [float(want)] + ([bool(want)] if want in (0, 1) else [])
    return []


_KIND = {bool: "boolean", int: "integer", float: "float"}


@pytest.mark.parametrize("key,bad", [(k, b) for k in sorted(FIXED_CONFIG_VALUES)
                                     for b in _equal_of_another_type(FIXED_CONFIG_VALUES[k])])
def test_fixed_config_value_is_compared_by_type_and_value(key, bad):
    """`norm_topk_prob: 1`, `attention_bias: 0`, `eos_token_id: 1.0` equal the released values under `==`: each is
    refused, and the message names the key, the value with its JSON type, and the expected value with its type
    (the old message said `'norm_topk_prob'=1: dsv4 implements only True`, hiding why 1 is not true)."""
    want = FIXED_CONFIG_VALUES[key]
    assert bad == want  # the trap
    cfg = tiny_args().to_hf_config()
    *outer, last = key.split(".")
    d = cfg
    for part in outer:
        d = d[part]
    d[last] = bad
    with pytest.raises(ValueError, match=rf"^<dict>: key '{re.escape(key)}'={re.escape(json.dumps(bad))} "
                                         rf"\({_KIND[type(bad)]}\): dsv4 implements only {re.escape(json.dumps(want))} "
                                         rf"\({_KIND[type(want)]}; the value of the released DeepSeek-V4 configs, "
                                         r"compared by type and value\)"):
        ModelArgs.from_hf_config(cfg)


@pytest.mark.parametrize("wbs,kind", [([128.0, 128.0], "list"), ([128, 128.0], "list"), ((128, True), "list"),
                                      ("128,128", "string")], ids=["floats", "one_float", "bool", "string"])
def test_weight_block_size_is_compared_by_type(wbs, kind):
    """`quantization_config.weight_block_size` [128.0, 128.0] passed `list(wbs) != [128, 128]`; every element must
    be the integer 128. Negative control: [128, 128] loads."""
    cfg = tiny_args().to_hf_config()
    cfg["quantization_config"]["weight_block_size"] = list(wbs) if isinstance(wbs, tuple) else wbs
    with pytest.raises(ValueError, match=r"^<dict>: key 'quantization_config.weight_block_size'=\S.* \("
                                         rf"{kind}\), expected \[128, 128\] \(a list of two integers"):
        ModelArgs.from_hf_config(cfg)
    cfg["quantization_config"]["weight_block_size"] = [128, 128]
    ModelArgs.from_hf_config(cfg)


def test_revision_geometry_is_not_read_from_a_float_width():
    """detect_revision named a DSpark config with hidden_size 4096.0 "Flash" (a dict lookup, 4096.0 == 4096)."""
    from dsv4.config import detect_revision

    cfg = json.loads((Path(__file__).resolve().parents[2] / "fixtures/configs/deepseek_v4_flash.config.json")
                     .read_text())
    cfg["dspark_block_size"] = 5
    assert detect_revision(cfg)[0].startswith("DeepSeek-V4-Flash-0731")
    cfg["hidden_size"] = 4096.0
    assert detect_revision(cfg)[0].startswith("a DSpark revision of DeepSeek-V4")


@pytest.mark.parametrize("change,message", [
    (dict(beta_fast=-5), r"ModelArgs.beta_fast=-5: expected a finite positive number"),
    (dict(beta_slow=0), r"ModelArgs.beta_slow=0: expected a finite positive number"),
    (dict(beta_fast=1, beta_slow=32), r"ModelArgs.beta_fast=1: expected > beta_slow \(32\)"),
    (dict(eos_token_id=129280), r"ModelArgs.eos_token_id=129280: expected a token id in 0..129279"),
    (dict(bos_token_id=-1), r"ModelArgs.bos_token_id=-1: expected a token id in 0..129279"),
], ids=["beta_neg", "beta_zero", "beta_order", "eos_range", "bos_neg"])
def test_model_args_refuse_unusable_rope_and_token_values(change, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        tiny_args(**change)


def test_negative_beta_in_a_config_names_the_file(tiny_ckpt, copy_ckpt):
    ck = copy_ckpt(tiny_ckpt)
    p = _edit_config(ck, lambda t: t.replace('"beta_fast": 32', '"beta_fast": -5'))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}: ModelArgs.beta_fast=-5"):
        ModelArgs.from_hf_config(ck)


# ---------------------------------------------------------------------------------------------- CLI values
def _exit(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,message", [
    (["generate", "--prompt", "x", "--seed", str(2**64)], r"--seed: 18446744073709551616 is outside 0..2\*\*64-1"),
    (["generate", "--prompt", "x", "--seed", "-1"], r"--seed: -1 is outside"),
    (["make-tiny", "out", "--seed", "-1"], r"--seed: -1 is outside"),
    (["make-checkpoint", "out", "--seed", str(2**64)], r"--seed: 18446744073709551616 is outside"),
    (["diagnose", "--ckpt", ""], r"--ckpt: '': expected a non-empty path"),
    (["make-tiny", ""], r"out_dir: '': expected a non-empty path"),
    (["make-checkpoint", " "], r"out_dir: ' ': expected a non-empty path"),
    (["diagnose", "--json", ""], r"--json: '': expected a non-empty path"),
    (["diagnose", "--prompt", ""], r"--prompt: expected a non-empty prompt text"),
    (["generate", "--prompt", "  "], r"--prompt: expected a non-empty prompt text"),
    (["make-checkpoint", "out", "--shard-gb", "1e-12"], r"--shard-gb: '1e-12': expected a finite size in GB >= "
                                                       r"1e-9 \(one byte\)$"),  # was max_shard_bytes=0, after import
    (["make-checkpoint", "out", "--shard-gb", "nan"], r"--shard-gb: 'nan': expected a finite size in GB"),
    (["make-checkpoint", "out", "--shard-gb", "-4"], r"--shard-gb: '-4': expected a finite size in GB"),
    (["make-checkpoint", "out", "--shard-gb", "four"], r"--shard-gb: 'four' is not a number$"),
], ids=["seed_huge", "seed_neg", "tiny_seed", "mc_seed", "ckpt", "tiny_out", "mc_out", "json", "d_prompt",
        "g_prompt", "shard_tiny", "shard_nan", "shard_neg", "shard_word"])
def test_bad_cli_values_are_usage_errors(argv, message, capsys):
    code, err = _exit(argv, capsys)
    assert code == 2 and err.startswith(f"dsv4 {argv[0]}: error: argument ") and re.search(message, err), err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and /sys (Linux)")
@pytest.mark.parametrize("path", ["/proc/dsv4-report.json", "/sys/dsv4-report.json"])
def test_unwritable_json_path_fails_before_the_run(path, capsys):
    code, err = _exit(["diagnose", "--json", path], capsys)
    assert code == 2 and f"argument --json: {path!r}: cannot write the report there" in err


def test_json_probe_leaves_no_file_and_keeps_an_existing_one(tmp_path, capsys):
    from dsv4.cli import parse_args

    new, old = tmp_path / "new.json", tmp_path / "old.json"
    old.write_text("keep")
    assert parse_args(["diagnose", "--json", str(new)]).json == new and not new.exists()
    assert parse_args(["diagnose", "--json", str(old)]).json == old and old.read_text() == "keep"


# ---------------------------------------------------------------------------------------------- model / prompt API
@pytest.fixture(scope="module")
def small_models():
    from dsv4.model import Transformer

    a = tiny_args()
    return Transformer(a), Transformer(a.with_layers(2)), Transformer(a, dtype=torch.bfloat16)


def test_state_from_another_model_is_refused(small_models):
    m4, m2, m4_bf16 = small_models
    ids = torch.randint(0, 1000, (1, 3))
    with pytest.raises(ValueError, match="state has 2 layer states, this model has 4 layers"):
        m4(ids, m2.new_state(1))
    with pytest.raises(ValueError, match=r"state.layers\[0\] does not belong to this model: .*torch.bfloat16"):
        m4(ids, m4_bf16.new_state(1))
    with pytest.raises(TypeError, match="state: expected a DecodeState"):
        m4(ids, None)
    with pytest.raises(TypeError, match="input_ids: expected a torch.Tensor"):
        m4([[1, 2]], m4.new_state(1))
    assert m4(ids, m4.new_state(1)).shape == (1, m4.args.vocab_size)  # its own state passes the check
    used = m2.new_state(1)
    m2(ids, used)  # validated (and remembered) for m2 only: m4 still checks it
    with pytest.raises(ValueError, match="state has 2 layer states, this model has 4 layers"):
        m4(ids[:, :1], used)


@pytest.mark.parametrize("batch", [0, -1, "2", True])
def test_new_state_batch_must_be_positive_int(small_models, batch):
    with pytest.raises(ValueError, match=rf"batch={re.escape(repr(batch))}: expected an int >= 1"):
        small_models[0].new_state(batch)


@pytest.fixture(scope="module")
def tok():
    from dsv4.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.mark.parametrize("messages,message", [
    ("hello", r"^messages: expected a list of message dicts, got str"),
    ({"role": "user", "content": "hi"}, r"^messages: expected a list of message dicts, got dict"),
    (["hi"], r"^messages\[0\]: expected a dict, got str"),
    ([[{"role": "user", "content": "hi"}]], r"^messages\[0\]: expected a dict, got list"),
    ([{"role": "user", "content": "a\udcffb"}], r"^messages\[0\]\.content: not valid Unicode text .*index 1"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "\ud800"}],
     r"^messages\[1\]\.reasoning_content: not valid Unicode text"),
], ids=["str", "dict", "str_item", "batch", "surrogate", "surrogate_reasoning"])
def test_prompt_ids_names_malformed_messages(tok, messages, message):
    from dsv4.encoding import encode_messages, prompt_ids

    with pytest.raises(ValueError, match=message):
        prompt_ids(tok, messages)
    if isinstance(messages, list):  # the encoder says the same
        with pytest.raises(ValueError, match=message):
            encode_messages(messages, "thinking")


def test_oversize_tensor_for_shard_limit_is_reported(tmp_path):
    from dsv4.synth import make_checkpoint

    said = []
    rep = make_checkpoint(tmp_path / "c", "tiny", 1, include_mtp=False, dry_run=True, max_shard_bytes=1_000_000,
                          log=said.append)
    note = [s for s in said if s.startswith("note:")]
    assert len(note) == 1 and "embed.weight" in note[0] and "exceed the 0.001 GB limit" in note[0], said
    assert any(os.path.getsize(f) > 1_000_000 for f in rep.path.glob("*.safetensors"))  # what the note says
    quiet = []
    make_checkpoint(tmp_path / "d", "tiny", 1, include_mtp=False, dry_run=True, log=quiet.append)
    assert not any(s.startswith("note:") for s in quiet)  # the default limit holds every tensor: no note


def test_quantized_weights_on_a_bf16_checkpoint_name_the_option(tiny_ckpt_bf16, capsys):
    """`--weights quantized` on a bf16 checkpoint: the error named only the API argument `dequantize=False`."""
    assert main(["diagnose", "--ckpt", str(tiny_ckpt_bf16), "--weights", "quantized"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"dsv4 diagnose: error: {tiny_ckpt_bf16}: dequantize=False (--weights quantized), but the "
                   "checkpoint holds no FP8/FP4 weight (config.json dtype='bf16', expert_dtype='bf16'): a bf16 "
                   "checkpoint has nothing to keep quantized (use --weights dequantized)")


@pytest.mark.parametrize("command", ["make-tiny", "make-checkpoint"])
@pytest.mark.parametrize("where", ["under_a_file", "is_a_file", "proc"])
def test_output_dir_that_cannot_be_made_is_named(tmp_path, capsys, command, where):
    """Both checkpoint writers share one output-directory rule: a path under a file, a path that is a file, a
    place where no directory can be made (/proc) is refused naming the path and what was expected (it was
    `[Errno 2] No such file or directory` for /proc, and 'is not an empty directory' for a file)."""
    if where == "proc" and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc (not Linux)")
    f = tmp_path / "file"
    f.write_text("x")
    out = {"under_a_file": f / "ck", "is_a_file": f, "proc": "/proc/dsv4-cannot-write-here"}[where]
    extra = ["--geometry", "tiny", "--dry-run"] if command == "make-checkpoint" else []
    assert main([command, str(out), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    if where == "is_a_file":
        assert err == (f"dsv4 {command}: error: {out}: exists and is a file, expected a new or empty directory "
                       f"({command} never overwrites)")
    else:
        why = "Not a directory" if where == "under_a_file" else "No such file or directory"
        assert err == (f"dsv4 {command}: error: {out}: cannot create the output directory ({why}); expected a new "
                       "or empty directory in a writable place")
