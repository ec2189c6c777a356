"""Where a run writes, checked and resolved before any work, and folders committed whole: nothing is lost, and nothing
of this machine leaks. What the trainer does with the folder during the run (staged checkpoints, the final folder,
resume checks, the push) is `hfl3.trainers.outputs.run.RunOutputs`.

- `prepare_output_dir(args) -> OutputFolder`: the recipes' first call (made when their arguments are checked), whose
  result the trainer holds (`RunOutputs.folder`): nothing re-derives it. Refuses a non-empty
  `output_dir` unless the run resumes (`--resume_from_checkpoint latest|true|PATH`) or `--overwrite_output_dir` is
  given, and a push that could not happen; resolves `latest`/`true` to the newest complete checkpoint
  (`latest_checkpoint`); finishes a final folder whose commit was interrupted; probes which machines see rank 0's
  disk. Nothing in `output_dir` is touched before training, and a run that replaces another run's folder
  (`--overwrite_output_dir`) writes its checkpoints into the staging area, so that until it commits, the old
  folder stays whole and a kill cannot mix the two runs. Across machines global rank 0 decides and every machine
  reads its checkpoint (`hfl3.distributed`).
- `commit_folder(staged, folder, replace_all)`: a staged folder moved in, weights last, finished by the next start
  after a kill.
- `latest_checkpoint`, `checkpoint_problem`: which checkpoints are complete (headers read, never the tensors).

Layout of the staging area, ignored by `get_last_checkpoint`, `rotate_checkpoints` and the Hub upload:
`output_dir/_hfl3_staging/{checkpoints/checkpoint-N, final, previous, work, resume, upload, run}`; `run` holds the
checkpoints of a run that replaces another run's folder.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants as hub_constants
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hfl3.atomic import write_json_atomic
from hfl3.distributed import SeparateDisks, checkpoint_on_this_machine, from_main, on_all_ranks, separate_disks
from hfl3.errors import InputError
from hfl3.provenance.hub import is_hub_id

logger = logging.getLogger(__name__)

STAGING = "_hfl3_staging"
RUN_STATE = "hfl3_run.json"
COMPLETE = ".complete"
LATEST = ("latest", "true", "True", "1")
REPLACING_RUN = "run"
"""`output_dir/_hfl3_staging/run`: the checkpoints of a run that replaces another run's folder, until it commits."""
CHECKPOINT_FOLDER = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_WEIGHTS = re.compile(r".*\.(safetensors|bin|pt)$|.*\.index\.json$")


def work_dir(output_dir: str | os.PathLike) -> Path:
    """`output_dir/_hfl3_staging/work`: where a run shares files between its processes before training (a trained
    tokenizer, generated data) without touching `output_dir`'s own files."""
    return Path(output_dir) / STAGING / "work"


def checkpoint_problem(folder: str | os.PathLike) -> str | None:
    """Why checkpoint `folder` cannot be resumed from (no or unreadable `trainer_state.json`, an empty file, a
    `.safetensors` file whose header is unreadable or whose tensors run past its end), or None when it is complete.
    Reads the headers only, never the tensors."""
    folder = Path(folder)
    try:
        json.loads((folder / "trainer_state.json").read_text())
    except (OSError, ValueError) as error:
        return f"trainer_state.json unreadable ({error.__class__.__name__})"
    empty = sorted(f.name for f in folder.rglob("*") if f.is_file() and f.stat().st_size == 0)
    if empty:
        return f"empty file(s) {', '.join(empty)}"
    for file in sorted(folder.rglob("*.safetensors")):
        if problem := safetensors_problem(file):
            return f"{file.relative_to(folder)}: {problem}"
    return None


def safetensors_problem(file: str | os.PathLike) -> str | None:
    """Why `file` is not a whole `.safetensors` file (the format: an 8-byte little-endian header length, a JSON
    header, then the tensors at the header's `data_offsets`), or None. Reads the header only."""
    size = os.path.getsize(file)
    with open(file, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return "truncated before its header"
        length = int.from_bytes(head, "little")
        if length > size - 8:
            return f"truncated inside its header ({size} bytes, header of {length})"
        try:
            header = json.loads(handle.read(length))
        except ValueError:
            return "unreadable header (not JSON)"
    ends = [entry["data_offsets"][1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry]
    if ends and 8 + length + max(ends) > size:
        return f"truncated: its tensors end at byte {8 + length + max(ends)}, the file has {size}"
    return None


def latest_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest complete `checkpoint-N` in `output_dir` (a run's checkpoint folder: the output folder, or a replacing
    run's `_hfl3_staging/run`; None if there is none); incomplete ones (written by a killed run before checkpoints
    were staged, or damaged since) and interrupted stagings are skipped with a warning."""
    output_dir = Path(output_dir)
    staging = output_dir.parent if output_dir.parent.name == STAGING else output_dir / STAGING
    staged = staging / "checkpoints"
    if staged.is_dir():
        for leftover in sorted(staged.iterdir()):
            logger.warning("skipping %s: interrupted while saving (incomplete, never renamed)", leftover.name)
    checkpoints = [p for p in output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*")
                   if p.is_dir() and CHECKPOINT_FOLDER.match(p.name)]
    for folder in sorted(checkpoints, key=lambda p: int(CHECKPOINT_FOLDER.match(p.name).group(1)), reverse=True):
        problem = checkpoint_problem(folder)
        if problem is None:
            return str(folder)
        logger.warning("skipping incomplete checkpoint %s: %s", folder, problem)
    return None


def resolve_checkpoint(output_dir: str | os.PathLike, resume_from_checkpoint: str | bool | None) -> str | None:
    """`resume_from_checkpoint` as a folder: `True`, `"latest"` or `"true"` give `latest_checkpoint(output_dir)`
    (None when there is none), `False`/`"false"`/empty give None, anything else is returned as is."""
    if resume_from_checkpoint is True or (isinstance(resume_from_checkpoint, str) and resume_from_checkpoint in LATEST):
        return latest_checkpoint(output_dir) if Path(output_dir).is_dir() else None
    if resume_from_checkpoint in (False, None, "false", "False", ""):
        return None
    return str(resume_from_checkpoint)


@dataclass(frozen=True)
class OutputFolder:
    """Where a run writes, resolved once before any work (`prepare_output_dir`) and carried into the trainer
    (`RunOutputs(folder=...)`).

    Attributes:
        path: the output folder (`--output_dir`); its files are replaced only when the run commits its final folder.
        run_dir: where the run's checkpoints are written: `path`, or `path/_hfl3_staging/run` when
            `--overwrite_output_dir` replaces a folder that holds another run's files (the commit moves them in and
            the old files out; until then the old folder stays whole and loadable).
        resume_checkpoint: the checkpoint folder this rank resumes from (a copy of rank 0's on a machine that does
            not see its disk), or None.
        disks: which ranks do not see global rank 0's `path` (`hfl3.distributed.separate_disks`).
        created: whether `path` did not exist before this run (a failed run then leaves nothing there).
    """

    path: Path
    run_dir: Path
    resume_checkpoint: str | None = None
    disks: SeparateDisks = SeparateDisks()
    created: bool = False

    @property
    def replacing(self) -> bool:
        """Whether the run replaces another run's folder when it commits (its checkpoints are staged meanwhile)."""
        return self.run_dir != self.path


def prepare_output_dir(args, refuse: bool = True) -> OutputFolder:
    """Check and resolve where a run writes, before any data or model work; the recipes call it once, when checking
    their arguments (so a refusal is an argument error, exit status 2), and hand the result to the trainer. `args` is
    not changed: `resume_from_checkpoint` keeps what was asked, the folder resolved is `resume_checkpoint`.

    `--resume_from_checkpoint latest` (or `true`) means the newest complete checkpoint of the run's checkpoint
    folder (`run_dir`); with none there the run starts from scratch (a warning says so), so a restart loop can always
    pass it. With `--overwrite_output_dir` and a folder holding another run's files, `run_dir` is the staging area:
    the same command with `--resume_from_checkpoint latest` continues that replacing run, and the old folder is
    replaced only when it commits.

    Across machines (a collective: every rank calls it): each rank checks its own `output_dir`, and a problem on one
    machine stops every rank with the same line; global rank 0 alone finishes an interrupted commit, resolves the
    checkpoint and checks the folder's content (only it writes outputs); a machine that does not see rank 0's
    checkpoint gets a copy from it through the process group (`hfl3.distributed.checkpoint_on_this_machine`, into
    `output_dir/_hfl3_staging/resume/`, removed when the run finishes).

    Args:
        refuse: False for a trainer used without a recipe (`RunOutputs.start`): the same resolution, without
            the checks of a recipe's arguments (a non-empty folder, a push).

    Raises:
        FileExistsError: `output_dir` is a file, or holds files and the run neither resumes nor has
            `--overwrite_output_dir`.
        PermissionError: `output_dir` cannot be created or written (a probe file cannot be created in its nearest
            existing folder: `write_problem`).
        FileNotFoundError: `--resume_from_checkpoint PATH` is not a folder.
        ValueError: `--push_to_hub` without a valid `--hub_model_id`, or offline (`HF_HUB_OFFLINE=1`); the
            checkpoint given is incomplete; a setup across machines that cannot keep its checkpoints whole
            (`check_machines`).
    """
    output_dir = Path(args.output_dir)
    created = not output_dir.exists()
    if refuse:
        on_all_ranks(lambda: check_output_dir(args))
    disks = separate_disks(output_dir / STAGING)
    if refuse:
        check_machines(args, disks)
    run_dir, resume = from_main(lambda: resolve_resume(args, refuse))
    checkpoint = checkpoint_on_this_machine(resume, output_dir / STAGING / "resume")
    return OutputFolder(output_dir, Path(run_dir), checkpoint, disks, created)


def check_output_dir(args) -> None:
    """This machine's side of `prepare_output_dir`: `output_dir` can be a folder this user writes (`write_problem`);
    a push could happen."""
    output_dir = Path(args.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"--output_dir {output_dir}: is a file; expected a folder (created if missing)")
    existing = next(folder for folder in (output_dir, *output_dir.absolute().parents) if folder.exists())
    if problem := write_problem(existing):
        raise PermissionError(f"--output_dir {output_dir}: {'it' if existing == output_dir else existing} is not "
                              f"writable (a probe file could not be created there: {problem}); expected a folder "
                              "this user can create and write")
    if args.push_to_hub:
        check_push_arguments(args)


def write_problem(folder: Path) -> str | None:
    """Why a file cannot be written in the existing `folder` (the OS error's words), or None: proven by creating a
    probe folder with a file in it, and removing both. Not `os.access`, which tells root yes for `/proc` and `/sys`
    (a run there read its corpus and trained its tokenizer, then died saving) and knows nothing of read-only or full
    file systems."""
    try:
        probe = Path(tempfile.mkdtemp(prefix=".hfl3-write-probe-", dir=folder))
    except OSError as error:
        return error.strerror or type(error).__name__
    try:
        (probe / "probe").write_bytes(b"hfl3")
    except OSError as error:
        return error.strerror or type(error).__name__
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return None


def check_machines(args, disks: SeparateDisks) -> None:
    """Refuse, before any work, a run across machines whose checkpoints could not be whole on global rank 0's disk.

    Raises:
        ValueError: `--save_on_each_node` on several machines (each machine would commit a checkpoint holding only
            its own ranks' state); DeepSpeed or FSDP where a machine does not see rank 0's `output_dir` (their
            ranks save and load their own shards; hfl3 moves only DDP's per-rank state between disks).
    """
    machines = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if machines > 1 and args.save_on_each_node:
        raise ValueError("--save_on_each_node: hfl3 gathers every rank's state into the checkpoint of global rank 0, "
                         "complete on machine 0's disk and resumable from it alone; drop --save_on_each_node")
    sharded = args.deepspeed or args.fsdp or any(os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() in
                                                 ("1", "true") for name in ("DEEPSPEED", "FSDP"))
    if disks.writers and sharded:
        raise ValueError(f"--output_dir {args.output_dir}: machine(s) of rank(s) {', '.join(map(str, disks.writers))} "
                         "do not see machine 0's folder, and DeepSpeed/FSDP ranks save and load their own shards "
                         "there; put --output_dir on a filesystem every machine mounts, or train with DDP "
                         "(accelerate_configs/multi_gpu.yaml)")


def resolve_resume(args, refuse: bool = True) -> tuple[str, str | None]:
    """Global rank 0's side of `prepare_output_dir`: finish an interrupted commit, choose the run's checkpoint folder,
    resolve the checkpoint, refuse (with `refuse`) a non-empty `output_dir` of another run. Returns `(run_dir,
    checkpoint or None)`."""
    output_dir = Path(args.output_dir)
    final = output_dir / STAGING / "final"
    if args.should_save and (final / COMPLETE).is_file():
        logger.warning("%s: finishing the commit of a final folder interrupted by a kill", output_dir)
        commit_folder(final, output_dir)
    present = sorted(p.name for p in output_dir.iterdir() if p.name != STAGING) if output_dir.is_dir() else []
    staged_run = output_dir / STAGING / REPLACING_RUN
    overwrite = getattr(args, "overwrite_output_dir", False)
    run_dir = staged_run if overwrite and (present or staged_run.is_dir()) else output_dir
    if run_dir == output_dir and staged_run.is_dir() and any(staged_run.glob(f"{PREFIX_CHECKPOINT_DIR}-*")):
        logger.warning("%s holds the checkpoints of an unfinished --overwrite_output_dir run; this run leaves them "
                       "(the commit at its end removes them): pass --overwrite_output_dir --resume_from_checkpoint "
                       "latest to continue that run instead", output_dir)
    latest = args.resume_from_checkpoint is True or args.resume_from_checkpoint in LATEST
    resume = resolve_checkpoint(run_dir, args.resume_from_checkpoint)
    if latest and resume is None:
        logger.warning("--resume_from_checkpoint latest: no complete checkpoint in %s; starting from scratch",
                       run_dir)
    elif resume is not None and not latest:
        if not Path(resume).is_dir():
            raise FileNotFoundError(f"--resume_from_checkpoint {resume}: no such folder; expected a checkpoint-N "
                                    "folder, or latest (the newest complete checkpoint in --output_dir)")
        if problem := checkpoint_problem(resume):
            raise InputError(f"--resume_from_checkpoint {resume}: incomplete checkpoint ({problem}); pass "
                             "--resume_from_checkpoint latest for the newest complete one")
    if refuse and resume is None and present and not overwrite:
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        raise FileExistsError(
            f"--output_dir {output_dir}: not empty ({shown}); pass --resume_from_checkpoint latest to continue its "
            "run, --overwrite_output_dir to replace it when this run finishes, or another --output_dir")
    return str(run_dir), resume


def check_push_arguments(args) -> None:
    """`--push_to_hub` needs a valid `--hub_model_id` and the network, checked before training rather than found
    out at the upload that ends it.

    Raises:
        ValueError: no or an invalid `--hub_model_id`; `HF_HUB_OFFLINE=1`.
    """
    if not args.hub_model_id:
        raise ValueError("--push_to_hub needs --hub_model_id USER/NAME")
    if not is_hub_id(args.hub_model_id):
        raise ValueError(f"--hub_model_id {args.hub_model_id}: not a Hub repository id; expected USER/NAME")
    if hub_constants.is_offline_mode():
        raise ValueError("--push_to_hub: HF_HUB_OFFLINE=1 is set, so the upload that ends the run would fail; unset "
                         "it, or drop --push_to_hub and upload the output folder later")


def commit_folder(staged: str | os.PathLike, folder: str | os.PathLike, replace_all: bool = False,
                  checkpoints_from: str | os.PathLike | None = None) -> None:
    """Move the complete folder `staged` into `folder`, such that `folder` holds weights only when every other file
    of the new version is in place, in two phases a kill can interrupt and the next start finishes
    (`prepare_output_dir`), as the `.complete` marker in `staged` records them:

    1. out: the old entries that the new ones replace (every old entry with `replace_all`, and any old weight file)
       go to `folder/_hfl3_staging/previous`, weights first;
    2. in: the new entries move in, weights last; then, for a run that replaced another run's folder, its
       checkpoints from `checkpoints_from` (a folder inside `folder`'s staging area), their `trainer_state.json`'s
       `best_model_checkpoint` pointed at where they land.

    Then the whole staging area (`folder/_hfl3_staging`) is removed. Each phase moves only what is left to move, so
    finishing it again is safe; nothing of the new version is ever moved out."""
    staged, folder = Path(staged), Path(folder)
    marker = staged / COMPLETE
    journal = {}
    if marker.is_file():  # finishing an interrupted commit: as it was started
        with contextlib.suppress(ValueError):
            journal = json.loads(marker.read_text() or "{}")
    if not journal:
        source = Path(checkpoints_from).relative_to(folder).as_posix() if checkpoints_from else None
        journal = {"replace_all": replace_all, "checkpoints_from": source, "phase": "out"}
        write_json_atomic(marker, journal)
    if journal.get("phase", "out") == "out":
        previous = folder / STAGING / "previous"
        previous.mkdir(parents=True, exist_ok=True)
        names = {p.name for p in staged.iterdir() if p.name != COMPLETE}
        old = [p for p in folder.iterdir() if p.name != STAGING and (journal.get("replace_all") or p.name in names
                                                                     or _WEIGHTS.match(p.name))]
        for entry in sorted(old, key=lambda p: not _WEIGHTS.match(p.name)):
            target = previous / entry.name
            if target.exists():
                shutil.rmtree(target) if target.is_dir() else target.unlink()
            entry.rename(target)
        journal["phase"] = "in"
        write_json_atomic(marker, journal)
    incoming = [p for p in staged.iterdir() if p.name != COMPLETE]
    for entry in sorted(incoming, key=lambda p: bool(_WEIGHTS.match(p.name))):
        entry.rename(folder / entry.name)
    if journal.get("checkpoints_from"):
        run_dir = folder / journal["checkpoints_from"]
        for checkpoint in sorted(run_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*")) if run_dir.is_dir() else []:
            if CHECKPOINT_FOLDER.match(checkpoint.name):
                _repoint_best_checkpoint(checkpoint, run_dir, folder)
                checkpoint.rename(folder / checkpoint.name)
    shutil.rmtree(folder / STAGING)  # the run is over: its staged checkpoints and work files go too


def _repoint_best_checkpoint(checkpoint: Path, run_dir: Path, folder: Path) -> None:
    """`best_model_checkpoint` in `checkpoint/trainer_state.json`, when it names a checkpoint of `run_dir`, renamed
    to that checkpoint's place in `folder` (where the commit moves it)."""
    state = checkpoint / "trainer_state.json"
    with contextlib.suppress(OSError, ValueError):
        values = json.loads(state.read_text())
        best = values.get("best_model_checkpoint")
        if best and Path(best).parent == run_dir:
            values["best_model_checkpoint"] = str(folder / Path(best).name)
            write_json_atomic(state, values)
