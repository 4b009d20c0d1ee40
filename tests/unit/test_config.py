"""`ModelArgs` from the published configs (spec §1.1), its validation messages, and `TEST_LAYERS`."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from dsv4.config import TEST_LAYERS_ENV, ModelArgs, layers_from_env

CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"
FLASH = CONFIGS / "deepseek_v4_flash.config.json"
PRO = CONFIGS / "deepseek_v4_pro.config.json"


def test_flash_config():
    a = ModelArgs.from_hf_config(FLASH)
    assert (a.dim, a.n_layers, a.n_heads, a.head_dim, a.rope_head_dim) == (4096, 43, 64, 512, 64)
    assert (a.q_lora_rank, a.o_groups, a.o_lora_rank, a.window_size) == (1024, 8, 1024, 128)
    assert a.compress_ratios == (0, 0) + (4, 128) * 20 + (4, 0) and len(a.compress_ratios) == 44
    assert (a.index_n_heads, a.index_head_dim, a.index_topk) == (64, 128, 512)
    assert (a.n_routed_experts, a.n_activated_experts, a.n_shared_experts, a.moe_inter_dim) == (256, 6, 1, 2048)
    assert (a.n_hash_layers, a.n_mtp_layers, a.score_func, a.route_scale, a.swiglu_limit) == (
        3, 1, "sqrtsoftplus", 1.5, 10.0)
    assert (a.rope_theta, a.compress_rope_theta, a.rope_factor, a.original_seq_len, a.beta_fast, a.beta_slow) == (
        10000.0, 160000.0, 16.0, 65536, 32, 1)
    assert (a.hc_mult, a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps, a.vocab_size) == (4, 20, 1e-6, 1e-6, 129280)
    assert (a.dtype, a.scale_fmt, a.expert_dtype) == ("fp8", "ue8m0", "fp4")
    assert [a.ratio(i) for i in (0, 1, 2, 3, 42)] == [0, 0, 4, 128, 4]


def test_pro_config():
    a = ModelArgs.from_hf_config(PRO)
    assert (a.dim, a.n_layers, a.n_heads, a.q_lora_rank, a.o_groups) == (7168, 61, 128, 1536, 16)
    assert a.compress_ratios == (128, 128) + (4, 128) * 29 + (4, 0) and len(a.compress_ratios) == 62
    assert (a.index_topk, a.n_routed_experts, a.moe_inter_dim, a.route_scale) == (1024, 384, 3072, 2.5)
    assert a.expert_dtype == "fp4"


@pytest.mark.parametrize("path", [FLASH, PRO], ids=["flash", "pro"])
def test_hf_config_round_trip(path):
    a = ModelArgs.from_hf_config(path)
    assert ModelArgs.from_hf_config(a.to_hf_config()) == a
    published = json.loads(path.read_text())
    mine = a.to_hf_config()
    for key in ("hidden_size", "compress_ratios", "rope_scaling", "quantization_config", "expert_dtype"):
        assert mine[key] == published[key], key


def test_f0_revision_without_expert_dtype_means_fp4():
    cfg = json.loads(FLASH.read_text())
    del cfg["expert_dtype"]
    assert ModelArgs.from_hf_config(cfg).expert_dtype == "fp4"


def test_with_layers_keeps_mtp_ratio():
    a = ModelArgs.from_hf_config(FLASH).with_layers(3)
    assert (a.n_layers, a.n_hash_layers, a.compress_ratios) == (3, 3, (0, 0, 4, 0))
    assert ModelArgs.from_hf_config(FLASH).with_layers(2).n_hash_layers == 2
    with pytest.raises(ValueError, match="n_layers=0: expected an integer in 1..43"):
        ModelArgs.from_hf_config(FLASH).with_layers(0)


@pytest.mark.parametrize("field,value,message", [
    ("o_groups", 3, r"ModelArgs.o_groups=3: expected a divisor of n_heads \(64\)"),
    ("compress_ratios", (0, 0, 4), "ModelArgs.compress_ratios=.*: expected at least n_layers=43 entries"),
    ("dim", 0, "ModelArgs.dim=0: expected a positive integer"),
    ("index_head_dim", 96, "ModelArgs.index_head_dim=96: expected a power of two"),
    ("score_func", "relu", "ModelArgs.score_func='relu': expected one of"),
    ("expert_dtype", "int4", "ModelArgs.expert_dtype='int4': expected 'fp4', 'fp8' or 'bf16'"),
    ("n_activated_experts", 300, r"ModelArgs.n_activated_experts=300: expected <= n_routed_experts \(256\)"),
    ("hc_eps", float("nan"), "ModelArgs.hc_eps=nan: expected a finite non-negative number"),
], ids=lambda v: v if isinstance(v, str) and not v.startswith("ModelArgs") else None)
def test_validation_names_field_value_expectation(field, value, message):
    a = ModelArgs.from_hf_config(FLASH)
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(a, **{field: value})


def test_bad_ratio_entry_is_named():
    a = ModelArgs.from_hf_config(FLASH)
    with pytest.raises(ValueError, match=r"ModelArgs.compress_ratios\[43\]=2: expected one of \(0, 4, 128\)"):
        dataclasses.replace(a, compress_ratios=a.compress_ratios[:43] + (2,))


def _edited_flash(tmp_path, edit) -> Path:
    """The published Flash config.json with `edit(cfg)` applied, written to tmp_path/config.json."""
    cfg = json.loads(FLASH.read_text())
    edit(cfg)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.pop("hidden_size"), "missing key 'hidden_size'"),
    (lambda c: c.update(num_key_value_heads=8), "num_key_value_heads=8, expected 1"),
    (lambda c: c.update(rope_scaling={"type": "linear", "factor": 2}), "rope_scaling.type='linear', expected 'yarn'"),
    (lambda c: c.update(hidden_size="4096"), "key 'hidden_size'='4096' has type str"),
    (lambda c: c.update(model_type="deepseek_v3"), "model_type='deepseek_v3', expected 'deepseek_v4'"),
    (lambda c: c["quantization_config"].update(weight_block_size=[64, 64]),
     r"weight_block_size'=\[64, 64\] \(list\), expected \[128, 128\]"),
    (lambda c: c.update(architectures=["DeepseekV3ForCausalLM"]),
     r"'architectures'=\[\"DeepseekV3ForCausalLM\"\] \(list\), expected a list naming 'DeepseekV4ForCausalLM'"),
    (lambda c: c.update(architectures="DeepseekV4ForCausalLM"), r"'architectures'=.*\(string\), expected a list"),
    (lambda c: c["rope_scaling"].update(type="yarn", rope_type="linear"),
     r"rope_scaling.type='yarn' and rope_scaling.rope_type='linear' disagree \(dsv4 reads type, transformers "
     r"rope_type first\)"),
], ids=["missing", "kv_heads", "rope", "type", "model_type", "block", "architectures", "architectures_str",
        "rope_type_conflict"])
def test_hf_config_errors_name_file_and_key(tmp_path, edit, message):
    p = _edited_flash(tmp_path, edit)
    with pytest.raises(ValueError, match=f"{p}: .*{message}"):
        ModelArgs.from_hf_config(tmp_path)


@pytest.mark.parametrize("text,message", [
    ("LIST", r"top level is a JSON list, expected a JSON object"),
    ('"deepseek_v4"', r"top level is a JSON str, expected a JSON object"),
    ("{", r"not valid JSON"),
], ids=["list", "string", "broken"])
def test_config_file_not_an_object(tmp_path, text, message):
    p = tmp_path / "config.json"
    p.write_text(f"[{FLASH.read_text()}]" if text == "LIST" else text)
    with pytest.raises(ValueError, match=f"^{re.escape(str(p))}: {message}"):
        ModelArgs.from_hf_config(tmp_path)


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(num_attention_heads=60), r"ModelArgs.o_groups=8: expected a divisor of n_heads \(60\)"),
    (lambda c: c.update(compress_ratios=[0, 0, 4]), r"ModelArgs.compress_ratios=.*: expected at least n_layers=43"),
    (lambda c: c.update(quantization_config=[128, 128]), r"key 'quantization_config'=\[128, 128\] has type list"),
    (lambda c: c["rope_scaling"].update(beta_fast="32"), r"key 'rope_scaling.beta_fast'='32' has type str"),
    (lambda c: c["rope_scaling"].update(original_max_position_embeddings=65536.5),
     r"key 'rope_scaling.original_max_position_embeddings'=65536.5 has type float, expected an integer"),
], ids=["model_args", "ratios", "quant_list", "beta_str", "orig_len_fraction"])
def test_model_args_errors_name_the_config_file(tmp_path, edit, message):
    p = _edited_flash(tmp_path, edit)
    with pytest.raises(ValueError, match=f"^{re.escape(str(p))}: {message}"):
        ModelArgs.from_hf_config(p)
    if message.startswith("ModelArgs"):  # a dict has no file to name: ModelArgs' own message, unprefixed
        with pytest.raises(ValueError, match=f"^{message}"):
            ModelArgs.from_hf_config(json.loads(p.read_text()))


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(rms_norm_eps=float("nan")),
     r"ModelArgs.norm_eps=nan: expected a finite positive number \(config.json key 'rms_norm_eps'\)$"),
    (lambda c: c.update(rms_norm_eps=0.0),  # passed as "non-negative", then the first RMSNorm refused it mid-run
     r"ModelArgs.norm_eps=0.0: expected a finite positive number \(config.json key 'rms_norm_eps'\)$"),
    (lambda c: c.update(num_attention_heads=-4),
     r"ModelArgs.n_heads=-4: expected a positive integer \(config.json key 'num_attention_heads'\)$"),
    (lambda c: c["rope_scaling"].update(factor=float("inf")),
     r"ModelArgs.rope_factor=inf: expected a finite positive number \(config.json key 'rope_scaling.factor'\)$"),
    (lambda c: c.update(o_groups=7), r"ModelArgs.o_groups=7: expected a divisor of n_heads \(64\)$"),  # same name
], ids=["nan", "zero_norm_eps", "negative", "nested", "same_name"])
def test_model_args_errors_name_the_config_key(tmp_path, edit, message):
    """A ModelArgs field named differently in config.json (norm_eps / rms_norm_eps) is followed by its key."""
    p = _edited_flash(tmp_path, edit)
    with pytest.raises(ValueError, match=f"^{re.escape(str(p))}: {message}"):
        ModelArgs.from_hf_config(p)
    with pytest.raises(ValueError, match=f"^{message}"):  # from a dict: the same, without a file
        ModelArgs.from_hf_config(json.loads(p.read_text()))


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(num_hidden_layers=4.0), "key 'num_hidden_layers'=4.0 has type float, expected an integer$"),
    (lambda c: c.update(rope_theta="1e4"), "key 'rope_theta'='1e4' has type str, expected a number$"),
    (lambda c: c.update(compress_ratios={"0": 0}), "key 'compress_ratios'={'0': 0} has type dict, expected a "
                                                   "JSON list$"),
], ids=["int", "number", "list"])
def test_wrong_type_names_the_expected_json_type(tmp_path, edit, message):
    """Not Python's `<class 'int'>`: the JSON type the key needs."""
    p = _edited_flash(tmp_path, edit)
    with pytest.raises(ValueError, match=f"^{re.escape(str(p))}: {message}"):
        ModelArgs.from_hf_config(p)


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(num_hidden_layers=0),
     r"ModelArgs.n_layers=0: expected a positive integer \(config.json key 'num_hidden_layers'\)$"),
    (lambda c: c.update(num_nextn_predict_layers=-1),
     r"ModelArgs.n_mtp_layers=-1: expected a non-negative integer \(config.json key 'num_nextn_predict_layers'\)$"),
], ids=["zero_layers", "negative_mtp"])
def test_bad_layer_count_is_not_taken_for_a_later_revision(tmp_path, edit, message):
    """0 main layers (or -1 MTP blocks) made compress_ratios look longer than main + MTP, and the error claimed
    a DSpark re-release; it is a bad value, named as such."""
    p = _edited_flash(tmp_path, edit)
    with pytest.raises(ValueError, match=f"^{re.escape(str(p))}: {message}"):
        ModelArgs.from_hf_config(p)


def test_compress_ratios_without_the_mtp_entry_names_the_file_and_keys(tmp_path):
    """43 entries for 43 main layers + 1 MTP block: the error came from the inventory, naming neither the file
    nor the config.json keys."""
    p = _edited_flash(tmp_path, lambda c: c.update(compress_ratios=c["compress_ratios"][:43]))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(p))}: key 'compress_ratios' has 43 entries, expected 44: "
                                         r"one per main layer \(num_hidden_layers=43\), then one per MTP block "
                                         r"\(num_nextn_predict_layers=1\)$"):
        ModelArgs.from_hf_config(p)


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelArgs.from_hf_config(tmp_path)


# ---------------------------------------------------------------------------------------------- TEST_LAYERS
@pytest.mark.parametrize("raw,want", [(None, 43), ("", 43), ("1", 1), ("10", 10), ("43", 43)])
def test_test_layers_valid(raw, want):
    env = {} if raw is None else {TEST_LAYERS_ENV: raw}
    assert layers_from_env(43, env) == want


@pytest.mark.parametrize("raw", ["0", "-1", "44", "abc", "1.5", "10 layers", "0x3", "1e1",
                                 " 7 ", " 2", "2 ", "+2", "02", "1_0", "\u0662", " "])  # non-canonical forms too
def test_test_layers_invalid(raw):
    with pytest.raises(ValueError, match=rf"TEST_LAYERS={re.escape(repr(raw))}: expected an integer in 1\.\.43"):
        layers_from_env(43, {TEST_LAYERS_ENV: raw})


def test_test_layers_reads_process_environment(monkeypatch):
    monkeypatch.setenv(TEST_LAYERS_ENV, "2")
    assert layers_from_env(4) == 2
    monkeypatch.setenv(TEST_LAYERS_ENV, "5")
    with pytest.raises(ValueError, match="the checkpoint has 4 main layers"):
        layers_from_env(4)


# A key that is absent from config.json may only be read as the released value, or refused by name. Public
# DeepSeek-V4 ports ran the official `ModelArgs` toy defaults when a key was not read or not present
# (n_hash_layers 0, route_scale 1.0, swiglu_limit 0, compress_rope_theta 40000; docs/public_bugs.md); dsv4 had
# the same class in `from_hf_config` (num_hash_layers 0, routed_scaling_factor 1.0, swiglu_limit 0).
# `quantization_config` is the one key whose absence means something else on purpose: a BF16 checkpoint, whose
# tensors the loader then requires to be BF16 (`tests/unit/test_checkpoint.py`).
ABSENCE_HAS_A_MEANING = {"quantization_config"}


@pytest.mark.parametrize("path", [FLASH, PRO], ids=["flash", "pro"])
def test_a_missing_key_is_refused_or_means_the_released_value(path):
    cfg = json.loads(path.read_text())
    full = ModelArgs.from_hf_config(cfg)
    refused, same = [], []
    for key in cfg:
        if key in ABSENCE_HAS_A_MEANING:
            continue
        try:
            got = ModelArgs.from_hf_config({k: v for k, v in cfg.items() if k != key})
        except ValueError as e:
            assert f"missing key {key!r}" in str(e) or key in str(e), f"{key}: the error does not name it: {e}"
            refused.append(key)
            continue
        diff = {f.name: (getattr(full, f.name), getattr(got, f.name)) for f in dataclasses.fields(full)
                if getattr(full, f.name) != getattr(got, f.name)}
        assert not diff, f"config.json without {key!r} silently loads another model: (released, got) {diff}"
        same.append(key)
    # the keys that change the maths are among the refused ones (a default would have to equal the release)
    assert {"num_hash_layers", "routed_scaling_factor", "swiglu_limit", "compress_rope_theta", "rope_theta",
            "hc_sinkhorn_iters", "hc_eps", "index_topk", "sliding_window", "num_nextn_predict_layers"} <= set(refused)
    assert same, "negative control: keys dsv4 does not read (e.g. 'architectures') load the same model"


@pytest.mark.parametrize("key", ["num_hash_layers", "routed_scaling_factor", "swiglu_limit", "scoring_func",
                                 "n_shared_experts", "num_nextn_predict_layers"])
def test_missing_math_key_names_file_key_and_released_value(tmp_path, key):
    p = _edited_flash(tmp_path, lambda c: c.pop(key))
    with pytest.raises(ValueError, match=f"^{re.escape(str(p))}: missing key {key!r} \\(released value"):
        ModelArgs.from_hf_config(p)


# ------------------------------------------------------------------ issue 23 item 3 / issue 28 (one table, bounds)
def test_one_table_drives_from_and_to_hf_config():
    """`HF_CONFIG` is the only config.json <-> ModelArgs mapping: every field but the derived `dtype` has exactly one
    key there, `to_hf_config` writes exactly the table's keys, the message hints and the fixed values come from it."""
    from dsv4.config import FIXED_CONFIG_VALUES, HF_CONFIG, HF_CONFIG_KEYS

    fields = [k.field for k in HF_CONFIG if k.field is not None]
    assert sorted(fields) == sorted({f.name for f in dataclasses.fields(ModelArgs)} - {"dtype"})
    assert HF_CONFIG_KEYS == {k.field: k.key for k in HF_CONFIG if k.field and k.field != k.key}
    assert FIXED_CONFIG_VALUES == {k.key: k.value for k in HF_CONFIG if k.fixed}
    for path in (FLASH, PRO):
        a = ModelArgs.from_hf_config(path)
        cfg = a.to_hf_config()
        written = {k.key for k in HF_CONFIG if k.written and not (k.fp8_only and a.dtype != "fp8")}
        flat = {f"{top}.{sub}" if isinstance(val, dict) else top
                for top, val in cfg.items() for sub in (val if isinstance(val, dict) else [None])}
        assert flat == written
        assert ModelArgs.from_hf_config(cfg) == a
    bf16 = dataclasses.replace(ModelArgs.from_hf_config(FLASH), dtype="bf16", scale_fmt=None, expert_dtype="bf16")
    assert "quantization_config" not in bf16.to_hf_config() and ModelArgs.from_hf_config(bf16.to_hf_config()) == bf16


@pytest.mark.parametrize("field", ["hc_sinkhorn_iters", "window_size", "index_topk", "n_routed_experts"])
def test_values_that_would_hang_or_exhaust_memory_are_bounded(tmp_path, field):
    """`hc_sinkhorn_iters: 1e9` hung, `sliding_window: 1e9` died in new_state's allocator: every field that sizes a
    loop or an allocation but no checkpoint tensor has a named range (`CONFIG_RANGES`), the released values inside."""
    from dsv4.config import CONFIG_RANGES, HF_CONFIG

    lo, hi, why = CONFIG_RANGES[field]
    key = {k.field: k.key for k in HF_CONFIG}[field]
    for path in (FLASH, PRO):
        assert lo <= getattr(ModelArgs.from_hf_config(path), field) <= hi
    assert getattr(ModelArgs.from_hf_config(_edited_flash(tmp_path, lambda c: c.update({key: hi}))), field) == hi
    for bad in (hi + 1, 10**9):
        p = _edited_flash(tmp_path, lambda c: c.update({key: bad}))
        with pytest.raises(ValueError) as e:
            ModelArgs.from_hf_config(p)
        msg = str(e.value)
        assert msg.startswith(f"{p}: ModelArgs.{field}={bad}: expected an integer in {lo}..{hi} ({why})"), msg
        assert field == key or msg.endswith(f"(config.json key {key!r})")
    with pytest.raises(ValueError, match=rf"ModelArgs.{field}=0: expected a positive integer"):
        dataclasses.replace(ModelArgs(), **{field: 0})


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(num_nextn_predict_layers=0),
     r"key 'compress_ratios' has 44 entries, expected 43: one per main layer \(num_hidden_layers=43\), then one per "
     r"MTP block \(num_nextn_predict_layers=0\); the released configs have num_nextn_predict_layers 1 \(one MTP "
     r"block\)$"),
    (lambda c: c.update(num_hidden_layers=42),
     r"key 'compress_ratios' has 44 entries, expected 43: one per main layer \(num_hidden_layers=42\), then one per "
     r"MTP block \(num_nextn_predict_layers=1\)$"),
], ids=["mtp_0", "layers_42"])
def test_an_edited_count_is_a_bad_value_not_a_revision(tmp_path, edit, message):
    """`num_nextn_predict_layers: 0` was reported as "a later revision (DSpark)": a count that no longer fits the
    ratio list is named as the keys that disagree; only the released counts with extra ratios name a revision."""
    from dsv4.config import UnsupportedRevisionError, detect_revision

    p = _edited_flash(tmp_path, edit)
    with pytest.raises(ValueError, match=f"^{re.escape(str(p))}: {message}") as e:
        ModelArgs.from_hf_config(p)
    assert not isinstance(e.value, UnsupportedRevisionError) and "revision" not in str(e.value)
    assert detect_revision(json.loads(p.read_text())) is None


def test_symlink_loops_are_named_as_loops(tmp_path):
    """A symbolic link loop was reported as a missing config.json / checkpoint directory."""
    from dsv4.config import SymlinkLoopError

    loop = tmp_path / "ckpt"
    loop.symlink_to(loop)
    with pytest.raises(SymlinkLoopError, match=rf"^{re.escape(str(loop))}: symbolic link loop") as e:
        ModelArgs.from_hf_config(loop)
    assert isinstance(e.value, FileNotFoundError)  # every handler of a missing checkpoint still handles it
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").symlink_to(d / "config.json")
    with pytest.raises(SymlinkLoopError, match=rf"^{re.escape(str(d / 'config.json'))}: symbolic link loop"):
        ModelArgs.from_hf_config(d)


@pytest.mark.parametrize("value", [10, 1048577, 1048576.5, "1048576"])
def test_max_position_embeddings_must_be_the_context(tmp_path, value):
    """`max_position_embeddings` was accepted with any value and read nowhere (the context is original_seq_len x
    rope_factor): a config saying 10 loaded as a 1M-token model. Now it must equal that context, or be absent.
    Controls: the published value 1048576 (= 65536 x 16) loads, and `to_hf_config` writes each model's own
    context (the tiny one's too, which used to say 1048576; a config with that old value still loads)."""
    p = _edited_flash(tmp_path, lambda c: c.update(max_position_embeddings=value))
    with pytest.raises(ValueError, match=rf"key 'max_position_embeddings'=.*expected 1048576: the context is "
                                         r"rope_scaling.original_max_position_embeddings \(65536\) x "
                                         r"rope_scaling.factor \(16\)"):
        ModelArgs.from_hf_config(p)
    flash = ModelArgs.from_hf_config(_edited_flash(tmp_path, lambda c: None))
    assert flash.max_context == 1048576 == flash.to_hf_config()["max_position_embeddings"]
    from dsv4.tiny import tiny_args
    tiny = tiny_args()
    assert tiny.to_hf_config()["max_position_embeddings"] == tiny.max_context < 1048576
    assert ModelArgs.from_hf_config(tiny.to_hf_config()) == tiny
    old = dict(tiny.to_hf_config(), max_position_embeddings=1048576)  # what dsv4 wrote before: still loads
    assert ModelArgs.from_hf_config(old) == tiny
    with pytest.raises(ValueError, match=rf"max_position_embeddings'=10, expected {tiny.max_context}"):
        ModelArgs.from_hf_config(dict(old, max_position_embeddings=10))


@pytest.mark.parametrize("keys", [{"type": "yarn", "rope_type": "yarn"}, {"rope_type": "yarn"}],
                         ids=["both_agree", "rope_type_only"])
def test_rope_scaling_type_keys_that_agree_load(tmp_path, keys):
    """Control of `rope_type_conflict`: the two spellings agreeing, or transformers' rope_type alone, load."""
    def edit(c):
        c["rope_scaling"].pop("type")
        c["rope_scaling"].update(keys)
    _edited_flash(tmp_path, edit)
    assert ModelArgs.from_hf_config(tmp_path).rope_factor == 16
