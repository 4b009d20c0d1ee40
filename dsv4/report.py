"""Report files (`dsv4 diagnose --json FILE`): written atomically by the run that made them, never over a
checkpoint's files, never left behind by a run that failed.

Rules (`ReportFile`):
* The path is checked before any work (`check_report_path`): not a directory, its directory exists and takes a
  new file (the atomic write needs a temporary file beside it), and it is neither inside the checkpoint
  directory being read nor one of its files: paths are resolved, so a symlink to a checkpoint file, a symlink
  inside the checkpoint pointing elsewhere (a Hugging Face cache snapshot) and a hard link are all refused.
* Every write is atomic: a temporary file in the same directory, flushed and fsync'ed, then `os.replace`; a reader
  sees the old file or the new one, never half of one.
* At the start of the run the file is replaced by an *incomplete* report (`"passed": false`, `"status":
  "incomplete"`), so a report of an earlier run never survives this one, even when this one is killed (SIGKILL,
  out of memory) before it can write anything else.
* A run that fails after the path was given (bad checkpoint, bad environment, an exception, Ctrl-C) replaces it by
  a *failure* report: `"passed": false`, `"status": "failed"`, `"error"` (the message), `"exit_status"`. A
  complete report (`"status": "complete"`) carries the run's verdict as the command computed it.
* Every report has a `"run"` block tying it to its run: a random id, the command line (`argv`, as typed:
  `["dsv4", "diagnose", ...]`, and `command_line`, one shell-quoted string), the process id, start and end
  times (UTC), the exit status; and `"schema_version"` (`SCHEMA_VERSION`), raised whenever a field changes
  meaning or shape (2: environment with build tags / CUDA / GPUs / timestamp, labelled alignment rows).

The exit status a failed run records is the process's (`outcome_of`: the status `dsv4.cli.main` ends the command
with for an exception: 2 for the library's named bad-input errors and for running out of memory, 130 for Ctrl-C,
141 for a closed stdout, 1 for a bug, which propagates as a traceback); never null.

No torch import: the CLI checks the path before torch loads.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import traceback
import uuid
from pathlib import Path
import shlex

__all__ = ["ReportFile", "ReportPathError", "check_report_path", "write_atomically", "SCHEMA_VERSION",
           "set_command_line", "command_line", "EXIT_BUG", "EXIT_BAD_INPUT", "EXIT_INTERRUPTED", "EXIT_BROKEN_PIPE",
           "USER_ERRORS", "is_user_error", "is_out_of_memory", "outcome_of", "release_frames"]

SCHEMA_VERSION = 2
_COMMAND_LINE: list[str] | None = None


def set_command_line(argv: list[str]) -> None:
    """Record the command line of this run as the user typed it (`dsv4.cli.main` calls it with
    `["dsv4", *argv]`); reports carry it."""
    global _COMMAND_LINE
    _COMMAND_LINE = [str(a) for a in argv]


def command_line() -> list[str]:
    """The command line recorded by `set_command_line`, else `sys.argv` (a library caller)."""
    return list(_COMMAND_LINE) if _COMMAND_LINE is not None else list(sys.argv)


class ReportPathError(ValueError):
    """A report path that cannot or must not be written; the message names the option, the path and why."""


def _resolve(p: Path) -> Path:
    return Path(os.path.realpath(p))


def _checkpoint_entries(ckpt: Path):
    """(path, resolved target, is a directory) of every file under the checkpoint directory, and of every symlink
    to a directory in it (not followed further: its target as a whole belongs to the checkpoint)."""
    for root, dirs, files in os.walk(ckpt):
        for name in files:
            p = Path(root) / name
            yield p, _resolve(p), False
        for name in dirs:
            p = Path(root) / name
            if p.is_symlink():
                yield p, _resolve(p), True


def check_report_path(path: Path, ckpt: Path | str | None, option: str = "--json") -> None:
    """Refuse a report path that cannot be written atomically or would be written over the checkpoint `ckpt`
    (a directory; None or a `synth:` source: no files to protect). Creates and removes one temporary file in the
    report's directory (the write test); the target itself is not touched.

    Raises ReportPathError: `path` empty or a directory; its directory missing or not writable; `path` (resolved:
    symlinks followed) inside the resolved checkpoint directory, equal to the resolved target of one of the
    checkpoint's files, or the same file (device and inode) as one of them.
    """
    text = str(path)
    if not text.strip():
        raise ReportPathError(f"{option} {text!r}: expected a non-empty path")
    path = Path(path)
    if path.is_dir():
        raise ReportPathError(f"{option} {text!r} is a directory, expected a file path")
    if not path.parent.is_dir():
        raise ReportPathError(f"{option} {text!r}: directory {str(path.parent)!r} does not exist")
    target = _resolve(path)
    if ckpt is not None and not str(ckpt).startswith("synth:") and Path(ckpt).is_dir():
        root = _resolve(Path(ckpt))
        why = None
        if target == root or root in target.parents:
            why = f"it lies inside the checkpoint directory {str(root)!r}"
        else:
            try:
                st = os.stat(path) if path.exists() else None
            except OSError:
                st = None
            for f, real, is_dir in _checkpoint_entries(Path(ckpt)):
                if real == target or is_dir and real in target.parents:
                    what = "a directory of the checkpoint" if is_dir else "the checkpoint's file"
                    why = f"it is {what} {str(f)!r}" if real == target or not is_dir else \
                        f"it lies inside {what} {str(f)!r}"
                    why += f" (-> {str(real)!r})" if real != f else ""
                    break
                if st is not None and not is_dir:
                    try:
                        fst = os.stat(f)
                    except OSError:
                        continue
                    if (fst.st_dev, fst.st_ino) == (st.st_dev, st.st_ino):
                        why = f"it is the same file (a hard link) as the checkpoint's file {str(f)!r}"
                        break
        if why is not None:
            raise ReportPathError(f"{option} {text!r}: refusing to write the report there: {why}, which this run "
                                  "reads; write the report outside the checkpoint directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=path.parent)
    except OSError as e:
        raise ReportPathError(f"{option} {text!r}: cannot write the report there ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)


def write_atomically(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` through a temporary file in the same directory + fsync + `os.replace`.
    Raises OSError (the temporary file is removed)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class ReportFile:
    """The report file of one run (see the module docstring for the rules).

    `ReportFile(path, command, ckpt)` checks the path (`check_report_path`, raises ReportPathError); `begin()`
    replaces the file by the incomplete report; `write(doc)` writes the complete report (`doc` plus `"status":
    "complete"` and `"run"`); `fail(error, exit_status)` the failure report; `finish(exit_status)` records the exit
    status in the complete report, or writes a failure report if the run wrote none. Writes raise OSError.
    """

    def __init__(self, path: Path, command: str, ckpt: Path | str | None = None, option: str = "--json") -> None:
        check_report_path(Path(path), ckpt, option)
        self.path = Path(path)
        self.command = command

        argv = command_line()
        self.run = {"id": uuid.uuid4().hex, "command": f"dsv4 {command}", "argv": argv,
                    "command_line": shlex.join(argv), "pid": os.getpid(), "started": _now(), "finished": None,
                    "exit_status": None}
        self.doc: dict | None = None
        self.failed = False

    def _write(self, doc: dict) -> None:
        write_atomically(self.path, json.dumps({"schema_version": SCHEMA_VERSION, **doc}, ensure_ascii=False,
                                               indent=1))

    def begin(self) -> None:
        self._write({"passed": False, "status": "incomplete",
                     "error": f"the run that writes this report has not finished (dsv4 {self.command}, pid "
                              f"{self.run['pid']}, started {self.run['started']}); if no run is going on, it was "
                              "killed before it could report", "run": self.run})

    def write(self, doc: dict) -> None:
        full = {**doc, "status": "complete", "run": {**self.run, "finished": _now()}}
        self._write(full)
        self.doc = full  # only once it is on disk: a failed write leaves the run without a complete report

    def fail(self, error: str, exit_status: int | None) -> None:
        self.failed = True
        self.doc = None
        self._write({"passed": False, "status": "failed", "error": error, "exit_status": exit_status,
                     "run": {**self.run, "finished": _now(), "exit_status": exit_status}})

    def finish(self, exit_status: int) -> None:
        if self.failed:
            return
        if self.doc is None:
            self.fail(f"dsv4 {self.command} ended with exit status {exit_status} before writing its report "
                      "(the error is on stderr)", exit_status)
            return
        self.doc["run"]["exit_status"] = exit_status
        self.doc["exit_status"] = exit_status
        self._write(self.doc)


# ---------------------------------------------------------------- the exit status of a run that raised

EXIT_BUG = 1  # an exception `dsv4.cli.main` lets through: Python prints the traceback and exits with 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE

# The library's named bad-input errors (module, class): the input (arguments, environment, checkpoint files, a
# request over a limit) is wrong, not dsv4. Looked up in sys.modules, never imported here (the CLI parses before
# importing torch; a class whose module was never imported cannot have been raised). A plain ValueError /
# RuntimeError is not among them: raised from inside the library it is a bug, and keeps its traceback.
USER_ERRORS = (("dsv4.memory_plan", "LimitError"), ("dsv4.memory_plan", "DeviceMemoryError"),
               ("dsv4.formats", "CheckpointError"), ("dsv4.config", "ModelArgsError"),
               ("dsv4.config", "UnsupportedRevisionError"), ("dsv4.config", "DuplicateKeyError"),
               ("dsv4.config", "SymlinkLoopError"), ("dsv4.config", "NoMTPBlockError"),
               ("dsv4.launch", "LaunchEnvError"), ("dsv4.report", "ReportPathError"),
               ("dsv4.encoding", "EmptyConversationError"))


def is_user_error(e: BaseException) -> bool:
    """True for the library's named bad-input errors (`USER_ERRORS`: a serving limit such as the model's context,
    the memory plan, a checkpoint / config / launch / report-path error): a command ends with its one error line
    and exit status 2, not a traceback."""
    for module, name in USER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(e, cls):
            return True
    return False


def is_out_of_memory(e: BaseException) -> bool:
    """torch's allocator failures: `torch.OutOfMemoryError` (CUDA) and the CPU allocator's RuntimeError."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom is not None and isinstance(e, oom):
        return True
    text = str(e)
    return "DefaultCPUAllocator: can't allocate memory" in text or "CUDA out of memory" in text


def outcome_of(e: BaseException) -> tuple[int, str]:
    """(exit status, message) of a command that raised `e`, as `dsv4.cli.main` ends it: Ctrl-C 130; stdout closed
    by its reader 141; running out of memory (`MemoryError`, torch's allocator errors: `is_out_of_memory`) and the
    library's bad-input errors (`is_user_error`) 2, the message being the text of the error line; `SystemExit` its
    own status; anything else 1 (a bug: `main` lets it through and Python prints the traceback), the message
    `Type: text`. A report of a run that raised records this status (`dsv4.diagnose.run_diagnose`)."""
    if isinstance(e, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted (Ctrl-C)"
    if isinstance(e, BrokenPipeError):
        return EXIT_BROKEN_PIPE, "stdout was closed by its reader"
    if isinstance(e, SystemExit):
        code = e.code
        return (code if isinstance(code, int) else 0 if code is None else 1), f"exit({code!r})"
    if isinstance(e, MemoryError):
        return EXIT_BAD_INPUT, (f"out of memory ({type(e).__name__}{': ' + str(e) if str(e) else ''}); use fewer "
                                "layers (TEST_LAYERS=N), --weights quantized, or a larger device")
    if isinstance(e, RuntimeError) and is_out_of_memory(e):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return EXIT_BAD_INPUT, (f"out of memory: {first}; use fewer layers (TEST_LAYERS=N), --weights quantized, or "
                                "a larger device (dsv4.memory_plan gives the weights' bytes)")
    if is_user_error(e):
        return EXIT_BAD_INPUT, str(e)
    return EXIT_BUG, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def release_frames(e: BaseException) -> None:
    """Before printing the error line for `e`: drop the local variables of the finished frames its traceback (and
    those of its causes and contexts) holds. A progress bar still open in a suspended generator of those frames
    (rich's `track` over a load that raised) is then finished at once, before the error line, instead of being
    drawn after it when the exception is finally released. Never raises."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        try:
            traceback.clear_frames(e.__traceback__)
        except Exception:  # a frame that cannot be cleared keeps its bar; the error line still comes
            pass
        e = e.__cause__ or e.__context__
