"""Running a program a model wrote (HumanEval completions) in a separate, limited process.

What it guarantees, as nanochat's `nanochat/execution.py` (karpathy/nanochat 92d63d4, after OpenAI's human-eval
`execution.py`) does, and more:
- a fresh interpreter in its own process and session (`python -I -B`: no environment-driven imports, no user site,
  no bytecode written), killed with its whole process group when the time limit passes and once it ends, so nothing
  it started outlives it (nanochat kills the child only, on timeout only);
- memory: `RLIMIT_AS` and `RLIMIT_DATA` (256 MiB by default, nanochat's), `RLIMIT_FSIZE` (no file it writes grows
  past 16 MiB), `RLIMIT_CORE` 0 (no core dump);
- a scrubbed environment (`PATH=/usr/bin:/bin`, `HOME` and `TMPDIR` in its working directory, one OpenMP thread),
  no standard input, a temporary working directory deleted afterwards;
- standard output and error go to files capped by `RLIMIT_FSIZE`, of which the first 64 KiB are read back (nanochat
  keeps everything in memory, so a printing loop could fill the evaluating process);
- before the program runs, the functions that destroy things by accident are replaced by ones that raise: process
  control (`os.kill`, `os.system`, `os.fork`, the `exec*`/`spawn*`/`posix_spawn*` family, `subprocess.Popen`), file
  removal and permission changes (`os.remove`, `os.unlink`, `os.rmdir`, `os.rename`, `os.chmod`, `shutil.rmtree`,
  `shutil.move`, ...), `os.chdir`, and opening a file for writing outside the working directory (`open`, `io.open`,
  `os.open`);
- it succeeds when the process exits with status 0 (nanochat's rule: a program that exits with status 0 before its
  tests run counts as passed, as there).

It is NOT a security sandbox: the guards are Python attributes that code can restore (`ctypes`, `importlib.reload`,
`gc`), the network is not blocked, and there is no kernel isolation (no seccomp, namespaces or containers). It keeps
the usual accidents of generated code (deleting files, looping, eating memory, forking) away from the host; run code
from an adversary only inside a container or VM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TIMEOUT_S = 5.0  # nanochat execute_code's default
DEFAULT_MAX_MEMORY_BYTES = 256 * 1024 * 1024  # nanochat execute_code's default
MAX_FILE_BYTES = 16 * 1024 * 1024
OUTPUT_READ_BYTES = 64 * 1024

# Runs in the child before the program: limits, then guards (written for hfl3; the names cover nanochat's list)
_GUARD = r"""
import builtins, faulthandler, io, os, resource, shutil, subprocess, sys
_limit = {max_memory_bytes}
if _limit is not None:
    for _name in ("RLIMIT_AS", "RLIMIT_DATA"):
        resource.setrlimit(getattr(resource, _name), (_limit, _limit))
resource.setrlimit(resource.RLIMIT_FSIZE, ({max_file_bytes}, {max_file_bytes}))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
faulthandler.disable()
_home = os.path.realpath(os.getcwd())

def _refused(name):
    def refused(*args, **kwargs):
        raise PermissionError(name + " is disabled while evaluating generated code")
    return refused

def _inside(path):
    if isinstance(path, int):
        return True
    target = os.path.realpath(os.fsdecode(path))
    return target == _home or target.startswith(_home + os.sep)

_open, _os_open = builtins.open, os.open

def _guarded_open(file, mode="r", *args, **kwargs):
    if any(flag in mode for flag in "wax+") and not _inside(file):
        raise PermissionError(f"writing {{file!r}} outside the working directory is disabled")
    return _open(file, mode, *args, **kwargs)

def _guarded_os_open(path, flags, *args, **kwargs):
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    if flags & writing and not _inside(path):
        raise PermissionError(f"writing {{path!r}} outside the working directory is disabled")
    return _os_open(path, flags, *args, **kwargs)

builtins.open = io.open = _guarded_open
os.open = _guarded_os_open
for _name in ("kill", "killpg", "system", "popen", "fork", "forkpty", "putenv", "unsetenv", "remove", "removedirs",
              "rmdir", "unlink", "rename", "renames", "replace", "truncate", "ftruncate", "chmod", "fchmod", "lchmod",
              "chown", "fchown", "lchown", "lchflags", "chflags", "chroot", "chdir", "fchdir", "setuid", "setgid",
              "seteuid", "setegid", "setsid", "setpgid", "link", "symlink", "mkfifo", "mknod", "posix_spawn",
              "posix_spawnp", "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
              "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe"):
    if hasattr(os, _name):
        setattr(os, _name, _refused("os." + _name))
for _name in ("rmtree", "move", "chown", "copytree", "copy", "copy2", "copyfile"):
    setattr(shutil, _name, _refused("shutil." + _name))
subprocess.Popen = _refused("subprocess.Popen")
for _name in ("exit", "quit", "help"):
    setattr(builtins, _name, None)
for _name in ("ipdb", "joblib", "psutil", "tkinter", "resource"):
    sys.modules[_name] = None
del _name
"""


@dataclass
class ExecutionResult:
    """How a program ran: `success` (exit status 0 within the time limit), `returncode` (None when killed at the
    limit), the first `OUTPUT_READ_BYTES` of `stdout` and `stderr`, `error` (the last line of standard error, e.g.
    `AssertionError`, or why it was killed), `timeout`, `memory_exceeded` (a `MemoryError` was raised), `seconds`."""

    success: bool
    returncode: int | None
    stdout: str
    stderr: str
    error: str | None = None
    timeout: bool = False
    memory_exceeded: bool = False
    seconds: float = 0.0


def scrubbed_environment(workdir: str | os.PathLike) -> dict[str, str]:
    """The whole environment the program sees: nothing of the evaluating process's (tokens, paths, proxies)."""
    return {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1"}


def run_python(program: str, timeout: float = DEFAULT_TIMEOUT_S,
               max_memory_bytes: int | None = DEFAULT_MAX_MEMORY_BYTES) -> ExecutionResult:
    """Run the Python source `program` in a separate, limited process (see the module docstring) and wait for it.

    Args:
        program: the source to run as `__main__`, with fresh globals.
        timeout: seconds of wall-clock time before the process group is killed.
        max_memory_bytes: its address-space limit (None: none).

    Returns:
        The `ExecutionResult`; a program that fails, loops or runs out of memory is a result, never an exception.
    """
    import time

    guard = _GUARD.format(max_memory_bytes=max_memory_bytes, max_file_bytes=MAX_FILE_BYTES)
    runner = guard + f"\nexec(compile({program!r}, '<generated>', 'exec'), {{'__name__': '__main__'}})\n"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hfl3_exec_", ignore_cleanup_errors=True) as root:
        workdir = Path(root) / "work"
        workdir.mkdir()
        out_path, err_path = Path(root) / "stdout", Path(root) / "stderr"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            process = subprocess.Popen([sys.executable, "-I", "-B", "-c", runner], cwd=workdir,
                                       env=scrubbed_environment(workdir), stdin=subprocess.DEVNULL, stdout=out,
                                       stderr=err, start_new_session=True)
            timed_out = False
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(process)
        stdout, stderr = _read_start(out_path), _read_start(err_path)
    seconds = time.perf_counter() - started
    if timed_out:
        return ExecutionResult(False, None, stdout, stderr, f"timed out after {timeout:g} s (process group killed)",
                               timeout=True, seconds=seconds)
    success = process.returncode == 0
    error = None
    if not success:
        lines = stderr.strip().splitlines()
        error = lines[-1] if lines else f"exit status {process.returncode}"
    return ExecutionResult(success, process.returncode, stdout, stderr, error,
                           memory_exceeded="MemoryError" in stderr, seconds=seconds)


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the program's session (it and anything it started), then reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _read_start(path: Path) -> str:
    with open(path, "rb") as f:
        return f.read(OUTPUT_READ_BYTES).decode("utf-8", errors="replace")
