"""Host syncs of one pretraining optimizer step, counted on a CPU: hfl3's step as the recipe runs it beside nanochat's
own step at the same shape, each sync named by where it comes from.

A host sync is a call that makes the host wait for the accelerator: on a GPU each one drains the stream queue (the
GPU idles while the host catches up). A CPU has no queue, so the syncs are recognised by what is called and on which
tensor, through a `TorchFunctionMode` (the Python calls that never reach the dispatcher) and a `TorchDispatchMode`
(every aten op, forward and backward), as `tests/conftest.py`'s `largest_tensor` records sizes:

- `item`: `aten._local_scalar_dense` / `is_nonzero` (`.item()`, `bool()`, `int()`, `float()` of a tensor, `if t:`);
- `equal`: `torch.equal`;
- `data-dependent shape`: `nonzero` (`torch.where(c)`, `argwhere`), `masked_select`, `unique*`, `bincount`,
  `repeat_interleave` without `output_size`, and boolean-mask indexing (`index` / `index_put` with a bool index,
  which CUDA runs through `nonzero`);
- `copy to host`: `.tolist()`, `.numpy()`, `np.asarray(t)`, `.cpu()`, `.to("cpu")`, `host.copy_(t)`; with
  `non_blocking=True` it is counted apart as `deferred copy to host` (the wait moves to whoever reads it later).

Only calls on a tensor that would live on the accelerator count. On the CPU every tensor is on the CPU, so the
counter follows where each tensor would be: the parameters and buffers of every module, the model's inputs (the
step's batch), a tensor made with a `device=` argument inside a module's forward or an autograd backward
(`torch.arange(n, device=x.device)`), and every output of an op with such an input (in-place ops and `host.copy_`
aside: a copy into a host tensor leaves it on the host) are device tensors; any other tensor made from host values
(`torch.tensor(0.)`; a factory in the optimizer or the Trainer), and a copy to the host, is a host tensor until an
op writes device values into it. So torch's optimizer step counters (host tensors on a GPU too, unless
`capturable`/`fused`) and nanochat's 0-D CPU hyperparameter tensors are no syncs: the same calls on host tensors are
reported apart, as `host read`s. The limits of the method: a tensor made outside the model from host values, which
a GPU run would have made on the device, is taken for a host tensor; `x.to(torch.device("cpu"))` cannot be told
from `x.to(y.device)` (only the string `"cpu"` is a copy to the host); syncs inside CUDA kernels (none are known in
these steps) and in code only CUDA runs (Liger's loss) are not seen: a GPU profile (`vs_nanochat.py --profile_dir`)
counts `cudaStreamSynchronize` itself. The Python bodies of `torch.library` custom ops (hfl3's L3 lookup and
chunked loss), which run below the dispatch mode, are run inside it, so their syncs count too.

Each sync is named by the innermost Python frame of its stack (the library that made the call: hfl3, transformers,
accelerate, torch, nanochat or another package) and, for a call inside torch, by the innermost frame outside torch
(who called it). Syncs are counted per occurrence, per optimizer step, over `--steps` steps after `--warmup_steps`:
plain steps apart from the steps where the Trainer logs, evaluates, saves or stops (it reads the loss and gathers
metrics there by design; the last step logs, evaluates and stops).

Arms, each in a fresh process:
- `hfl3_muon`, `hfl3_muon_l3`, `hfl3_adamw`, `hfl3_adamw_l3`: hfl3's step as `recipes/pretrain.py` builds it
  (`build_hfl3_trainer`: the recipe's data, model and trainer with its callbacks; MuonAdamW or the Trainer's AdamW;
  dense, or one L3 layer after layer `depth // 2 - 1`), on `--dataset` (the recipe's stdlib), block-causal packed
  rows unless `--attend_across_documents`; the Trainer's `training_step`, clipping, optimizer and scheduler step,
  callbacks;
- `nanochat`: nanochat's GPT and MuonAdamW from a checkout (`--nanochat_dir`; `vs_nanochat.run_nanochat`, eager,
  its dtype bf16 when `--bf16`), at the same depth, width, heads, vocabulary (the hfl3 tokenizer's), row length,
  rows per step and window pattern.

    OMP_NUM_THREADS=1 python benchmarks/host_syncs.py --nanochat_dir build/nanochat \\
        --depth 12 --vocab_size 32768 --head_dim 128 --seq_len 256 --batch_size 2 \\
        --json benchmarks/results/host_syncs_cpu.json                  # the d12 count, 2 × 256 tokens, bf16
    python benchmarks/host_syncs.py --arms hfl3_muon hfl3_muon_l3       # hfl3 alone, the CPU shape

Get nanochat with `git clone https://github.com/karpathy/nanochat build/nanochat` (`build/` is git-ignored).
"""

import contextlib
import importlib.util
import os
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary
from transformers import HfArgumentParser, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (REPO_ROOT, ModelShape, device_shape, in_fresh_process, machine_name, shown_path,  # noqa: E402
                    write_result)

aten = torch.ops.aten
SYNC_OPS = {
    aten._local_scalar_dense: "item", aten.item: "item", aten.is_nonzero: "item", aten.equal: "equal",
    **dict.fromkeys([aten.nonzero, aten.masked_select, aten._unique, aten._unique2, aten.unique_dim,
                     aten.unique_consecutive, aten.unique_dim_consecutive, aten.bincount], "data-dependent shape"),
}
MASK_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
TO_HOST_METHODS = {"tolist", "numpy", "__array__", "cpu"}
# Frames of the interception itself and of torch's call plumbing: the site is the first frame past them.
PLUMBING = ("torch/utils/_python_dispatch.py", "torch/overrides.py", "torch/_ops.py", "torch/_library/",
            "torch/_compile.py", "torch/_dynamo/", "torch/autograd/function.py", "torch/_tensor.py")
HFL3_PATHS = (str(REPO_ROOT / "src" / "hfl3"), str(REPO_ROOT / "recipes"))
PLAIN, LOGGING = "plain", "log/eval/save"
HOST_READ = "host read"  # the same calls on host tensors: not syncs on a GPU, reported apart
DEFERRED = "deferred copy to host"  # non_blocking: the host waits later, where it reads the copy; reported apart
NOT_SYNCS = (HOST_READ, DEFERRED)

HFL3_ARMS = {"hfl3_muon": ("muon", False), "hfl3_muon_l3": ("muon", True),
             "hfl3_adamw": ("adamw_torch", False), "hfl3_adamw_l3": ("adamw_torch", True)}
ARMS = ("nanochat", *HFL3_ARMS)


@dataclass
class HostSyncArguments:
    nanochat_dir: str | None = field(default=None, metadata={"help": "a nanochat checkout; without it, hfl3 alone"})
    arms: list[str] = field(default_factory=lambda: list(ARMS), metadata={"help": f"any of {ARMS}"})
    depth: int | None = field(default=None, metadata={"help": "decoder layers (default 12 on CUDA, 2 on CPU)"})
    seq_len: int | None = field(default=None, metadata={"help": "row length (default 2048 on CUDA, 128 on CPU)"})
    batch_size: int | None = field(default=None, metadata={"help": "rows per step (default 16 on CUDA, 4 on CPU)"})
    vocab_size: int | None = field(default=None, metadata={"help": "the recipe's BPE vocabulary, also nanochat's "
                                                          "(default 32768 on CUDA, 2048 on CPU)"})
    head_dim: int | None = field(default=None, metadata={"help": "head width (default 128 on CUDA, 64 on CPU)"})
    window_pattern: str = field(default="L", metadata={"help": "S/L pattern, as nanochat's --window_pattern"})
    attend_across_documents: bool = field(default=False, metadata={
        "help": "hfl3: packed documents attend to each other, as nanochat (the recipe's default: block-causal)"})
    bf16: bool = field(default=True, metadata={"help": "bf16 autocast (hfl3), bf16 compute dtype (nanochat)"})
    compile: bool = field(default=False, metadata={"help": "hfl3: the recipe's --torch_compile (the GPU run's "
                                                   "setting; the syncs are counted eagerly either way)"})
    dataset: str = field(default="stdlib", metadata={"help": "hfl3's training text (the recipe's --dataset)"})
    evaluate: bool = field(default=True, metadata={"help": "evaluate (bits per byte, greedy samples) at the start "
                                                    "and the last step, as the recipe does"})
    warmup_steps: int = field(default=2, metadata={"help": "steps before the counted ones (state is created there)"})
    steps: int = field(default=4, metadata={"help": "counted steps; the last one logs, evaluates and stops"})
    json: str | None = field(default=None, metadata={"help": "write the results here (JSON)"})

    def __post_init__(self):
        device_shape().fill(self)
        unknown = set(self.arms) - set(ARMS)
        if unknown:
            raise ValueError(f"--arms: unknown {sorted(unknown)}; expected some of {ARMS}")
        if self.warmup_steps < 1 or self.steps < 2:
            raise ValueError(f"--warmup_steps {self.warmup_steps} must be >= 1 and --steps {self.steps} >= 2 (the "
                             "last counted step logs; the others are plain)")
        if "nanochat" in self.arms and not self.nanochat_dir:
            self.arms = [arm for arm in self.arms if arm != "nanochat"]
        if self.nanochat_dir and not (Path(self.nanochat_dir) / "nanochat" / "gpt.py").is_file():
            raise ValueError(f"--nanochat_dir {self.nanochat_dir}: no nanochat/gpt.py there; clone "
                             "https://github.com/karpathy/nanochat into it")


def library_of(filename: str, nanochat_dir: str | None = None) -> str:
    """The library a source file belongs to: hfl3 (the package and its recipes), nanochat, a site-packages package
    (torch, transformers, accelerate, ...), the benchmark harness, or the file's name."""
    if filename.startswith(HFL3_PATHS):
        return "hfl3"
    if nanochat_dir and filename.startswith(nanochat_dir):
        return "nanochat"
    if "site-packages/" in filename:
        return filename.split("site-packages/", 1)[1].split("/", 1)[0]
    if filename.startswith(str(REPO_ROOT / "benchmarks")):
        return "benchmark harness"
    return Path(filename).name


def frame_name(frame) -> str:
    """`path:line (function)`, the path relative to site-packages or the repository."""
    filename = frame.f_code.co_filename
    shown = filename.split("site-packages/", 1)[1] if "site-packages/" in filename else shown_path(filename)
    return f"{shown}:{frame.f_lineno} ({frame.f_code.co_name})"


class HostSyncCounter:
    """`with HostSyncCounter() as counter:` records every host sync made inside the block (module docstring: what
    counts and how device tensors are told apart) as `counter.syncs`, a list of dicts with `step`, `kind`, `op`,
    `site` and `library` (innermost frame), `caller` and `caller_library` (innermost frame outside torch). Call
    `begin_step(n)` where step n starts and `step_kind(n, PLAIN or LOGGING)` once it is known; what happens before
    the first `begin_step` is step 0."""

    def __init__(self, nanochat_dir: str | None = None):
        self.nanochat_dir = str(Path(nanochat_dir).resolve()) if nanochat_dir else None
        self.device_tensors = WeakIdKeyDictionary()
        self.syncs: list[dict] = []
        self.step = 0
        self.step_kinds: dict[int, str] = {}
        self.forward_depth = 0  # modules whose forward is running
        self.harness_files: set[str] = set()  # more files whose frames are the interception's (a subclass's module)
        self._modes = self.recorders()
        self._hooks = []

    module_hooks = True  # global module hooks mark parameters, buffers and inputs (a subclass may go without)

    def __enter__(self):
        module = torch.nn.modules.module
        self._hooks = [module.register_module_forward_pre_hook(self._enter_forward),
                       module.register_module_forward_hook(self._leave_forward, always_call=True)
                       ] if self.module_hooks else []
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()

    def begin_step(self, step: int) -> None:
        self.step = step

    def step_kind(self, step: int, kind: str) -> None:
        self.step_kinds[step] = kind

    def mark_device(self, *trees) -> None:
        """Mark every tensor in `trees` (tensors, lists, dicts) as one that would live on the accelerator."""
        for leaf in tree_leaves(trees):
            if isinstance(leaf, torch.Tensor):
                self.device_tensors[leaf] = True

    def on_device(self, *trees) -> bool:
        return any(isinstance(leaf, torch.Tensor) and leaf in self.device_tensors for leaf in tree_leaves(trees))

    def in_model_code(self) -> bool:
        """Inside a module's forward or an autograd backward, where a tensor made with `device=` is made there."""
        return self.forward_depth > 0 or torch._C._current_autograd_node() is not None

    def _enter_forward(self, module, inputs):
        self.mark_device(list(module.parameters(recurse=False)), list(module.buffers(recurse=False)))
        if self.forward_depth == 0:  # the model's own inputs (the step's batch); inner modules' follow from them
            self.mark_device(inputs)
        self.forward_depth += 1

    def _leave_forward(self, module, inputs, output):
        self.forward_depth -= 1

    def mark_model_inputs(self, model: torch.nn.Module) -> None:
        """Mark the keyword inputs of `model`'s forward too (the Trainer calls `model(**inputs)`; the global forward
        pre-hook sees positional inputs only)."""
        model.register_forward_pre_hook(lambda module, args, kwargs: self.mark_device(kwargs), with_kwargs=True)

    def record(self, kind: str, op: str) -> None:
        self.syncs.append(dict(step=self.step, kind=kind, op=op, **self.where()))

    def where(self) -> dict:
        """Where the op being recorded was called: `site` and `library` (the innermost frame outside this module and
        torch's call plumbing), `caller` and `caller_library` (the innermost frame outside torch)."""
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename == __file__
                                     or frame.f_code.co_filename in self.harness_files
                                     or any(part in frame.f_code.co_filename for part in PLUMBING)):
            frame = frame.f_back
        caller = frame
        while caller is not None and (self.library(caller.f_code.co_filename) == "torch"
                                      or caller.f_code.co_filename == __file__
                                      or caller.f_code.co_filename in self.harness_files):
            caller = caller.f_back
        site, library = (frame_name(frame), self.library(frame.f_code.co_filename)) if frame else ("C++", "torch")
        return dict(site=site, library=library, caller=frame_name(caller) if caller else None,
                    caller_library=self.library(caller.f_code.co_filename) if caller else None)

    def library(self, filename: str) -> str:
        """`library_of(filename)` for this counter's nanochat checkout."""
        return library_of(filename, self.nanochat_dir)

    def observe_op(self, func, args, kwargs, on_device: bool) -> None:
        """Called for every aten op (before it runs) with whether an input is a device tensor; a subclass records
        more than syncs here (`benchmarks/step_proxies.py`: copies and fills)."""

    def treat_as_device(self, args, kwargs) -> bool:
        """Whether an op's inputs are device tensors whatever was marked (a subclass: inside compiled code)."""
        return False

    def observe_call(self, name: str, args, kwargs) -> None:
        """Called for every `torch` function and `Tensor` method call that the function mode sees (before it
        runs); see `observe_op`."""

    def recorders(self) -> tuple:
        """The modes that record: a function mode and a dispatch mode."""
        return _FunctionRecorder(self), _DispatchRecorder(self)

    def nested_recorders(self) -> tuple:
        """The modes that record inside a custom op's Python body (run below the dispatch mode)."""
        return self.recorders()


class _FunctionRecorder(TorchFunctionMode):
    """The copies to the host that no aten op shows on a CPU (`.tolist()`, `.numpy()`, `.cpu()` and `.to("cpu")` of
    a CPU tensor return without dispatching)."""

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        self.counter.observe_call(name, args, kwargs)
        to_host = name in TO_HOST_METHODS or (name == "to" and _targets_host(args[1:], kwargs))
        if not (to_host and args and self.counter.on_device(args[0])):
            out = func(*args, **kwargs)
            device = kwargs.get("device")
            if device is not None and not _targets_host((), kwargs) and self.counter.in_model_code():
                self.counter.mark_device(out)  # made where the model runs (`device=x.device`)
            return out
        deferred = kwargs.get("non_blocking") or (name == "to" and any(arg is True for arg in args[1:]))
        self.counter.record(DEFERRED if deferred else "copy to host", f"Tensor.{name}")
        out = func(*args, **kwargs)
        if name in ("cpu", "to"):
            out = out.clone() if out is args[0] else out  # a copy on the accelerator: the original stays there
            self.counter.device_tensors.pop(out, None)
        return out


def _targets_host(args, kwargs) -> bool:
    """Whether a `Tensor.to(...)` call names the CPU as a string (`"cpu"`, `device="cpu"`). A `torch.device` object
    is taken as the device the tensor is on: on a CPU `x.to(y.device)` cannot tell a device copy from a host one."""
    targets = [kwargs.get("device"), *args]
    return any(isinstance(target, str) and target.split(":")[0] == "cpu" for target in targets)


class _DispatchRecorder(TorchDispatchMode):
    """Every aten op: records the syncing ones on device tensors, and marks the outputs of ops with a device input."""

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter, packet = self.counter, func.overloadpacket
        on_device = counter.treat_as_device(args, kwargs) or counter.on_device(args, kwargs)  # (marks, first)
        kind = SYNC_OPS.get(packet) if on_device else None
        if not on_device and packet in SYNC_OPS:
            kind = HOST_READ
        if on_device and packet in MASK_INDEXING and any(
                isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) for index in args[1]):
            kind = "data-dependent shape"
        if on_device and packet is aten.repeat_interleave and func._overloadname != "self_int" \
                and kwargs.get("output_size") is None:
            kind = "data-dependent shape"
        if packet is aten.copy_ and args[1] in counter.device_tensors and args[0] not in counter.device_tensors:
            kind = DEFERRED if (len(args) > 2 and args[2]) or kwargs.get("non_blocking") else "copy to host"
            on_device = False  # the destination stays on the host
        if kind:
            counter.record(kind, str(packet).removeprefix("aten."))
        counter.observe_op(func, args, kwargs, on_device)
        custom_op = _maybe_get_opdef(func)
        if custom_op is None:
            out = func(*args, **kwargs)
        else:  # a torch.library custom op runs its Python body below this mode: run it here, recorded
            with contextlib.ExitStack() as stack:
                for mode in counter.nested_recorders():
                    stack.enter_context(mode)
                counter.forward_depth += on_device  # model code: a tensor it makes with `device=` is on the device
                try:
                    out = custom_op._init_fn(*args, **kwargs)
                finally:
                    counter.forward_depth -= on_device
        if on_device:
            counter.mark_device(out)
        return out


class StepMarks(TrainerCallback):
    """Tells the counter where each optimizer step of a Trainer starts (its `get_batch_samples`, wrapped here) and
    whether the Trainer logs, evaluates, saves or stops at its end (added last: `DefaultFlowCallback` has set the
    flags)."""

    def __init__(self, counter: HostSyncCounter, trainer):
        self.counter = counter
        fetch = trainer.get_batch_samples

        def get_batch_samples(*args, **kwargs):
            counter.begin_step(trainer.state.global_step + 1)
            return fetch(*args, **kwargs)

        trainer.get_batch_samples = get_batch_samples

    def on_step_end(self, args, state, control, **kwargs):
        logs = control.should_log or control.should_evaluate or control.should_save or control.should_training_stop
        self.counter.step_kind(state.global_step, LOGGING if logs else PLAIN)


def build_hfl3_trainer(args: HostSyncArguments, optim: str, l3: bool, output_dir: str):
    """hfl3's pretraining trainer as `recipes/pretrain.py` builds it: its parser over these arguments and the checks
    its `main` runs first (`set_up_pretraining`), then `build_pretraining` (data, BPE, plan, model, trainer and its
    callbacks), at `args`' shape, with `optim` (`muon` or a Trainer optimizer) and one L3 layer when `l3`;
    `args.warmup_steps + args.steps` steps, logging (and with `args.evaluate` evaluating) at the last."""
    from hfl3.trainers.pretraining.builder import build_pretraining
    from hfl3.trainers.cli.setup import set_up_pretraining

    spec = importlib.util.spec_from_file_location("pretrain_recipe", REPO_ROOT / "recipes" / "pretrain.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)

    total = str(args.warmup_steps + args.steps)
    l3_sample_tokens = min(2_000_000, 100 * args.batch_size * args.seq_len)  # the LZW scan is slow Python
    cli = ["--output_dir", output_dir, "--dataset", args.dataset, "--tokenizer_train_chars", "5000000",
           "--vocab_size", str(args.vocab_size), "--l3_sample_tokens", str(l3_sample_tokens),
           "--max_eval_rows", str(args.batch_size), "--sample_prompts", "def", "--depth", str(args.depth),
           "--head_dim", str(args.head_dim), "--window_pattern", args.window_pattern, "--max_length",
           str(args.seq_len), "--optim", optim, "--per_device_train_batch_size", str(args.batch_size),
           "--per_device_eval_batch_size", str(args.batch_size), "--max_steps", total, "--logging_steps", total,
           "--eval_steps", total, "--warmup_steps", "1", "--bf16", str(args.bf16),
           "--use_cpu", str(not torch.cuda.is_available()), "--report_to", "none", "--disable_tqdm", "true",
           "--dataloader_num_workers", "0", "--attend_across_documents", str(args.attend_across_documents),
           "--eval_strategy", "steps" if args.evaluate else "no", "--torch_compile", str(args.compile)]
    cli += ["--l3_after_layers", str(max(0, args.depth // 2 - 1))] if l3 else []
    parser = recipe.make_parser()
    script_args, training_args, model_args = parser.parse_args_and_config(cli)
    setup = set_up_pretraining(script_args, training_args, model_args, parser.given_arguments(cli))
    return build_pretraining(script_args, training_args, model_args, setup).trainer


def count_hfl3(args: HostSyncArguments, arm: str) -> dict:
    """The host syncs of `arm`'s training run (`build_hfl3_trainer`), counted in this process (call it in a fresh
    one)."""
    optim, l3 = HFL3_ARMS[arm]
    with tempfile.TemporaryDirectory() as scratch:
        trainer = build_hfl3_trainer(args, optim, l3, str(Path(scratch) / "run"))
        counted = count_trainer(trainer, args)
    config = trainer.model.config
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    return dict(arm=arm, **counted, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                heads=config.num_attention_heads, l3_after_layers=config.l3_after_layers,
                optimizer=type(optimizer).__name__)


def count_trainer(trainer, args: HostSyncArguments) -> dict:
    """`trainer.train()` with its host syncs counted, step by step; returns `summarize`'s counts."""
    counter = HostSyncCounter()
    trainer.add_callback(StepMarks(counter, trainer))
    counter.mark_model_inputs(trainer.model)
    with counter:
        trainer.train()
    return summarize(counter, args)


def count_nanochat(args: HostSyncArguments, vocab_size: int) -> dict:
    """The host syncs of nanochat's own step (`vs_nanochat.run_nanochat`, eager), counted in this process."""
    import vs_nanochat

    counter = HostSyncCounter(args.nanochat_dir)

    class StepTicks:  # stands in for vs_nanochat's profiler, which the loop ticks after every step
        def __init__(self, *unused):
            pass

        def tick(self, step: int) -> None:
            counter.step_kind(step, PLAIN)
            counter.begin_step(step + 1)

    vs_nanochat.StepProfiler = StepTicks
    shape = dict(depth=args.depth, seq_len=args.seq_len, batch_size=args.batch_size, vocab_size=vocab_size,
                 head_dim=args.head_dim)
    nanochat_args = vs_nanochat.VsNanochatArguments(
        nanochat_dir=args.nanochat_dir, arms=["nanochat"], window_pattern=args.window_pattern, compile=False,
        bf16=args.bf16, steps=args.steps, warmup_steps=args.warmup_steps, **shape)
    counter.begin_step(1)
    with counter:
        vs_nanochat.run_nanochat(nanochat_args)
    return dict(arm="nanochat", **summarize(counter, args), vocab_size=vocab_size,
                hidden_size=nanochat_args.hidden_size, heads=nanochat_args.hidden_size // args.head_dim,
                l3_after_layers=[], optimizer="nanochat MuonAdamW")


def summarize(counter: HostSyncCounter, args: HostSyncArguments) -> dict:
    """Per kind of step (plain; logging/evaluating/saving) among the counted steps: syncs per step (the range over
    the steps, and the mean), per library per step, and per site per step (`library: site` → count, with the
    caller for a site inside torch)."""
    counted = range(args.warmup_steps + 1, args.warmup_steps + args.steps + 1)
    result = {}
    for kind in (PLAIN, LOGGING):
        steps = [step for step in counted if counter.step_kinds.get(step) == kind]
        syncs = [sync for sync in counter.syncs if sync["step"] in steps and sync["kind"] not in NOT_SYNCS]
        apart = {kind: Counter(f"{s['library']}: {s['site']} [{s['op']}]" for s in counter.syncs
                               if s["step"] in steps and s["kind"] == kind) for kind in NOT_SYNCS}
        per_step = [sum(sync["step"] == step for sync in syncs) for step in steps]
        sites = Counter(f"{s['library']}: {s['site']} [{s['kind']}]"
                        + (f" via {s['caller']}" if s["library"] == "torch" and s["caller"] else "") for s in syncs)
        result[kind] = dict(
            steps=steps, per_step=per_step, mean=sum(per_step) / len(steps) if steps else None,
            by_library={name: count / len(steps) for name, count in Counter(s["library"] for s in syncs).items()},
            by_kind={name: count / len(steps) for name, count in Counter(s["kind"] for s in syncs).items()},
            by_site={site: count / len(steps) for site, count in sites.most_common()},
            **{f"{kind}s": {site: count / len(steps) for site, count in sites.most_common()}
               for kind, sites in apart.items()},
        )
    return result


def print_table(args: HostSyncArguments, results: list[dict]) -> None:
    print(f"\nHost syncs per optimizer step (CPU count): depth {args.depth}, {args.batch_size}×{args.seq_len} tokens, "
          f"bf16 {args.bf16}, window {args.window_pattern}, steps {args.warmup_steps + 1}…"
          f"{args.warmup_steps + args.steps} counted")
    print(f"{'arm':<16}{'plain step':>11}{'log step':>10}{'deferred':>10}{'host reads':>12}  plain step by library")
    for r in results:
        plain, logging_ = r[PLAIN], r[LOGGING]
        libraries = ", ".join(f"{name} {count:g}" for name, count in sorted(plain["by_library"].items()))
        log_mean = "-" if logging_["mean"] is None else f"{logging_['mean']:g}"
        apart = [sum(plain[f"{kind}s"].values()) for kind in (DEFERRED, HOST_READ)]
        print(f"{r['arm']:<16}{plain['mean']:>11g}{log_mean:>10}{apart[0]:>10g}{apart[1]:>12g}  {libraries or 'none'}")
    for r in results:
        print(f"\n{r['arm']}, plain step (syncs per step, site):")
        for site, count in r[PLAIN]["by_site"].items():
            print(f"  {count:5g}  {site}")
        for site, count in r[PLAIN][f"{DEFERRED}s"].items():
            print(f"  {count:5g}  {site} (deferred: not a sync)")
        if r[LOGGING]["steps"]:
            print(f"{r['arm']}, logging/evaluating step {r[LOGGING]['steps']}: {r[LOGGING]['mean']:g} syncs, by "
                  "library " + ", ".join(f"{k} {v:g}" for k, v in sorted(r[LOGGING]["by_library"].items())))


def main(args: HostSyncArguments) -> dict:
    """Count every arm of `args.arms`, each in a fresh process; print the table. Returns (and with `--json`
    writes) `{"args", "machine", "torch", "shape", "results"}`."""
    results = []
    for arm in sorted(args.arms, key=lambda arm: arm == "nanochat"):  # nanochat last, at hfl3's vocabulary
        if arm == "nanochat":  # its Linear layers cast to this dtype at import (nanochat/common.py)
            vocab_size = results[0]["vocab_size"] if results else args.vocab_size
            env = {"NANOCHAT_DTYPE": "bfloat16" if args.bf16 else "float32"}
            results.append(in_fresh_process(count_nanochat, args, vocab_size, env=env))
        else:
            results.append(in_fresh_process(count_hfl3, args, arm))
        print(f"{arm}: {results[-1][PLAIN]['mean']:g} host syncs per plain step", flush=True)
    print_table(args, results)
    dataset = shown_path(args.dataset) if Path(args.dataset).exists() else args.dataset
    recorded = asdict(args) | {"nanochat_dir": shown_path(args.nanochat_dir), "dataset": dataset}
    return write_result(args.json, {"args": recorded, "machine": machine_name("cpu"), "torch": torch.__version__,
                                    "shape": asdict(ModelShape.of(args)), "results": results})


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(HfArgumentParser(HostSyncArguments).parse_args_into_dataclasses()[0])
