"""Which hfl3 files one training step enters, traced (`sys.setprofile`) for docs/design.md's hop table (One step).

A step's window runs from one call of `get_batch_samples` by the Trainer's `_run_epoch` to the next, so it holds the
step's data, forward, loss, backward, optimizer step and, at a logging step, the log."""

import collections
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src" / "hfl3") + "/"


class StepTracer:
    """`windows[n]`: the files of `src/hfl3` (relative to it) whose functions were called in step n (1-based)."""

    def __init__(self):
        self.step, self.windows = 0, collections.defaultdict(set)

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "get_batch_samples" and frame.f_back and frame.f_back.f_code.co_name == "_run_epoch":
            self.step += 1
        if code.co_filename.startswith(SRC):
            self.windows[self.step].add(code.co_filename[len(SRC):])

    def run(self, fn):
        previous = sys.getprofile()
        sys.setprofile(self._profile)
        try:
            return fn()
        finally:
            sys.setprofile(previous)
