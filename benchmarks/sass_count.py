"""Instruction mix of a kernel's main loop, from its SASS, on a machine without a GPU (issue 27).

Compiles `kernels.targets` specs for one target with the divisibility-16 specialization a real launch gets for its
pointers and for the i32 arguments named in `--div` (Triton's `tt.divisibility` attribute; without it the loads
are byte-wise and the codegen is not a real launch's), disassembles the cubin with Triton's bundled `cuobjdump
-sass`, and counts the instructions of each loop (a backward branch and its target), by opcode.

    TRITON_INTERPRET= python benchmarks/sass_count.py "moe._moe_up_gemv_kernel" --cap 90 --div D,I,E
    TRITON_INTERPRET= python benchmarks/sass_count.py "moe._moe_up_gemv_kernel[codes]" --const DEC=1

Prints, per kernel: its registers a thread (`cuobjdump -res-usage`); per loop: instructions per iteration and the
10 most frequent opcodes. Divide by the weights a thread handles per iteration (the kernel's block shape /
threads) for instructions per weight. Must run without TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sass_of(name: str, cap: int, div: list[str], const: dict | None = None) -> str:
    """SASS text of the `kernels.targets` spec `name` compiled for sm_`cap` (pointers and `div` args 16-aligned),
    with the constexprs in `const` replacing the spec's (e.g. {"DEC": 1}), followed by `cuobjdump -res-usage`'s
    resource lines (REG:n registers a thread, shared memory)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernels import targets

    specs = {s[0]: s for s in targets._specs()}
    if name not in specs:
        raise SystemExit(f"sass_count: no spec {name!r} in kernels.targets (known: {', '.join(sorted(specs))})")
    _, fn, ptrs, floats, consts = specs[name]
    consts = targets.constexprs(fn, {**consts, **(const or {})})
    sig = targets.signature(fn, ptrs, floats, consts)
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names) if arg in ptrs or arg in div}
    cc = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=dict(consts), attrs=attrs),
                        target=GPUTarget("cuda", cap, 32))
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cc.asm["cubin"])
    try:
        sass = subprocess.run([str(tool), "-sass", f.name], check=True, capture_output=True, text=True).stdout
        res = subprocess.run([str(tool), "-res-usage", f.name], check=True, capture_output=True, text=True).stdout
        return sass + "\n" + res  # the resource line: "REG:96 STACK:0 SHARED:... " (registers a thread)
    finally:
        os.unlink(f.name)


def loops(sass: str) -> list[tuple[str, collections.Counter]]:
    """(address range, opcode counts) of every loop: the instructions from a backward branch's target address to
    the branch (cuobjdump prints absolute addresses, not labels). Nested loops are reported each."""
    instrs = []
    for ln in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);", ln)
        if m:
            instrs.append((int(m.group(1), 16), m.group(3), m.group(4)))
    out = []
    for addr, op, rest in instrs:
        m = re.match(r"(0x[0-9a-f]+)", rest.strip()) if op.startswith("BRA") else None
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            body = [o for a, o, _ in instrs if lo <= a <= addr]
            out.append((f"{lo:#x}-{addr:#x}", collections.Counter(o.split(".")[0] for o in body)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="+", help="kernels.targets spec names")
    ap.add_argument("--cap", type=int, default=90)
    ap.add_argument("--div", default="D,I,E,KH,N,K", help="i32 arguments taken as multiples of 16")
    ap.add_argument("--const", default="", help="constexpr overrides, e.g. DEC=1,BN=32 (ints)")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("sass_count: unset TRITON_INTERPRET (the interpreter cannot compile)")
    for name in a.names:
        const = {k: int(v) for k, v in (kv.split("=") for kv in a.const.split(",") if kv)}
        sass = sass_of(name, a.cap, a.div.split(","), const)
        regs = re.search(r"REG:(\d+)", sass)
        print(f"{name} sm_{a.cap}: {regs.group(1) if regs else '?'} registers a thread")
        for label, cnt in loops(sass):
            top = ", ".join(f"{op} {n}" for op, n in cnt.most_common(10))
            print(f"{name} sm_{a.cap} loop {label}: {sum(cnt.values())} instructions per iteration; {top}")


if __name__ == "__main__":
    main()
