"""`hfl3.distributed` on 2 spawned gloo ranks standing for 2 machines (`GROUP_RANK` = rank), each in its own working
directory: a relative path is on that machine's own disk, an absolute one on a filesystem both see. Errors reach
every rank (no rank left waiting), files written by one machine reach the other (several chunks per file), a
checkpoint is copied once to the machine that lacks it, and the other machine's files are gathered into rank 0's."""

import json
import os
from pathlib import Path

import pytest

from equivalence import spawn_gloo_ranks

pytestmark = pytest.mark.distributed


def _outcome(call) -> str:
    try:
        call()
    except Exception as error:  # noqa: BLE001 (the test compares what each rank raised)
        return f"{type(error).__name__}: {error}"
    return "no error"


def _worker(rank: int, root: str) -> None:
    os.environ.update(GROUP_RANK=str(rank), LOCAL_WORLD_SIZE="1")
    os.chdir(Path(root) / f"machine{rank}")
    from hfl3 import distributed

    distributed.CHUNK_BYTES = 7  # every file below travels in several pieces
    seen = {}

    def missing_on_machine_1():
        if rank == 1:
            raise FileNotFoundError("--train_file data.jsonl: no such file")
        return rank

    seen["on_all_ranks"] = _outcome(lambda: distributed.on_all_ranks(missing_on_machine_1))
    seen["from_main"] = _outcome(lambda: distributed.from_main(lambda: int("not a number") if rank == 0 else 1))

    def unplannable():
        from hfl3.trainers.pretraining.compute_optimal import PlanError

        raise PlanError("target_flops=1 is less than one step")

    seen["own_error"] = _outcome(lambda: distributed.from_main(unplannable))  # hfl3's own type, for the recipes' line
    seen["same"] = _outcome(lambda: distributed.check_same_on_all_ranks({"max_steps": 10 + rank, "seed": 0},
                                                                       "the arguments", "start the same command"))
    with distributed.main_writes(Path("work") / "tokenizer") as writing:
        if writing:
            Path("work/tokenizer/sub").mkdir(parents=True)
            Path("work/tokenizer/tokenizer.json").write_text('{"model": "bpe"}')
            Path("work/tokenizer/sub/empty").write_bytes(b"")
    seen["handed_over"] = {str(p.relative_to("work/tokenizer")): p.read_text()
                           for p in sorted(Path("work/tokenizer").rglob("*")) if p.is_file()}
    seen["separate"] = list(distributed.separate_disks("out").writers)
    seen["shared"] = list(distributed.separate_disks(Path(root) / "shared").writers)

    staged = Path("out/_staging/checkpoint-2")
    staged.mkdir(parents=True)
    (staged / f"rng_state_{rank}.pth").write_bytes(bytes(range(20 + rank)))
    distributed.gather_files_to_main(staged, distributed.separate_disks("out"), stop="out")
    seen["gathered"] = sorted(p.name for p in staged.iterdir()) if staged.exists() else None
    seen["left_on_machine"] = Path("out").exists()

    checkpoint = None
    if rank == 0:
        checkpoint = staged.rename("checkpoint-2")
        (checkpoint / "trainer_state.json").write_text('{"global_step": 2}')
    copies = Path("copies")
    first = distributed.checkpoint_on_this_machine("checkpoint-2", copies)
    stamp = {p.name: p.stat().st_mtime_ns for p in Path(first).iterdir()}
    second = distributed.checkpoint_on_this_machine("checkpoint-2", copies)
    seen["checkpoint"] = [first, second, {p.name: p.read_bytes().hex() for p in sorted(Path(first).iterdir())},
                          stamp == {p.name: p.stat().st_mtime_ns for p in Path(second).iterdir()}]
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(seen))


def test_errors_files_and_checkpoints_cross_machines(tmp_path):
    for machine in (0, 1):
        (tmp_path / f"machine{machine}").mkdir()
    spawn_gloo_ranks(_worker, 2, tmp_path / "store", str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for seen in ranks:  # the same error on both ranks, naming where it happened when only one failed
        assert seen["on_all_ranks"] == ("FileNotFoundError: --train_file data.jsonl: no such file (on machine 1, "
                                        "rank 1)")
        assert seen["from_main"] == "ValueError: invalid literal for int() with base 10: 'not a number'"
        assert seen["own_error"] == "PlanError: target_flops=1 is less than one step"
        assert seen["same"].startswith("ValueError: the arguments differs between machine 0 (rank 0) and machine 1, "
                                       "rank 1: max_steps: 10 vs 11; start the same command")
        assert seen["handed_over"] == {"sub/empty": "", "tokenizer.json": '{"model": "bpe"}'}
        assert seen["separate"] == [1] and seen["shared"] == []
    assert ranks[0]["gathered"] == ["rng_state_0.pth", "rng_state_1.pth"]
    assert (tmp_path / "machine0" / "checkpoint-2" / "rng_state_1.pth").read_bytes() == bytes(range(21))
    assert ranks[1]["gathered"] is None and not ranks[1]["left_on_machine"]  # machine 1's copy went to machine 0
    first, second, files, untouched = ranks[1]["checkpoint"]
    assert first == second == str(Path("copies") / "checkpoint-2") and untouched  # copied once, then reused
    assert files == ranks[0]["checkpoint"][2] and "trainer_state.json" in files
    assert ranks[0]["checkpoint"][:2] == ["checkpoint-2", "checkpoint-2"]
