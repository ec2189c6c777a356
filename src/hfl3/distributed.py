"""Runs across machines: what one process computes for all reaches every rank through the process group, files reach
global rank 0's disk (and come back from it), and a lost rank is named. Nothing here assumes that the machines share
a filesystem: where they do, file transfers find nothing to move.

- `rank`, `world_size`, `machine_rank`: where this process is (torchrun's `GROUP_RANK` is the machine, as accelerate
  launches it with `--machine_rank`).
- `on_all_ranks(fn)`: every rank runs `fn`; when one raises, every rank raises the same error, naming where it
  happened, so no rank is left waiting in the next collective (a check that fails on one machine only).
- `from_main(fn)`: global rank 0 runs `fn`, every rank returns its result or raises its error
  (`torch.distributed.broadcast_object_list`).
- `check_same_on_all_ranks(value, what, fix)`: refuse a value (arguments, a data fingerprint) that differs between
  ranks.
- `main_writes(path)`: global rank 0 writes a file or folder, and every rank reads it at the same path.
- `separate_disks(folder)`: which ranks do not see global rank 0's `folder` (a probe file), one writer per machine.
- `gather_files_to_main(folder, disks)`: what the other machines wrote into their `folder`, moved into rank 0's.
- `checkpoint_on_this_machine(checkpoint, copies)`: rank 0's checkpoint, copied to the machines that lack it;
  `broadcast_model_from_main(model)`: rank 0's weights on every rank.
- `lost_peer_message(error)`: for an error of the process group, the ranks that no longer answer (the launcher's
  rendezvous store), as one line; None when every rank still answers.
- `end_distributed_run()`: how every multi-process entry point ends once its work is done (exit 0 on every rank,
  outputs flushed, no teardown race with gloo's threads).

Files travel in `CHUNK_BYTES` pieces (`broadcast_object_list`), so memory stays bounded; every rank takes part in each
transfer (a broadcast), which is cheap for the state files of a checkpoint and costs one pass of a checkpoint's size
per resume on a machine without rank 0's disk. Sources: torch.distributed's object collectives; torchrun's
environment (`GROUP_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`; its static rendezvous hosts the store on
machine 0's launcher).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import os
import re
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch.distributed as dist

from hfl3.atomic import atomic_path

CHUNK_BYTES = 64 << 20
"""Bytes per broadcast when a file travels."""
HASHED_BYTES = 1 << 20
"""Files up to this size are identified by their sha256 in a folder's manifest, larger ones by their size."""
ANSWER_WAIT_S = 5.0
"""Seconds the surviving ranks wait for each other's answer before naming the ranks that gave none."""
_PROBE = ".hfl3_probe_{}"
_ERRORS = {error.__name__: error for error in (ValueError, TypeError, KeyError, OSError, FileNotFoundError,
                                               FileExistsError, PermissionError, NotADirectoryError, RuntimeError)}
# What gloo says when a peer process is gone or does not answer within the collective timeout (torch's own
# process-group errors are `torch.distributed.DistError`s)
_PEER_FAILURE = re.compile(r"gloo/transport|Connection closed by peer|Connection reset by peer|Timed out waiting")


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def machine_rank() -> int:
    """This process's machine: torchrun's `GROUP_RANK` (`accelerate launch --machine_rank`), 0 without a launcher."""
    return int(os.environ.get("GROUP_RANK", "0"))


def machine_of(global_rank: int) -> int:
    """The machine of `global_rank`: torchrun numbers the ranks machine by machine, `LOCAL_WORLD_SIZE` each."""
    return global_rank // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def where(global_rank: int) -> str:
    return f"machine {machine_of(global_rank)}, rank {global_rank}"


def _broadcast(value: Any, source: int = 0) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=source)
    return box[0]


def _all_gather(value: Any) -> list:
    values = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


def _outcome(fn: Callable[[], Any]) -> tuple:
    try:
        return True, fn(), None
    except Exception as error:  # travels to the other ranks, which raise it too
        kind = type(error)  # hfl3's own subclass of a built-in error travels as itself (pickled by its name)
        own = kind.__module__.startswith("hfl3.") and "<locals>" not in kind.__qualname__ and issubclass(
            kind, tuple(_ERRORS.values()))
        return False, None, (kind.__name__, str(error), kind if own else None)


def _raise(error: tuple, suffix: str = "") -> None:
    name, message, own = error
    kind = own or _ERRORS.get(name)
    raise (kind(message + suffix) if kind else RuntimeError(f"{name}: {message}{suffix}"))


def on_all_ranks(fn: Callable[[], Any]) -> list:
    """Run `fn` on every rank and return every rank's result, in rank order (`[fn()]` without a process group).

    Raises:
        The first failing rank's error, on every rank, with its own type when it is a built-in one (`ValueError`,
        `OSError`, ...) or hfl3's own subclass of one (`PlanError`), else `RuntimeError`, and its message;
        ` (on machine M, rank R)` is added when not every rank failed the same way.
    """
    if not initialized():
        return [fn()]
    ok, value, error = _outcome(fn)
    outcomes = _all_gather((ok, value, error))
    failed = [(number, outcome[2]) for number, outcome in enumerate(outcomes) if not outcome[0]]
    if failed:
        number, first = failed[0]
        same = len(failed) == len(outcomes) and all(message == first for _, message in failed)
        _raise(first, "" if same else f" (on {where(number)})")
    return [outcome[1] for outcome in outcomes]


def from_main(fn: Callable[[], Any]) -> Any:
    """Run `fn` on global rank 0 only and return its result on every rank (`fn()` without a process group); the
    result must pickle.

    Raises:
        What `fn` raised on rank 0, on every rank (types as `on_all_ranks`).
    """
    if not initialized():
        return fn()
    outcome = _outcome(fn) if rank() == 0 else None
    ok, value, error = _broadcast(outcome)
    if not ok:
        _raise(error)
    return value


def check_same_on_all_ranks(value: Any, what: str, fix: str) -> None:
    """Refuse a `value` (JSON-like) that is not the same on every rank.

    Raises:
        ValueError: on every rank, naming the first rank whose `what` differs from rank 0's, what differs
            (for dicts: the keys, with both values) and `fix`.
    """
    values = on_all_ranks(lambda: value)
    for number, other in enumerate(values):
        if other != values[0]:
            if isinstance(other, dict) and isinstance(values[0], dict):
                keys = sorted(k for k in values[0].keys() | other.keys() if values[0].get(k) != other.get(k))
                shown = "; ".join(f"{k}: {str(values[0].get(k))[:60]} vs {str(other.get(k))[:60]}" for k in keys[:4])
            else:
                shown = f"{str(values[0])[:60]} vs {str(other)[:60]}"
            raise ValueError(f"{what} differs between machine 0 (rank 0) and {where(number)}: {shown}; {fix}")


@contextlib.contextmanager
def main_writes(path: str | os.PathLike) -> Iterator[bool]:
    """`with main_writes(path) as writing: if writing: <write the file or folder path>`: global rank 0 writes `path`
    in the block, the other ranks skip it; after the block every rank can read `path`. Ranks that see rank 0's disk
    read its copy (the end of the block is a barrier of every rank); on a machine that does not, one rank receives a
    copy at the same path through the process group (`separate_disks`). An error raised in the block is raised on
    every rank."""
    path = Path(path)
    if not initialized():
        yield True
        return
    raised = None
    try:
        yield rank() == 0
    except Exception as error:  # raised on every rank below, after the others learn of it
        raised = error

    def reraise():
        if raised is not None:
            raise raised

    on_all_ranks(reraise)
    disks = separate_disks(path.parent)
    if disks.writers:
        root = path if from_main(path.is_dir) else path.parent
        names = (_files(root) if root == path else [path.name]) if rank() == 0 else None
        _transfer(0, names, root, root, write=rank() in disks.writers)
        dist.barrier()  # the other ranks of a machine read what its writer wrote


@dataclass(frozen=True)
class SeparateDisks:
    """Which ranks do not see global rank 0's folder. `writers`: one rank per such machine (its lowest), which writes
    and removes that machine's copies; `here`: whether this rank's folder is another than rank 0's."""

    writers: tuple[int, ...] = ()
    here: bool = False


def separate_disks(folder: str | os.PathLike) -> SeparateDisks:
    """Probe whether each rank sees global rank 0's `folder`: rank 0 writes a file of a random name into it (creating
    the folder), every rank looks for it, rank 0 removes it (and the folders it created). A collective."""
    if not initialized():
        return SeparateDisks()
    folder = Path(folder).absolute()

    def write_probe() -> tuple[str, list[str]]:
        created = [str(p) for p in (folder, *folder.parents) if not p.exists()]
        token = secrets.token_hex(8)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / _PROBE.format(token)).touch()
        return token, created

    token, created = from_main(write_probe)
    seen = on_all_ranks(lambda: ((folder / _PROBE.format(token)).is_file(), machine_rank()))
    if rank() == 0:
        (folder / _PROBE.format(token)).unlink()
        for path in sorted(created, key=len, reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(path)
    writers = {}
    for number, (visible, machine) in enumerate(seen):
        if not visible:
            writers.setdefault(machine, number)
    return SeparateDisks(tuple(sorted(writers.values())), not seen[rank()][0])


def gather_files_to_main(folder: str | os.PathLike, disks: SeparateDisks, stop: str | os.PathLike) -> None:
    """Move the files that the ranks of other disks wrote into their `folder` into global rank 0's `folder` (rank 0's
    own files of the same name are kept), then remove those copies and their empty parents up to `stop`. A
    collective; nothing moves when every rank shares rank 0's disk."""
    if not initialized() or not disks.writers:
        return
    folder = Path(folder)
    listings = _all_gather(_files(folder) if rank() in disks.writers else None)
    for source in disks.writers:
        _transfer(source, listings[source], folder, folder, write=rank() == 0)
    if rank() in disks.writers:
        shutil.rmtree(folder, ignore_errors=True)
        remove_empty_parents(folder, stop)
    dist.barrier()


def remove_empty_parents(folder: str | os.PathLike, stop: str | os.PathLike) -> None:
    """Remove `folder`'s parents while they are empty, up to and including `stop`."""
    stop = Path(stop).absolute()
    for parent in Path(folder).absolute().parents:
        if not parent.is_relative_to(stop):
            break
        with contextlib.suppress(OSError):
            parent.rmdir()


def manifest(folder: str | os.PathLike) -> dict[str, list] | None:
    """What identifies a folder's content: per file (relative path) its size, and the sha256 of files up to
    `HASHED_BYTES` (a checkpoint's `trainer_state.json` and `hfl3_run.json` differ between runs); None when `folder`
    is not a folder."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    out = {}
    for name in _files(folder):
        path = folder / name
        size = path.stat().st_size
        out[name] = [size, hashlib.sha256(path.read_bytes()).hexdigest() if size <= HASHED_BYTES else None]
    return out


def checkpoint_on_this_machine(checkpoint: str | None, copies: str | os.PathLike) -> str | None:
    """Global rank 0's `checkpoint` folder, where this rank can read it: the same path when it holds the same files
    (a shared filesystem, or machine 0), else a copy that rank 0 sends into `copies/<name>` (written by one rank per
    machine that needs it; a copy already there with the same files is reused). A collective; None for None."""
    if not initialized() or checkpoint is None:
        return checkpoint
    expected = from_main(lambda: manifest(checkpoint))
    copy = Path(copies) / Path(checkpoint).name
    local = next((str(path) for path in (Path(checkpoint), copy) if manifest(path) == expected), None)
    needs = _all_gather(machine_rank() if local is None else None)
    writers = {}
    for number, machine in enumerate(needs):
        if machine is not None:
            writers.setdefault(machine, number)
    if writers:
        if rank() in writers.values():
            shutil.rmtree(copy, ignore_errors=True)
        _transfer(0, _files(Path(checkpoint)) if rank() == 0 else None, Path(checkpoint), copy,
                  write=rank() in writers.values())
        dist.barrier()  # the other ranks of a machine read what its writer wrote
    return local or str(copy)


def broadcast_model_from_main(model) -> None:
    """Give every rank global rank 0's parameters and buffers (`model.state_dict()`, in place; a replicated model,
    as under DDP). A collective."""
    if initialized():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, 0)


def _files(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())


def _transfer(source: int, names: list[str] | None, source_folder: Path, target: Path, write: bool) -> None:
    """Rank `source` sends `names` (files of its `source_folder`) to every rank; ranks with `write` store them in
    `target` (each file atomically), keeping a file that is there already when `target` is `source_folder`."""
    names = _broadcast(names, source)
    for name in names:
        reader = open(source_folder / name, "rb") if rank() == source else None
        try:
            size = _broadcast(os.fstat(reader.fileno()).st_size if reader else None, source)
            keep = write and target == source_folder and (target / name).exists()
            with atomic_path(target / name) if write and not keep else contextlib.nullcontext() as temporary:
                writer = open(temporary, "wb") if temporary else None
                try:
                    for _ in range(max(1, -(-size // CHUNK_BYTES))):
                        chunk = _broadcast(reader.read(CHUNK_BYTES) if reader else None, source)
                        if writer:
                            writer.write(chunk)
                finally:
                    if writer:
                        writer.close()
        finally:
            if reader:
                reader.close()


def lost_peer_message(error: BaseException, wait_s: float = ANSWER_WAIT_S) -> str | None:
    """For an `error` of the process group (a peer closed the connection or a collective timed out), one line naming
    the ranks that no longer answer, or None (not such an error, or every rank still answers: not a lost peer).

    Every surviving rank writes its number into the rendezvous store of the launcher (`MASTER_ADDR:MASTER_PORT`) and
    waits up to `wait_s` seconds for the others'. A store that does not answer is machine 0's launcher gone."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if not (isinstance(error, dist.DistError) or _PEER_FAILURE.search(str(error))):
        return None
    ranks, me = dist.get_world_size(), dist.get_rank()
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        lost = "a rank (no launcher store to ask which)"
    else:
        lost = _unanswered(ranks, me, wait_s)
        if lost is None:
            return None
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (f"lost {lost}: no answer within {wait_s:g} s after the process group failed on rank {me} "
            f"({first_line[:160]}); the run stopped. Restart every machine with --resume_from_checkpoint latest "
            "to continue from the newest complete checkpoint")


def _unanswered(ranks: int, me: int, wait_s: float) -> str | None:
    """The ranks that do not write their number into the launcher's store within `wait_s` seconds, as words; None
    when all do. A store that does not answer is machine 0's launcher gone."""
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=wait_s), wait_for_workers=False)
        prefix = f"hfl3/answering/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        store.set(f"{prefix}{me}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [other for other in range(ranks) if not store.check([f"{prefix}{other}"])]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    except (ValueError, RuntimeError, OSError):  # the store is gone with machine 0's launcher
        return f"machine 0 (its launcher's rendezvous store at {address} does not answer)"
    if not missing:
        return None
    machines = sorted({machine_of(number) for number in missing})
    return (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} (machine"
            f"{'s' if len(machines) > 1 else ''} {', '.join(map(str, machines))})")


def end_distributed_run() -> NoReturn:
    """End a process of a multi-process run whose work is done: exit status 0 on every rank, everything it wrote
    flushed, and no teardown race with the collective library's threads. Call it last, at the top level, after
    everything that needs the other processes (training, evaluation, saving, pushing); a rank that raised never gets
    here: its exception ends it as Python does, with a non-zero exit status, and no collective waits on a failed rank.

    With a process group (`torch.distributed.is_initialized()`), in this order:

    1. `torch.distributed.barrier()`: no rank leaves while another still runs a collective with it.
    2. `torch.distributed.destroy_process_group()`.
    3. What Python's own exit does before it finalizes the interpreter: the threads that are not daemons are joined,
       then the `atexit` handlers run (`logging.shutdown`, which flushes and closes every logging handler; trackers'
       final syncs; torch's DataLoader and compile-worker cleanup).
    4. `sys.stdout` and `sys.stderr` flushed, then `os._exit(0)`; exit status 120 where a flush fails, as CPython's
       own exit. What is not flushed: a Python file object the program left open (finalization would have closed
       it); hfl3 writes every output in a `with` block or through `hfl3.atomic`.

    Without a process group (one process), `sys.exit(0)`: Python's own exit, nothing to race with.

    Why the interpreter is not finalized (torch 2.13.0 with gloo, Python 3.11.7; core dump and repetitions in
    dev/LOG.md, 2026-11-26): a gloo worker thread (`pt_gloo_runloop`, `c10d::ProcessGroupGloo::runLoop`) releases each
    finished collective after it marked it complete, and so after the rank's code may have moved on. Where that code
    already dropped the tensor (a synchronous `all_reduce` returns before the release; an asynchronous one may be
    dropped unfinished), torch keeps the tensor's Python object alive, owned by the C++ tensor, and the release
    (`AsyncAllreduceWork::~AsyncAllreduceWork` → `TensorImpl::decref_pyobject`) takes the GIL. Once the main thread
    is inside `Py_FinalizeEx`, Python 3.11 to 3.13 end such a thread with `pthread_exit` (3.14 blocks it instead,
    CPython gh-87135), whose forced unwind through that `noexcept` destructor calls `std::terminate`: "terminate
    called without an active exception", SIGABRT, a non-zero exit status for a run whose outputs were written. The
    barrier does not close the window (a worker thread can still be releasing a finished collective), nor does
    `destroy_process_group`: it joins gloo's threads only when nothing else holds the group (a DDP model, a
    `DeviceMesh` after DTensor use do). Without finalization, no thread outlives a finalizing interpreter.

    Raises:
        SystemExit: without a process group (status 0).
    """
    if not (dist.is_available() and dist.is_initialized()):
        sys.exit(0)
    dist.barrier()
    dist.destroy_process_group()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # CPython's own call at exit, the only way to run the registered handlers
    status = 0
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe or file: CPython's exit reports it with status 120
            status = 120
    os._exit(status)
