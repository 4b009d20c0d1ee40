"""The `dsv4` command line: `diagnose` (the main job), `generate`, `make-tiny`, `make-checkpoint`, `gate`.

Arguments are parsed strictly: unknown arguments, abbreviations, stray positionals and an option given twice
(`--prompt a --prompt b`: argparse would keep the last silently; also `--thinking --no-thinking`) are errors,
never swallowed; a stray `NAME=value` argument (such as `TEST_LAYERS=10` typed after the command) is named as an
environment variable with the right spelling (`TEST_LAYERS=10 dsv4 diagnose`). `TEST_LAYERS` and `DSV4_CKPT`
are read from the environment only. Arguments are checked before torch is imported (an argument error comes
back at once), and the runtime checks that need no weights (`--device cuda` without a GPU, `--backend triton`
where it cannot run) come before any weight is read. Every error line reads `dsv4 COMMAND: error: ...` on
stderr; exit status 0 = pass / allowed, 2 = bad input, 3 = hard stop / blocked, 4 = inconclusive (diagnose: a
decisive test could not decide; not a pass), 141 = stdout closed by its
reader (`| head -1`: the command ends quietly, no traceback, as a writer killed by SIGPIPE would), 130 = Ctrl-C
(one line, no traceback; a report file gets its failure report, an interrupted make-tiny / make-checkpoint
directory has no index). Running out of memory is a named error (exit 2), not an allocator traceback, and so is
every named bad-input error of the library (`dsv4.report.is_user_error`: a request over the model's context, a
checkpoint or config error, ...); only a bug shows a traceback (exit status 1). Limits that depend on the
checkpoint (the prompt + `generate --max-tokens` against the model's context) are checked once its config and
tokenizer are read, before any weight is read or generated (`diagnose` checks its own lengths the same way,
`dsv4.diagnose.check_lengths`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import importlib.util
import math
import os
import re
import sys
from pathlib import Path

from dsv4 import __version__  # dsv4/__init__.py imports nothing
from dsv4.report import (EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, is_out_of_memory,  # no torch
                         outcome_of, release_frames, set_command_line)

DEFAULT_PROMPT = "What is the capital of France?"
DEFAULT_CONTINUE_TOKENS = 32  # = dsv4.diagnose.DEFAULT_CONTINUE_TOKENS (not imported: it would import torch)
EXIT_CODES = ("exit status: 0 = pass (diagnose) / allowed (gate) / done; 2 = bad input (arguments, environment, "
              "missing or invalid checkpoint files, a request over a limit such as the model's context, git errors; "
              "checked before any work where it can be); 3 = hard stop (diagnose: a decisive test failed) / "
              "blocked (gate); 4 = inconclusive (diagnose: no decisive test failed, but one could not decide on this "
              "input, e.g. tolerances that would also pass a model without a final norm: not a pass); 141 = stdout "
              "was closed by its reader (e.g. `| head -1`): the command stops quietly, "
              "as a shell reports a writer ended by SIGPIPE; 130 = interrupted (Ctrl-C): one line on stderr, "
              "nothing half-written; 1 = a bug in dsv4 (a traceback)")
ENVIRONMENT = ("environment: DSV4_CKPT = default checkpoint directory; TEST_LAYERS = load and run only the first N "
               "main layers (a canonical integer 1..n_layers); TRITON_INTERPRET=1 = run the triton backend on CPU "
               "(tests); RANK, WORLD_SIZE, LOCAL_RANK = set by torchrun (all three consistent, or none)")
_ENV_ARG = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def _positive_int(text: str) -> int:
    try:
        v = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} is not >= 1")
    return v


def _speculative(text: str) -> int:
    try:
        v = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= v <= 7:
        raise argparse.ArgumentTypeError(f"{v} is not in 0..7 (drafts per verify step; 0 = off)")
    return v


TEMPERATURE_MIN = 1e-5  # = dsv4.generate.TEMPERATURE_MIN (not imported: it would import torch)


def _temperature(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v >= 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number >= 0")
    if 0 < v < TEMPERATURE_MIN:
        raise argparse.ArgumentTypeError(f"{text!r} is below {TEMPERATURE_MIN} (the smallest sampling temperature; "
                                         "the official code clamps it silently): use 0 for greedy")
    return v


def _shard_gb(text: str) -> float:
    """--shard-gb: a finite size in GB of at least one byte (1e-9; a smaller one rounds to a 0-byte limit)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(v) and v * 1e9 >= 1):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite size in GB >= 1e-9 (one byte)")
    return v


def _device(text: str) -> str:
    """Syntax only (no torch import while parsing); whether CUDA is there is checked by `_check_runtime`."""
    if not re.fullmatch(r"cpu|cuda(:(0|[1-9][0-9]*))?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device dsv4 runs on (expected cpu, cuda or "
                                         "cuda:N)")
    return text


def _path(text: str) -> Path:
    """A non-empty path (`Path("")` would silently mean the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected a non-empty path")
    return Path(text)


def _json_out(text: str) -> Path:
    """The syntax of a report path (non-empty, not a directory, in a directory that exists). Where it may be
    written (a new file can be made beside it; not inside or over the checkpoint being read) is checked by
    `_check_report_path` once the checkpoint is known, before any work; the file itself is not touched."""
    p = _path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, expected a file path")
    if not p.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: directory {str(p.parent)!r} does not exist")
    return p


SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 64-bit seeds


def _seed(text: str) -> int:
    try:
        v = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= v <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"{v} is outside 0..2**64-1 (a 64-bit seed)")
    return v


def _text(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("the prompt is not valid UTF-8 text") from None
    return text


def _prompt(text: str) -> str:
    if not _text(text).strip():
        raise argparse.ArgumentTypeError("expected a non-empty prompt text (an empty or blank user message is "
                                         "almost always an unset shell variable)")
    return text


def _expect(text: str) -> str:
    if not _text(text).strip():
        raise argparse.ArgumentTypeError("expected a non-empty answer text (an empty one is in every continuation)")
    return text


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=_device, default="cpu", help="torch device: cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="bf16 = the official numerics (default); fp32 = exact mode")
    p.add_argument("--backend", choices=("reference", "triton"), default="reference",
                   help="hot-path implementation: reference = plain torch (default); triton = the kernels "
                        "(needs --device cuda, or TRITON_INTERPRET=1 on CPU)")
    p.add_argument("--weights", choices=("dequantized", "quantized"), default="dequantized",
                   help="dequantized = FP8/FP4 weights held in --dtype (default); quantized = kept as on disk and "
                        "dequantized per use (needed for Pro)")
    p.add_argument("--batch-invariant", action="store_true", default=False,
                   help="batch-invariant mode (issue 25): a request's decode logits bitwise independent of its "
                        "batch and neighbours; needs --backend triton --dtype bf16 --weights quantized, world "
                        "size 1 (README 'Batch-invariant mode')")
    think = p.add_mutually_exclusive_group()
    think.add_argument("--thinking", dest="thinking", action="store_true", default=True,
                       help="thinking mode (default, as DeepSeek's API): the prompt ends in <think>")
    think.add_argument("--no-thinking", dest="thinking", action="store_false",
                       help="chat mode: the prompt ends in </think>")


def _subparser(sub, name: str, help: str, description: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, allow_abbrev=False, help=help, description=description,
                          epilog=f"{EXIT_CODES}\n{ENVIRONMENT}", formatter_class=argparse.RawDescriptionHelpFormatter)


# help for options whose definition lines stay as they are (kept apart so additions to them merge cleanly)
_OPTION_HELP = {
    ("make-tiny", "out_dir"): "directory to write (created if missing; must be empty: make-tiny never overwrites)",
    ("make-tiny", "variant"): "fp8 = FP8 weights + FP4 experts with ue8m0 scales, as released (default); "
                              "bf16 = unquantized",
    ("make-tiny", "seed"): "seed of the random weights (default 0; same seed, same bytes)",
}


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (exposed for tests). Every option carries a help text; `--help` of each
    command lists the exit codes and the environment variables."""

    p = argparse.ArgumentParser(prog="dsv4", allow_abbrev=False,
                                description="DeepSeek-V4 inference people can trust.",
                                epilog=f"{EXIT_CODES}\n{ENVIRONMENT}",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"dsv4 {__version__}",
                   help="print the dsv4 version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = _subparser(sub, "diagnose", help="run both decisive tests (prompt format, final norm) and print the report",
                   description="Test 1: the hand-rolled prompt vs the official format (token-id diff, greedy "
                               "continuations with a loop measure, the verdict); Test 2: the final norm runs and "
                               "the logits are invariant to the residual's magnitude.")
    d.add_argument("--ckpt", type=_path, default=None,
                   help="checkpoint directory, or synth:GEOMETRY[:LAYERS[:SEED]] (synthetic weights generated on "
                        "load, e.g. synth:pro:61; docs/multi_gpu.md) (default: $DSV4_CKPT, else a tiny checkpoint "
                        "built on the fly)")
    d.add_argument("--prompt", type=_prompt, default=DEFAULT_PROMPT, help=f"user prompt (default: {DEFAULT_PROMPT!r})")
    d.add_argument("--decode-steps", type=_positive_int, default=2, help="Test 2: decode steps after prefill (>= 1, "
                   "default 2)")
    d.add_argument("--json", type=_json_out, default=None, metavar="FILE", help="also write the report as JSON")
    d.add_argument("--continue-tokens", type=_positive_int, default=DEFAULT_CONTINUE_TOKENS, metavar="N",
                   help=f"Test 1: greedy continuation length for both prompts (>= 1, default "
                        f"{DEFAULT_CONTINUE_TOKENS}; stops early at EOS)")
    d.add_argument("--expect", type=_expect, default=None, metavar="TEXT",
                   help="Test 1: the answer the prompt should produce (e.g. Paris); the report says whether each "
                        "continuation contains it (case-insensitive)")
    _model_options(d)

    g = _subparser(sub, "generate", help="generate a completion for one user prompt",
                   description="Stream a completion to stdout (through the official prompt format), then the parsed "
                               "message, or the partial result when --max-tokens cut it, on stderr.")
    g.add_argument("--ckpt", type=_path, default=None, help="checkpoint directory, or synth:GEOMETRY[:LAYERS[:SEED]] "
                   "(synthetic weights generated on load) (default: $DSV4_CKPT)")
    g.add_argument("--prompt", type=_prompt, required=True, help="user prompt text")
    g.add_argument("--max-tokens", type=_positive_int, default=64,
                   help="stop after N generated tokens (>= 1, default 64) if no EOS came before")
    g.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy (default)")
    g.add_argument("--seed", type=_seed, default=0, help="sampling seed (temperature > 0)")
    g.add_argument("--speculative", type=_speculative, default=0, metavar="K",
                   help="speculative decoding with K drafts per verify step from the checkpoint's MTP block "
                        "(1..7; 0 = off, default): greedy at temperature 0, lossless speculative sampling above "
                        "(seeded by --seed); reports the accepted drafts per step and the mean accepted length")
    _model_options(g)

    t = _subparser(sub, "make-tiny",
                   help="write a tiny random DeepSeek-V4 checkpoint in the official on-disk layout",
                   description="Write a ~40 MB random checkpoint in the official layout (config.json, index, "
                               "shards, real tokenizer files) with every feature at tiny width.")
    t.add_argument("out_dir", type=_path)
    t.add_argument("--variant", choices=("fp8", "bf16"), default="fp8")
    t.add_argument("--seed", type=_seed, default=0)

    mc = _subparser(sub, "make-checkpoint",
                    help="write a random checkpoint at the released Flash/Pro geometry (or tiny), first N layers, "
                         "in the official on-disk layout, streamed shard by shard",
                    description="Write a synthetic checkpoint at the published Flash/Pro geometry (first N main "
                                "layers + embed, head, hc_head, MTP) as index + shards in the official formats; "
                                "values are a function of (seed, tensor name) only.")
    mc.add_argument("out_dir", type=_path, help="directory to write (created if missing)")
    mc.add_argument("--geometry", choices=("tiny", "flash", "pro"), default="flash",
                    help="published config to follow (fixtures/configs; default flash)")
    mc.add_argument("--layers", type=_positive_int, default=None,
                    help="keep the first N main layers (default: all; Flash 4 = SWA, SWA, CSA, HCA, ~20 GB)")
    mc.add_argument("--seed", type=_seed, default=0, help="values are a function of (seed, tensor name) only")
    mc.add_argument("--device", type=_device, default=None,
                    help="where values are generated (default cuda when visible, else cpu); same bytes either way")
    mc.add_argument("--no-mtp", dest="mtp", action="store_false", help="leave out the MTP block (mtp.0.*)")
    mc.add_argument("--shard-gb", type=_shard_gb, default=4.0,
                    help="largest shard in GB (default 4.0; a tensor larger than this gets a shard of its own, "
                         "and the build says so)")
    mc.add_argument("--dry-run", action="store_true",
                    help="write index, configs and every shard's header; tensor data left as holes (no disk used)")

    gt = _subparser(sub, "gate", help="merge gate: block protected changes without a green hard-stop run",
                    description="List the files changed since the merge base with --base; if a protected one "
                                "changed, require a green hard-stop run for the current commit.\n\n"
                                "The hard-stop run is `TRITON_INTERPRET=1 pytest -m hardstop tests/unit` (CPU): "
                                "1,274 tests at 7431f87 (1,040 of them measured 9 min 12 s wall / 8 min 55 s CPU in "
                                "one process on a 2-core machine); this command runs it in min(2, CPUs) processes over whole test files "
                                "(DSV4_GATE_JOBS=N to choose): 4 min 47 s there (README, \"The merge gate\"). It checks every kernel and fast path "
                                "against its reference, the bf16 triton backend with quantized weights per call "
                                "(tests/unit/test_bf16_backend.py) and the decode step a CUDA graph captures, run eagerly.\n"
                                "GPU hard stops are not run by this command: run `pytest tests/gpu -m hardstop` on "
                                "a CUDA machine before merging a kernel change (kernels at real sizes, every "
                                "GEMV_TUNED entry, the tensor-core paths, graph capture + replay vs eager; files: "
                                "test_attention_kernels, test_fp32_linear, test_gemm_moe_kernels, test_graph_decode, "
                                "test_kernel_edges, test_kernel_launchers, test_mhc_kernels, test_model_backends, "
                                "test_topk_kernels, test_final_norm, test_router_kernel, test_batch_invariant, "
                                "test_speculative).")
    gt.add_argument("--base", required=True, help="git ref the change is compared against")
    gt.add_argument("--report", type=_path, default=None,
                    help="pytest-json-report file of a hard-stop run (default: run the hard-stop tests now)")
    for name, parser in sub.choices.items():
        for action in parser._actions:
            if action.help is None:
                action.help = _OPTION_HELP.get((name, action.dest))
            _once(action)
    p.dsv4_subparsers = dict(sub.choices)
    return p


_SEEN = "_dsv4_options_given"  # namespace attribute: {dest: the option string that set it}, removed by parse_args
_REPEATABLE = (argparse._AppendAction, argparse._AppendConstAction, argparse._CountAction, argparse._HelpAction,
               argparse._VersionAction)


def _once(action: argparse.Action) -> None:
    """Make the option `action` an error when given twice (argparse keeps the last value silently: `--prompt a
    --prompt b` ran on b). Options sharing a destination (`--thinking` / `--no-thinking`) count as one option.
    Options meant to repeat (append / count actions) and positionals are left as they are."""
    if not action.option_strings or isinstance(action, _REPEATABLE):
        return
    base = type(action)

    class _Once(base):
        def __call__(self, parser, namespace, values, option_string=None):
            seen = namespace.__dict__.setdefault(_SEEN, {})
            if self.dest in seen:
                first = seen[self.dest]
                again = "given twice" if first == option_string else f"given after {first} (the same setting)"
                why = ("a flag: once is enough" if self.nargs == 0 else
                       "argparse would keep the last value silently")
                parser.error(f"argument {option_string}: {again}; give it once ({why})")
            seen[self.dest] = option_string
            super().__call__(parser, namespace, values, option_string)

    _Once.__name__ = f"Once{base.__name__}"
    action.__class__ = _Once


def _env_hint(arg: str, command: str | None) -> str:
    return (f"{arg!r} is an environment variable, not an argument: put it before the command, "
            f"`{arg} dsv4 {command or 'COMMAND'}` (TEST_LAYERS and DSV4_CKPT are read from the environment only)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse `argv` strictly (see the module docstring), without importing torch. On an error prints usage and
    `dsv4 COMMAND: error: ...` to stderr and raises SystemExit(2)."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and _ENV_ARG.match(argv[0]):
        command = next((a for a in argv if a in parser.dsv4_subparsers), None)
        (parser.dsv4_subparsers[command] if command else parser).error(_env_hint(argv[0], command))
    args, extra = parser.parse_known_args(argv)
    vars(args).pop(_SEEN, None)  # the repeated-option bookkeeping of `_once`
    if extra:
        sub = parser.dsv4_subparsers[args.command]
        env = [a for a in extra if _ENV_ARG.match(a)]
        sub.error(_env_hint(env[0], args.command) if env else f"unrecognized arguments: {' '.join(extra)}")
    return args


def _check_runtime(args: argparse.Namespace) -> str | None:
    """What makes the chosen --device / --backend unusable here, checked before any weight is read; None if fine."""
    device, backend = getattr(args, "device", None), getattr(args, "backend", None)
    if device is None:
        return None
    if getattr(args, "batch_invariant", False) and (backend, args.dtype, args.weights) != ("triton", "bf16",
                                                                                        "quantized"):
        return (f"--batch-invariant needs --backend triton --dtype bf16 --weights quantized (got --backend {backend} "
                f"--dtype {args.dtype} --weights {args.weights}): the reference backend and the fp32 / dequantized "
                "linears run cuBLAS, whose summation order follows the batch")
    if backend == "triton":

        if importlib.util.find_spec("triton") is None:
            return ("--backend triton: the triton package is not installed (pip install 'dsv4[triton]'); "
                    "or use --backend reference")
        if not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
            return (f"--backend triton needs --device cuda (got --device {device}); on CPU the kernels run only "
                    "in the interpreter, with TRITON_INTERPRET=1 in the environment. Use --backend reference on CPU")
    if device.startswith("cuda"):
        import torch  # the CLI parses before importing torch

        if not torch.cuda.is_available():
            return f"--device {device}: no CUDA device is visible on this machine (use --device cpu)"
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            return f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible"
    return None


# commands that read RANK / WORLD_SIZE / LOCAL_RANK (torchrun launches): checked before any work
_LAUNCH_COMMANDS = ("diagnose", "generate")


def _check_launch(args: argparse.Namespace) -> str | None:
    """An inconsistent RANK / WORLD_SIZE / LOCAL_RANK (`dsv4.launch.launch_from_env`) for a command that reads
    them; None if fine (or the command does not read them)."""
    if args.command not in _LAUNCH_COMMANDS:
        return None
    from dsv4.launch import LaunchEnvError, launch_from_env  # the CLI parses before importing torch

    try:
        launch_from_env()
    except LaunchEnvError as e:
        return str(e)
    return None


def _check_report_path(args: argparse.Namespace) -> str | None:
    """A report file (`--json`) that cannot be written atomically beside itself, or would be written inside or
    over the checkpoint this run reads (`--ckpt`, else $DSV4_CKPT; paths resolved, symlinks and hard links
    included: `dsv4.report.check_report_path`); None if fine."""
    path = getattr(args, "json", None)
    if path is None:
        return None
    from dsv4.report import ReportPathError, check_report_path  # the CLI parses before importing torch

    ckpt = args.ckpt if args.ckpt is not None else (Path(os.environ["DSV4_CKPT"]) if os.environ.get("DSV4_CKPT")
                                                    else None)
    try:
        check_report_path(path, ckpt, option="argument --json:")
    except ReportPathError as e:
        return str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dsv4` console script; returns the process exit status (see EXIT_CODES).

    An exception that reaches here ends the command as `dsv4.report.outcome_of` says: a bad-input error of the
    library (a limit, a checkpoint, config or launch error: `dsv4.report.is_user_error`) or running out of memory
    is one line `dsv4 COMMAND: error: ...` and exit status 2, Ctrl-C one line and 130, a closed stdout 141
    quietly; anything else is a bug and propagates (a traceback, exit status 1). Before the line, a progress bar
    the failed step left open is finished (`dsv4.report.release_frames`), so nothing is drawn after the error
    line."""
    argv = sys.argv[1:] if argv is None else list(argv)
    set_command_line(["dsv4", *argv])  # what reports record as the command line
    args = parse_args(argv)
    problem = _check_launch(args) or _check_report_path(args) or _check_runtime(args)
    if problem is not None:
        build_parser().dsv4_subparsers[args.command].error(problem)
    try:
        with contextlib.redirect_stderr(_BarsEndBeforeErrors(sys.stderr, args.command)):
            rc = _check_generate(args) if args.command == "generate" else None
            if rc is None:
                rc = _dispatch(args)
        sys.stdout.flush()  # a reader that left shows up here at the latest
        return rc
    except BrokenPipeError:  # `dsv4 make-checkpoint ... | head -1`: the reader has what it wanted
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt as e:  # Ctrl-C: one line, no traceback (reports and output directories see to themselves)
        release_frames(e)
        _end_line()
        print(f"dsv4 {args.command}: interrupted (Ctrl-C){_interrupted_note(args)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        status, message = outcome_of(e)
        if status != EXIT_BAD_INPUT:  # a bug: the traceback says where
            raise
        release_frames(e)
        print(f"dsv4 {args.command}: error: {message}", file=sys.stderr)
        return status
    finally:
        _close_process_group()


class _BarsEndBeforeErrors:
    """stderr while a command runs: an error line `dsv4 COMMAND: error: ...` written while an exception is being
    handled (the library's `except ...: print(error line)`) first gets that exception's frames released
    (`release_frames`), so a progress bar the failed step left open is finished before the line instead of being
    drawn after it (`loading ... 2%` below the error). Everything else passes through unchanged."""

    def __init__(self, stream, command: str) -> None:
        self._stream, self._prefix = stream, f"dsv4 {command}: error: "

    def write(self, s: str) -> int:
        if s.startswith(self._prefix):
            handling = sys.exc_info()[1]
            if handling is not None:
                release_frames(handling)
        return self._stream.write(s)

    def __getattr__(self, name):  # flush, isatty, fileno, encoding ... of the real stream
        return getattr(self._stream, name)


def _check_generate(args: argparse.Namespace) -> int | None:
    """`dsv4 generate`, before any weight is read or generated: the prompt (tokenized through the official format,
    with the checkpoint's tokenizer) + --max-tokens (+ k + 1 with --speculative K) must fit the model's context
    (`dsv4.memory_plan.check_context`, the rule of `dsv4.generate.generate` and of the speculative decoders).
    Returns 2 after the one error line when it does not (or the checkpoint, its config, TEST_LAYERS or the
    tokenizer is unusable: the same line `run_generate` would print after loading); None to go on. For a synthetic
    source it also says on stderr what is generated, and that it is slow on CPU."""
    from dsv4.config import layers_from_env  # the CLI parses before importing torch
    from dsv4.diagnose import synthesis_note  # the CLI parses before importing torch
    from dsv4.encoding import prompt_ids  # the CLI parses before importing torch
    from dsv4.generate import resolve_ckpt  # the CLI parses before importing torch
    from dsv4.launch import launch_from_env  # the CLI parses before importing torch
    from dsv4.memory_plan import check_context, check_fits  # the CLI parses before importing torch
    from dsv4.model import STATE_GRAIN  # the CLI parses before importing torch
    from dsv4.synth import checkpoint_args, is_synth_source, tokenizer_folder  # the CLI parses before importing torch
    from dsv4.tokenizer import load_tokenizer  # the CLI parses before importing torch

    try:
        path = resolve_ckpt(args.ckpt)
        if path is None:  # run_generate names the missing checkpoint
            return None
        full = checkpoint_args(path)
        tok = load_tokenizer(tokenizer_folder(path))
        log = logging.getLogger("dsv4.encoding")
        was = log.disabled
        log.disabled = True  # the special-string warning comes once, from generate's own prompt_ids
        try:
            ids = prompt_ids(tok, [{"role": "user", "content": args.prompt}], thinking=args.thinking)
        finally:
            log.disabled = was
        if args.speculative:
            k = args.speculative
            check_context(full, prompt_tokens=len(ids), value=args.max_tokens, option="--max-tokens",
                          overhead=k + 1, overhead_why=f"one verify step of k + 1 tokens, --speculative {k}",
                          grain=STATE_GRAIN)
        else:
            check_context(full, prompt_tokens=len(ids), value=args.max_tokens, option="--max-tokens")
        if is_synth_source(path):  # every value is computed on load: say what, and that it is slow on CPU
            n, mtp = layers_from_env(full.n_layers), args.speculative > 0
            dtype_bytes = {"bf16": 2, "fp32": 4}[args.dtype]
            if not launch_from_env().distributed:  # a load that cannot fit is refused before the note
                check_fits(full, n, device=args.device, dtype_bytes=dtype_bytes, weights=args.weights,
                           include_mtp=mtp)
            note = synthesis_note(path, n, device=args.device, dtype_bytes=dtype_bytes, weights=args.weights,
                                  include_mtp=mtp)
            print(f"dsv4 generate: {note}", file=sys.stderr, flush=True)
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as e:  # LimitError, and what run_generate reports
        if isinstance(e, RuntimeError) and is_out_of_memory(e):
            raise
        release_frames(e)
        print(f"dsv4 generate: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return None


def _end_line() -> None:
    """After Ctrl-C in the middle of a streamed line (generate's tokens, a progress bar): end it."""
    try:
        sys.stdout.write("\n")
        sys.stdout.flush()
    except (OSError, ValueError):
        pass


def _interrupted_note(args: argparse.Namespace) -> str:
    """What an interrupted command left behind, for its one line."""
    if args.command in ("make-tiny", "make-checkpoint") and getattr(args, "fresh_out_dir", False):
        return (f": {args.out_dir} is incomplete and has no index, so it does not open as a checkpoint; remove it "
                "and run again")
    if getattr(args, "json", None) is not None:
        return f": {args.json} holds a failure report (\"status\": \"failed\")"
    return ""


def _fresh_dir(out_dir: Path) -> bool:
    """True if `out_dir` is missing or empty: a build may remove files there (never in a directory it found full)."""
    try:
        return not Path(out_dir).exists() or (Path(out_dir).is_dir() and not any(Path(out_dir).iterdir()))
    except OSError:
        return False


def _remove_index(out_dir: Path, fresh: bool) -> None:
    """An interrupted build into a directory that was empty (`fresh`): remove its index (written last by
    make-checkpoint, first of the small files by make-tiny), so a half-built directory never opens as a
    checkpoint and no half-written index stays behind."""
    from dsv4.checkpoint import INDEX_FILE  # the CLI parses before importing torch

    if not fresh:
        return
    try:
        (Path(out_dir) / INDEX_FILE).unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        print(f"dsv4: warning: could not remove {Path(out_dir) / INDEX_FILE} ({e})", file=sys.stderr)


def _stdout_to_devnull() -> None:
    """After a BrokenPipeError on stdout: point its file descriptor at /dev/null, so that the interpreter's flush
    at exit does not fail a second time ("Exception ignored ... BrokenPipeError"); the recipe of Python's `signal`
    documentation ("Note on SIGPIPE"). Without a real descriptor (stdout replaced in-process) nothing to do."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _close_process_group() -> None:
    """Under torchrun, leave the process group cleanly (`dsv4.parallel.leave_process_group`)."""
    if "torch.distributed" not in sys.modules:  # never initialised; do not import torch just to check
        return
    from dsv4.parallel import leave_process_group  # the CLI parses before importing torch

    leave_process_group()


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "diagnose":
        from dsv4.diagnose import run_diagnose  # the CLI parses before importing torch
        return run_diagnose(ckpt=args.ckpt, prompt=args.prompt, decode_steps=args.decode_steps,
                            json_path=args.json, thinking=args.thinking, device=args.device,
                            dtype=args.dtype, backend=args.backend, weights=args.weights,
                            continue_tokens=args.continue_tokens, expect=args.expect,
                            batch_invariant=args.batch_invariant)
    if args.command == "generate":
        from dsv4.generate import run_generate  # the CLI parses before importing torch
        return run_generate(ckpt=args.ckpt, prompt=args.prompt, max_tokens=args.max_tokens,
                            temperature=args.temperature, thinking=args.thinking, seed=args.seed,
                            device=args.device, dtype=args.dtype, backend=args.backend, weights=args.weights,
                            speculative=args.speculative, batch_invariant=args.batch_invariant)
    if args.command == "make-tiny":
        from dsv4.tiny import make_tiny  # the CLI parses before importing torch
        fresh = args.fresh_out_dir = _fresh_dir(args.out_dir)
        try:
            out = make_tiny(args.out_dir, variant=args.variant, seed=args.seed)
        except KeyboardInterrupt:
            _remove_index(args.out_dir, fresh)
            raise
        except BrokenPipeError:
            raise
        except (OSError, ValueError) as e:
            release_frames(e)
            print(f"dsv4 make-tiny: error: {e}", file=sys.stderr)
            return 2
        print(f"wrote tiny DeepSeek-V4 checkpoint ({args.variant}) to {out}")
        return 0
    if args.command == "make-checkpoint":
        return _make_checkpoint(args)
    if args.command == "gate":
        from dsv4.gate import run_gate  # the CLI parses before importing torch
        return run_gate(base=args.base, report=args.report)
    raise AssertionError(args.command)  # argparse enforces the choices


def _make_checkpoint(args: argparse.Namespace) -> int:
    """`dsv4 make-checkpoint`: exit 0 written, 2 bad input / not enough disk / write error (message on stderr)."""
    import torch  # the CLI parses before importing torch

    from dsv4.synth import make_checkpoint  # the CLI parses before importing torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    fresh = args.fresh_out_dir = _fresh_dir(args.out_dir)
    try:
        make_checkpoint(args.out_dir, args.geometry, args.layers, seed=args.seed, include_mtp=args.mtp,
                        device=device, dry_run=args.dry_run, max_shard_bytes=int(args.shard_gb * 1e9))
    except KeyboardInterrupt:
        _remove_index(args.out_dir, fresh)
        raise
    except BrokenPipeError:  # stdout (the progress lines) closed by its reader: `main` ends quietly
        raise
    except (OSError, ValueError) as e:
        release_frames(e)
        print(f"dsv4 make-checkpoint: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
