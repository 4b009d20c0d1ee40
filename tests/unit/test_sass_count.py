"""benchmarks/sass_count.py: the loop finder that RESULTS.md's instruction counts come from (a backward branch and
its target, by address; a forward branch is no loop)."""
import importlib.util
from pathlib import Path

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                     /* 0x00000a0000017a02 */
        /*0010*/                   LDG.E.U8 R2, desc[UR4][R4.64] ;            /* 0x0000000404027981 */
        /*0020*/              @!P0 BRA 0x80 ;                                 /* 0x0000005000008947 */
        /*0030*/                   IMAD.SHL.U32 R3, R2, 0x4, RZ ;             /* 0x0000000402037824 */
        /*0040*/                   LOP3.LUT R3, R3, 0x1c001c0, RZ, 0xc0, !PT ; /* 0x01c001c003037812 */
        /*0050*/                   FFMA R6, R3, R7, R6 ;                      /* 0x0000000703067223 */
        /*0060*/               @P1 BRA 0x30 ;                                 /* 0xfffffffc00c41947 */
        /*0070*/                   STG.E desc[UR4][R8.64], R6 ;               /* 0x0000000608007986 */
        /*0080*/                   EXIT ;                                     /* 0x000000000000794d */
"""


def _tool():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "sass_count.py"
    spec = importlib.util.spec_from_file_location("sass_count", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_loops_counts_the_body_of_a_backward_branch_only():
    found = _tool().loops(SASS)
    assert len(found) == 1, found  # the forward @!P0 BRA 0x80 is not a loop
    label, cnt = found[0]
    assert label == "0x30-0x60"
    assert dict(cnt) == {"IMAD": 1, "LOP3": 1, "FFMA": 1, "BRA": 1}
