"""The `dsv4` command line: `diagnose` (the main job), `generate`, `make-tiny`, `gate`.

Arguments are parsed strictly: unknown arguments, abbreviations and stray positionals (such as a
`TEST_LAYERS=10` typed after the command) are errors, never swallowed. `TEST_LAYERS` is read from the
environment only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_PROMPT = "What is the capital of France?"


def _positive_int(text: str) -> int:
    try:
        v = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} is not >= 1")
    return v


def _temperature(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (v >= 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number >= 0")
    return v


def _device(text: str) -> str:
    import torch

    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device is visible on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a cpu or cuda device")
    return text


def _json_out(text: str) -> Path:
    p = Path(text)
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, expected a file path")
    if not p.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: directory {str(p.parent)!r} does not exist")
    return p


def _text(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("the prompt is not valid UTF-8 text") from None
    return text


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=_device, default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="bf16 = the official numerics (default); fp32 = exact mode")
    p.add_argument("--backend", choices=("reference", "triton"), default="reference",
                   help="hot-path implementation (triton needs CUDA)")
    p.add_argument("--weights", choices=("dequantized", "quantized"), default="dequantized",
                   help="hold FP8/FP4 weights dequantized, or as on disk and dequantize per use")
    think = p.add_mutually_exclusive_group()
    think.add_argument("--thinking", dest="thinking", action="store_true", default=True,
                       help="thinking mode (default, as DeepSeek's API): the prompt ends in <think>")
    think.add_argument("--no-thinking", dest="thinking", action="store_false",
                       help="chat mode: the prompt ends in </think>")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (exposed for tests)."""
    p = argparse.ArgumentParser(prog="dsv4", allow_abbrev=False,
                                description="DeepSeek-V4 inference people can trust.",
                                epilog="Environment: DSV4_CKPT (default checkpoint directory), "
                                       "TEST_LAYERS (load only the first N main layers).")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("diagnose", allow_abbrev=False,
                       help="run both decisive tests (prompt format, final norm) and print the report")
    d.add_argument("--ckpt", type=Path, default=None,
                   help="checkpoint directory (default: $DSV4_CKPT, else a tiny checkpoint built on the fly)")
    d.add_argument("--prompt", type=_text, default=DEFAULT_PROMPT, help=f"user prompt (default: {DEFAULT_PROMPT!r})")
    d.add_argument("--decode-steps", type=_positive_int, default=2, help="decode steps after prefill (>= 1)")
    d.add_argument("--json", type=_json_out, default=None, metavar="FILE", help="also write the report as JSON")
    _model_options(d)

    g = sub.add_parser("generate", allow_abbrev=False, help="generate a completion for one user prompt")
    g.add_argument("--ckpt", type=Path, default=None, help="checkpoint directory (default: $DSV4_CKPT)")
    g.add_argument("--prompt", type=_text, required=True, help="user prompt text")
    g.add_argument("--max-tokens", type=_positive_int, default=64)
    g.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy (default)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    _model_options(g)

    t = sub.add_parser("make-tiny", allow_abbrev=False,
                       help="write a tiny random DeepSeek-V4 checkpoint in the official on-disk layout")
    t.add_argument("out_dir", type=Path)
    t.add_argument("--variant", choices=("fp8", "bf16"), default="fp8")
    t.add_argument("--seed", type=int, default=0)

    mc = sub.add_parser("make-checkpoint", allow_abbrev=False,
                        help="write a random checkpoint at the released Flash/Pro geometry (or tiny), first N layers, "
                             "in the official on-disk layout, streamed shard by shard")
    mc.add_argument("out_dir", type=Path)
    mc.add_argument("--geometry", choices=("tiny", "flash", "pro"), default="flash",
                    help="published config to follow (fixtures/configs; default flash)")
    mc.add_argument("--layers", type=_positive_int, default=None,
                    help="keep the first N main layers (default: all; Flash 4 = SWA, SWA, CSA, HCA, ~20 GB)")
    mc.add_argument("--seed", type=int, default=0, help="values are a function of (seed, tensor name) only")
    mc.add_argument("--device", type=_device, default=None,
                    help="where values are generated (default cuda when visible, else cpu); same bytes either way")
    mc.add_argument("--no-mtp", dest="mtp", action="store_false", help="leave out the MTP block (mtp.0.*)")
    mc.add_argument("--shard-gb", type=float, default=4.0, help="largest shard in GB (default 4.0)")
    mc.add_argument("--dry-run", action="store_true",
                    help="write index, configs and every shard's header; tensor data left as holes (no disk used)")

    gt = sub.add_parser("gate", allow_abbrev=False,
                        help="merge gate: block protected changes without a green hard-stop run")
    gt.add_argument("--base", required=True, help="git ref the change is compared against")
    gt.add_argument("--report", type=Path, default=None,
                    help="pytest-json-report file of a hard-stop run (default: run the hard-stop tests now)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dsv4` console script; returns the process exit status."""
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    finally:
        _close_process_group()


def _close_process_group() -> None:
    """Under torchrun, leave the process group cleanly (a live gloo/NCCL group at interpreter exit aborts
    the process with "terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "diagnose":
        from dsv4.diagnose import run_diagnose
        return run_diagnose(ckpt=args.ckpt, prompt=args.prompt, decode_steps=args.decode_steps,
                            json_path=args.json, thinking=args.thinking, device=args.device,
                            dtype=args.dtype, backend=args.backend, weights=args.weights)
    if args.command == "generate":
        from dsv4.generate import run_generate
        return run_generate(ckpt=args.ckpt, prompt=args.prompt, max_tokens=args.max_tokens,
                            temperature=args.temperature, thinking=args.thinking, seed=args.seed,
                            device=args.device, dtype=args.dtype, backend=args.backend, weights=args.weights)
    if args.command == "make-tiny":
        from dsv4.tiny import make_tiny
        try:
            out = make_tiny(args.out_dir, variant=args.variant, seed=args.seed)
        except (OSError, ValueError) as e:
            print(f"dsv4 make-tiny: error: {e}", file=sys.stderr)
            return 2
        print(f"wrote tiny DeepSeek-V4 checkpoint ({args.variant}) to {out}")
        return 0
    if args.command == "make-checkpoint":
        return _make_checkpoint(args)
    if args.command == "gate":
        from dsv4.gate import run_gate
        return run_gate(base=args.base, report=args.report)
    raise AssertionError(args.command)  # argparse enforces the choices


def _make_checkpoint(args: argparse.Namespace) -> int:
    """`dsv4 make-checkpoint`: exit 0 written, 2 bad input / not enough disk / write error (message on stderr)."""
    import torch

    from dsv4.synth import make_checkpoint

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not (args.shard_gb > 0 and args.shard_gb != float("inf")):
        print(f"dsv4 make-checkpoint: error: --shard-gb {args.shard_gb}: expected a finite number > 0",
              file=sys.stderr)
        return 2
    try:
        make_checkpoint(args.out_dir, args.geometry, args.layers, seed=args.seed, include_mtp=args.mtp,
                        device=device, dry_run=args.dry_run, max_shard_bytes=int(args.shard_gb * 1e9))
    except (OSError, ValueError) as e:
        print(f"dsv4 make-checkpoint: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
