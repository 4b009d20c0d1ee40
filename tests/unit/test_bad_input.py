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


def test_new_state_max_len_past_the_context_is_refused(small_models):
    """new_state(1, 1 << 20) on a model whose context is far shorter allocated buffers no position could reach
    (every step past the context is refused anyway): now a ValueError naming the context. Control: a max_len of
    the context rounded up to 128 is taken."""
    m = small_models[0]
    ctx = m.args.max_context
    top = -(-ctx // 128) * 128
    with pytest.raises(ValueError, match=rf"max_len={top + 128}: over the model's context of {ctx} tokens per row"):
        m.new_state(1, top + 128)
    assert m.new_state(1, top).max_len == top


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


# ------------------------------------------------------------------------------- user trial 2 (one test per class)
@pytest.fixture(scope="module")
def no_mtp_ckpt(tmp_path_factory):
    """`dsv4 make-checkpoint DIR --geometry tiny --no-mtp` (the API it runs)."""
    from dsv4.synth import make_checkpoint

    d = tmp_path_factory.mktemp("no_mtp") / "ckpt"
    make_checkpoint(d, "tiny", include_mtp=False, log=None)
    return d


def test_a_checkpoint_without_mtp_says_so_and_speculative_decoding_names_it(no_mtp_ckpt, capsys):
    """`make-checkpoint --no-mtp` wrote `num_nextn_predict_layers: 1` beside shards without mtp.0.*; then
    `generate --speculative 2` said `missing tensor mtp.0.attn.attn_sink (... 87 missing in all)`. Now the config
    says 0 MTP blocks, and asking for the MTP drafter is refused by name at every library entry."""
    from dsv4.checkpoint import load_checkpoint
    from dsv4.config import NoMTPBlockError
    from dsv4.generate import load_model, run_generate
    from dsv4.model import Transformer
    from dsv4.speculative import MTPDrafter

    d = no_mtp_ckpt
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 0 and cfg["compress_ratios"] == [0, 4, 128, 4]
    assert cfg["model_type"] == "deepseek_v4"
    assert not any(n.startswith("mtp.") for n in Checkpoint(d).keys())
    want = (rf"^{re.escape(str(d))}: this checkpoint has no MTP block \(num_nextn_predict_layers = 0\); "
            r"speculative decoding with the MTP drafter needs it")
    with pytest.raises(NoMTPBlockError, match=want):
        load_model(d, mtp=True, progress=False)
    with pytest.raises(NoMTPBlockError, match=want):
        load_checkpoint(d, include_mtp=True, progress=False)
    assert run_generate(ckpt=d, prompt="hi", max_tokens=2, temperature=0.0, thinking=False, seed=0, device="cpu",
                        dtype="fp32", speculative=2) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"dsv4 generate: error: {d}: this checkpoint has no MTP block (num_nextn_predict_layers"
                          " = 0); speculative decoding with the MTP drafter needs it")
    m, _ = load_model(d, progress=False)  # plain decoding needs no MTP block
    with pytest.raises(NoMTPBlockError, match=r"^Transformer\(mtp=True\): the ModelArgs has no MTP block"):
        Transformer(m.args, mtp=True)
    with pytest.raises(ValueError, match=r"^MTPDrafter: the model has no MTP block"):
        MTPDrafter(m)


def test_a_config_that_lists_an_mtp_block_the_shards_lack_names_the_block(no_mtp_ckpt, copy_ckpt):
    """A checkpoint written by the old make-checkpoint --no-mtp (config.json: 1 MTP block, no mtp.* tensor): the
    MTP load named one tensor of 87 missing; now it names the block and the config key. A plain load still works."""
    from dsv4.checkpoint import load_checkpoint

    d = copy_ckpt(no_mtp_ckpt)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(num_nextn_predict_layers=1, compress_ratios=cfg["compress_ratios"] + [0])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(d))}: config.json says num_nextn_predict_layers = "
                                              r"1, but the checkpoint holds no tensor of the MTP block mtp.0 \(\d+ "
                                              r"expected, e.g. mtp.0.\S+\); speculative decoding with the MTP "
                                              r"drafter needs it"):
        load_checkpoint(d, include_mtp=True, progress=False)
    load_checkpoint(d, progress=False)


_DEVICES = r"'cpu', 'cuda' or 'cuda:N'|'cpu', 'cuda', 'cuda:N' or 'meta'"  # Transformer also builds on meta
_DEVICES = f"({_DEVICES})"


@pytest.mark.parametrize("device,message", [
    ("gpu", rf"device='gpu': not a torch device dsv4 runs on \(expected {_DEVICES}\)$"),
    ("cuda:x", rf"device='cuda:x': not a torch device dsv4 runs on \(expected {_DEVICES}\)$"),
    (torch.device("mps"), rf"device=device\(type='mps'\): not a torch device dsv4 runs on \(expected {_DEVICES}\)$"),
    (0, rf"device=0 \(int\): expected a torch device: {_DEVICES}$"),
    ("cuda:99", r"device='cuda:99': (no CUDA device is visible on this machine|only \d+ CUDA device\(s\) visible)"),
], ids=["gpu", "cuda_x", "mps", "int", "cuda99"])
def test_a_bad_device_is_named_by_every_api_entry(tmp_path, device, message):
    """`load_model("tiny", device="gpu")` raised torch's raw `RuntimeError: Expected one of cpu, cuda, ...`; the
    API now checks the device as the CLI's --device is checked, naming the argument and the value."""
    from dsv4.checkpoint import load_checkpoint
    from dsv4.generate import load_model
    from dsv4.model import Transformer
    from dsv4.synth import make_checkpoint

    for call in (lambda: load_model("tiny", device=device), lambda: Transformer(tiny_args(), device=device),
                 lambda: load_checkpoint("synth:tiny", device=device, progress=False),
                 lambda: make_checkpoint(tmp_path / "x", "tiny", device=device, log=None)):
        with pytest.raises(ValueError, match=f"^{message}"):
            call()
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name,dtype", [("norm.weight", torch.int32), ("norm.weight", torch.float16),
                                        ("layers.0.attn.attn_sink", torch.float64),
                                        ("layers.0.ffn.gate.tid2eid", torch.int32)])
def test_load_weights_refuses_a_dtype_the_checkpoint_never_holds(tiny_ckpt, name, dtype):
    """`load_weights` cast an int32 `norm.weight` (and any float16 / float64 tensor, an int32 tid2eid) silently.
    Now: refused naming the tensor, the dtype given and the ones expected. Negative controls: the checkpoint's
    own state dict, and one read in bfloat16 (the other model dtype), load."""
    from dsv4.checkpoint import load_checkpoint
    from dsv4.generate import load_model

    m, _ = load_model(tiny_ckpt, progress=False)
    _, sd = load_checkpoint(tiny_ckpt, progress=False)
    own = m.state_dict()[name].dtype
    want = "torch.int64" if own == torch.int64 else "torch.float32 or torch.bfloat16"
    with pytest.raises(RuntimeError, match=rf"^{re.escape(name)}: dtype {dtype} cannot load into the model's {own} "
                                           rf"\(expected {want}: what the checkpoint holds for it"):
        m.load_weights({**sd, name: sd[name].to(dtype)})
    m.load_weights(sd)
    m.load_weights(load_checkpoint(tiny_ckpt, dtype=torch.bfloat16, progress=False)[1])


def test_forward_names_the_first_token_id_outside_the_vocabulary(small_models):
    """`forward` said only `min -1, max V`; it now names the first bad id and its [row, position]."""
    m = small_models[0]
    V = m.args.vocab_size
    with pytest.raises(ValueError, match=rf"^input_ids outside \[0, {V}\): input_ids\[1, 2\]={V} is the first of 2 "
                                         rf"\(min -1, max {V}\)$"):
        m(torch.tensor([[1, 2, 3, 4], [5, 6, V, -1]]), m.new_state(2))


def test_ckpt_that_is_a_loop_a_file_or_missing_says_which(tmp_path, monkeypatch):
    """`--ckpt` at a symbolic-link loop said `not a checkpoint directory` (loops inside were named as loops); a
    config.json that is a directory said `x/config.json: no config.json`. Each is now named for what it is."""
    from dsv4.config import SymlinkLoopError
    from dsv4.generate import CKPT_ENV, resolve_ckpt

    monkeypatch.delenv(CKPT_ENV, raising=False)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(SymlinkLoopError, match=rf"^--ckpt={re.escape(str(loop))}: symbolic link loop \(the link "
                                               r"resolves back to itself\), expected a checkpoint directory"):
        resolve_ckpt(loop)
    f = tmp_path / "file"
    f.write_text("x")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    for p, why in ((tmp_path / "missing", "does not exist"), (f, "a file"),
                   (dangling, "a broken symbolic link (its target does not exist)")):
        with pytest.raises(FileNotFoundError, match=rf"^--ckpt={re.escape(str(p))}: not a checkpoint directory "
                                                    rf"\({re.escape(why)}\)$"):
            resolve_ckpt(p)
    monkeypatch.setenv(CKPT_ENV, str(loop))
    with pytest.raises(SymlinkLoopError, match=rf"^\${CKPT_ENV}={re.escape(str(loop))}: symbolic link loop"):
        resolve_ckpt(None)
    d = tmp_path / "ck"
    (d / "config.json").mkdir(parents=True)
    for call in (lambda: ModelArgs.from_hf_config(d), lambda: Checkpoint(d)):
        with pytest.raises(FileNotFoundError, match=rf"^{re.escape(str(d / 'config.json'))}: is a directory, not a "
                                                    r"file \(expected the HF-style DeepSeek-V4 config.json file\)$"):
            call()


def test_config_without_model_type_is_refused_and_every_shipped_config_has_it(tiny_ckpt, copy_ckpt, no_mtp_ckpt):
    """A config.json without `model_type` loaded silently (transformers then printed a false tokenizer-regex
    warning); a wrong one was already refused. Every config dsv4 ships or writes has it (checked first)."""
    from dsv4.synth import CONFIG_DIR, GEOMETRIES, geometry_config

    shipped = {p.name: json.loads(p.read_text()) for p in sorted(CONFIG_DIR.glob("*.json"))}
    assert len(shipped) >= 2
    written = {f"geometry {g}": geometry_config(g) for g in GEOMETRIES}
    written |= {"tiny_args": tiny_args().to_hf_config(), "make-tiny": json.loads((tiny_ckpt / "config.json")
                .read_text()), "make-checkpoint --no-mtp": json.loads((no_mtp_ckpt / "config.json").read_text())}
    for what, cfg in (shipped | written).items():
        assert cfg.get("model_type") == "deepseek_v4", what
    d = copy_ckpt(tiny_ckpt)
    p = _edit_config(d, lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "model_type"}))
    want = rf"^{re.escape(str(p))}: missing key 'model_type' \(expected 'deepseek_v4'"
    with pytest.raises(ValueError, match=want):
        ModelArgs.from_hf_config(d)
    with pytest.raises(ValueError, match=want):
        Checkpoint(d)
    with pytest.raises(ValueError, match=r"^<dict>: missing key 'model_type' \(expected 'deepseek_v4'"):
        ModelArgs.from_hf_config({k: v for k, v in tiny_args().to_hf_config().items() if k != "model_type"})


def test_forward_refuses_positions_past_the_context():
    """A sequence may hold original_seq_len x rope_factor positions (YaRN's range, spec §5.2; tiny: 64 x 2 = 128
    here): the call that would pass it raises LimitError naming the numbers - at the prefill, at a decode step and
    at an appended chunk - while the call that ends exactly at the context runs."""
    from dsv4.config import LimitError
    from dsv4.model import Transformer
    from dsv4.tiny import random_state_dict, tiny_args
    args = tiny_args(vocab_size=256, original_seq_len=64, rope_factor=2.0)
    m = Transformer(args)
    m.load_weights(random_state_dict(args, seed=3, include_mtp=False))
    with pytest.raises(LimitError, match=r"position 0 \+ 129 new token\(s\) needs 129 positions, over the model's "
                                         r"context of 128 tokens per row \(original_seq_len 64 x rope_factor 2.0\)"):
        m(torch.randint(0, 256, (1, 129)), m.new_state(1, 128))
    st = m.new_state(1, 128)
    m(torch.randint(0, 256, (1, 126)), st)
    m(torch.randint(0, 256, (1, 1)), st)  # position 126: the 127th token
    m(torch.randint(0, 256, (1, 1)), st)  # the 128th: exactly the context
    with pytest.raises(LimitError, match=r"position 128 \+ 1 new token\(s\) needs 129"):
        m(torch.randint(0, 256, (1, 1)), st)
    st = m.new_state(1, 128)
    m(torch.randint(0, 256, (1, 125)), st)
    with pytest.raises(LimitError, match=r"position 125 \+ 4 new token\(s\) needs 129"):
        m(torch.randint(0, 256, (1, 4)), st)
    assert st.row_pos == [125], "a refused call must not advance the state"


def test_warmup_refuses_a_max_len_over_the_context():
    """`dsv4.warmup.warmup` runs prefills up to max_len: over the model's context (tiny: 64 x 16 = 1024) the model
    would refuse them, so warmup refuses first, naming both numbers; before any work."""
    from dsv4.config import LimitError
    from dsv4.model import Transformer
    from dsv4.tiny import tiny_args
    from dsv4.warmup import warmup
    m = Transformer(tiny_args(vocab_size=256))
    with pytest.raises(LimitError, match=r"warmup: max_len=1025 is over the model's context of 1024 tokens per row "
                                         r"\(original_seq_len 64 x rope_factor 16.0\)"):
        warmup(m, max_len=1025)
    with pytest.raises(ValueError, match=r"warmup: max_len=True; expected an int >= 8"):
        warmup(m, max_len=True)
