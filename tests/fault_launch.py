"""Run a recipe and SIGKILL it at a chosen point (tests/test_faults.py):

    python tests/fault_launch.py recipes/pretrain.py ARGS...   # or through accelerate launch, the same way

`HFL3_KILL` picks the point:
- `step:N`: at the start of optimizer step N+1 (N steps done);
- `save:TEXT`: right after a file whose path contains TEXT is written (`torch.save`, or the safetensors writer of
  `save_pretrained`), e.g. `save:checkpoint-8/optimizer.pt` (mid-checkpoint) or `save:final/model.safetensors`
  (mid-final-save); the file itself is truncated to 0 bytes first, as a kill during the write would leave it.
Nothing in hfl3 knows about this: the hooks are patched in here, before the recipe runs.
"""

import os
import runpy
import signal
import sys

import torch
import transformers.modeling_utils
from transformers import Trainer


def kill():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def after_write(write, text):
    def wrapper(obj, path, *args, **kwargs):
        result = write(obj, path, *args, **kwargs)
        if isinstance(path, (str, os.PathLike)) and text in str(path):
            open(path, "wb").close()
            kill()
        return result

    return wrapper


kind, _, value = os.environ.get("HFL3_KILL", "").partition(":")
if kind == "step":
    training_step = Trainer.training_step

    def training_step_or_kill(self, *args, **kwargs):
        if self.state.global_step == int(value):
            kill()
        return training_step(self, *args, **kwargs)

    Trainer.training_step = training_step_or_kill
elif kind == "save":
    torch.save = after_write(torch.save, value)
    transformers.modeling_utils.safe_save_file = after_write(transformers.modeling_utils.safe_save_file, value)

script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
