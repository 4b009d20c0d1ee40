"""Who this process is in a torchrun launch: RANK / WORLD_SIZE / LOCAL_RANK, read and checked in one place.

torchrun sets the three together (plus others dsv4 does not read). A process without any of them is a single
process (rank 0 of 1). Everything else is one named error, `LaunchEnvError`, raised by `launch_from_env` before
any work, for every command that reads them (`dsv4 diagnose`, `dsv4 generate`; the CLI checks first, the library
entry points `run_diagnose` / `run_generate`, `dsv4.generate.load_model` and `dsv4.parallel.comm_from_env` read
through the same function):

* a partial set: RANK or LOCAL_RANK without WORLD_SIZE (a stray `RANK=1` once made every output of `diagnose`
  and `generate` vanish: the process took itself for a non-zero rank and printed nothing, exit 0), or WORLD_SIZE
  without RANK / LOCAL_RANK;
* a value that is not a canonical decimal integer (`" 1"`, `+1`, `01`, `1_0`, `1.0`, `one`, non-ASCII digits);
* WORLD_SIZE < 1; RANK >= WORLD_SIZE (e.g. WORLD_SIZE=1 with RANK=1); LOCAL_RANK > RANK (the local rank is the
  rank within a node, so it never exceeds the global rank).

An empty value counts as unset (as for TEST_LAYERS). No torch import: the CLI runs this before torch loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

__all__ = ["Launch", "LaunchEnvError", "launch_from_env", "LAUNCH_VARS"]

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


class LaunchEnvError(ValueError):
    """RANK / WORLD_SIZE / LOCAL_RANK are inconsistent or malformed; the message names the variables, their
    values and what was expected."""


@dataclass(frozen=True)
class Launch:
    """rank in [0, world_size), local_rank <= rank; `distributed` = world_size > 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0


def _canonical(raw: str) -> bool:
    return raw.isascii() and raw.isdigit() and str(int(raw)) == raw


def launch_from_env(environ: Mapping[str, str] | None = None) -> Launch:
    """The launch described by RANK / WORLD_SIZE / LOCAL_RANK in `environ` (default `os.environ`).

    None of them set (or all empty): `Launch()` (rank 0 of 1). Otherwise all three must be set, canonical
    non-negative decimal integers, WORLD_SIZE >= 1, RANK < WORLD_SIZE and LOCAL_RANK <= RANK.
    Raises LaunchEnvError naming every variable and value involved (the message quotes all three as found).
    """
    env = os.environ if environ is None else environ
    raw = {k: env.get(k, "") for k in LAUNCH_VARS}
    found = ", ".join(f"{k}={v!r}" if v != "" else f"{k} unset" for k, v in raw.items())
    if not any(raw.values()):
        return Launch()

    def bad(why: str) -> LaunchEnvError:
        return LaunchEnvError(f"inconsistent torchrun launch environment ({found}): {why}. torchrun sets RANK, "
                              "WORLD_SIZE and LOCAL_RANK together; for a single process leave all three unset")

    missing = [k for k, v in raw.items() if v == ""]
    if missing:
        given = [k for k in LAUNCH_VARS if k not in missing]
        raise bad(f"{' and '.join(given)} set without {' and '.join(missing)}")
    for k, v in raw.items():
        if not _canonical(v):
            raise bad(f"${k}={v!r} is not a canonical non-negative decimal integer (no spaces, sign, leading "
                      "zeros, underscores or decimal point)")
    rank, ws, local = (int(raw[k]) for k in LAUNCH_VARS)
    if ws < 1:
        raise bad(f"WORLD_SIZE={ws}: expected >= 1")
    if rank >= ws:
        raise bad(f"RANK={rank} is not below WORLD_SIZE={ws} (expected RANK in 0..{ws - 1})")
    if local > rank:
        raise bad(f"LOCAL_RANK={local} is greater than RANK={rank} (the rank within a node never exceeds the "
                  "global rank)")
    return Launch(rank, ws, local)
