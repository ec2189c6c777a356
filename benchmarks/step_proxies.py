"""Proxies on the CPU that predict the GPU's pretraining step: hfl3's recipe step beside nanochat's own, at nanochat's
d12 shape, per optimizer step — host syncs, host↔device copies, fills, the compiled graph (graphs, breaks, kernels),
and the bytes of parameters, gradients, optimizer state and tensors saved for backward. The GPU profile these
predict: `vs_nanochat.py --profile_dir` (dev/LOG.md, 2026-11-28).

Arms (each in a fresh process; `host_syncs.py`'s builders):
- `nanochat`: nanochat's GPT + MuonAdamW from a checkout (`--nanochat_dir`), built and stepped as
  `vs_nanochat.build_nanochat` / `nanochat_step` do (base_train's loop, `torch.compile(model, dynamic=False)`, its
  own compiled AdamW and Muon steps), `NANOCHAT_DTYPE=bfloat16`, rows preloaded on the device as in that harness;
- `hfl3_muon`, `hfl3_muon_l3` (also `hfl3_adamw`, `hfl3_adamw_l3`): the recipe's trainer
  (`host_syncs.build_hfl3_trainer`: `recipes/pretrain.py`'s parser and `build_pretraining`), `--bf16` (autocast, with
  `--use_cpu`), `--torch_compile` (accelerate's `torch.compile(model)`, no fullgraph, as on the GPU), rows attending
  across documents as in the GPU suite's `pretrain` section (`--attend_across_documents false`: the recipe's default,
  block-causal), and the optimizer on its GPU path (below).

Every arm runs the same steps: 1 eager warm-up step (the optimizer state is made there), `--eager_steps` eager counted
steps, 2 compiled warm-up steps (compilation), `--steps` compiled counted steps, and one last step where the Trainer
logs (hfl3; counted apart). Nothing else differs between the phases: `torch.compiler.set_stance("force_eager")` runs
the compiled model and optimizer functions eagerly in the first phase.

What is counted, per optimizer step, by source (the innermost frame outside torch's plumbing: hfl3, transformers,
accelerate, torch, nanochat, or "compiled graph" for what Inductor's generated code calls):
1. host syncs: exactly what `host_syncs.py` counts (its `HostSyncCounter`, which tells device tensors from host ones
   on a CPU), plus the blocking copies of host tensors to the device, which CUDA runs as `cudaMemcpyAsync` +
   `cudaStreamSynchronize` (a copy from pageable or pinned memory without `non_blocking`);
2. host↔device copies: host→device (`Tensor.to(device)` of a host tensor: the Trainer's batch, `num_items_in_batch`;
   `device.copy_(host)`), blocking or `non_blocking`; device→host (`.item()`, `.cpu()`, `.tolist()`, `host.copy_
   (device)`); device→device copies of one dtype between dense tensors of equal strides (`copy_`, `clone`, `_to_copy`
   without a cast, slice assignment), which CUDA runs as `Memcpy DtoD`, apart from strided copies (a copy kernel) and
   `_foreach_copy_` (one `multi_tensor_apply` kernel on CUDA);
3. zeroings and fills of device tensors: `zero_`, `zeros`, `zeros_like`, `new_zeros` (torch ≥ 2.11 zeroes CUDA tensors
   with `cudaMemsetAsync`: the profile's `Memset`), and fill kernels (`fill_`, `full`, `full_like`, `new_full`, `ones*`,
   `masked_fill`);
4. the compiled graph: graphs and graph breaks with their reasons (`torch._dynamo`'s counters), recompiles during the
   counted steps (0 expected), and per step the compiled graphs called, the kernels Inductor generated that they
   launch (C++ kernels on a CPU, via `torch._inductor.config.cpp.enable_kernel_profile` and the profiler; Triton on a
   GPU), the extern/fallback ops they call (matmuls, SDPA, custom ops) and the aten ops that run outside any graph
   (each at least one kernel on a GPU; views and allocations left out); Inductor's kernels defined and IR nodes
   before fusion (`torch._inductor.metrics`);
5. bytes at the full d12 size, exactly: parameters, gradients (at the optimizer step) and optimizer state (storages
   counted once: hfl3's Muon state is views into stacks), by dtype and by group (matrices, embeddings, value
   embeddings, lm_head, scalars, L3 tables); and the tensors saved for backward by one training forward at the GPU
   shape `--gpu_batch_size` × `--gpu_seq_len` (16 × 2048), without running it: eager, under `FakeTensorMode` with
   `saved_tensors_hooks` (storages counted once, parameters apart: they are held anyway); compiled, the forward graph
   that Inductor's own partitioner (`compile_fx`, min-cut rematerialisation) makes at that shape, its outputs other
   than the loss, each counted once with its base (the graph is traced with fake tensors and never run).

Rows 1–3 are counted in both phases: "eager" is what the code asks for; "compiled" what still runs as separate ops
once compiled (a `TorchDispatchMode` with `ignore_compile_internals`, so Inductor's fused kernels are not seen, only
what its generated code dispatches; Python-level copies are seen by wrapping `Tensor.to/cpu/tolist/numpy` after the
compilation, which the counted steps check did not trigger a recompile). The compiled column is the GPU's prediction.

Per-token scaling to the GPU shape: the model's forward + backward is counted eagerly once more at 1× and 2× the CPU
shape's tokens (rows doubled); a site whose count differs is taken as linear in tokens, `a + b·N`, and its counts
are scaled to N = 16 × 2048 in the `@GPU` columns (exact for loops over fixed-size chunks when both N are multiples
of the chunk: the chunked loss's 256 rows at vocabulary 32768). Other counts do not depend on the tokens.

Limits (what a CPU cannot show): CUDA-only code paths are not run — on CUDA hfl3's loss is Liger's fused linear
cross-entropy (outside the compiled graph: a graph break, its `.item()` sync, 3 zeroings, a slice copy per chunk of
1024 rows, its Triton kernels and per-chunk GEMMs), on a CPU the chunked PyTorch loss inside the graph (chunks of
256 rows); the L3 lookup's chunks are 65,536 pairs on CUDA, 8 MiB / (4·hidden) pairs on a CPU; SDPA runs cuDNN/flash
on CUDA, the CPU flash kernel here; Inductor fuses differently for C++ and Triton (kernel counts are a proxy for the
difference between arms, not the GPU's count); cuBLAS/cuDNN's own memsets and the caching allocator are not seen;
CPU autocast's op lists differ from CUDA's in a few ops (saved dtypes). The optimizer runs its GPU path here:
MuonAdamW's compiled stack update (`compile_update`, CUDA's default) with Polar Express in bf16 (CUDA's default; fp32
on a CPU by default) and torch's fused AdamW (CUDA's `fused=True`). Device tensors are told apart as
`host_syncs.py` does (its docstring: a tensor made outside the model from host values is a host tensor).

    OMP_NUM_THREADS=1 python benchmarks/step_proxies.py --nanochat_dir build/nanochat \\
        --json benchmarks/results/step_proxies_cpu_d12.json          # d12, 2 × 256 tokens, bf16, compiled
    python benchmarks/step_proxies.py --arms hfl3_muon --depth 2 --vocab_size 2048 --head_dim 64 --seq_len 64 \\
        --eager_steps 1 --steps 1 --saved_tensors false               # a tiny shape, seconds-to-minutes

The counters, the graph's summaries, the byte counts and the scaling live in `benchmarks/step_counting.py`. Get
nanochat with `git clone https://github.com/karpathy/nanochat build/nanochat` (`build/` is git-ignored).
"""

import contextlib
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from transformers import HfArgumentParser

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_syncs  # noqa: E402
import step_counting  # noqa: E402
from common import ModelShape, in_fresh_process, machine_name, shown_path, write_result  # noqa: E402
from host_syncs import HFL3_ARMS, LOGGING, PLAIN, HostSyncArguments  # noqa: E402
from step_counting import (CAST, COPY, D2D_FOREACH, D2D_MEMCPY, D2D_STRIDED, D2H, D2H_NB, FILL,  # noqa: E402
                           FILL_KERNEL, H2D, H2D_NB, NUM_ITEMS, OP, SYNC, ZEROING, GradientCapture, RuntimeStepCounter,
                           StepEventCounter, copies_to_host, generated_code_summary, profile_summary, saved_compiled,
                           saved_eager, scaled_total, state_bytes, token_fit)

step_counting.HARNESS_FILES.add(__file__)
ARMS = ("nanochat", *HFL3_ARMS)
GROUPS = ("matrices", "embeddings", "value embeddings", "lm_head", "scalars", "L3 tables")
# which table row each kind of count goes to, in order
COPY_ROWS = (H2D, H2D_NB, NUM_ITEMS, D2H, D2H_NB, D2D_MEMCPY, D2D_STRIDED, D2D_FOREACH)
FILL_ROWS = (ZEROING, FILL_KERNEL)


@dataclass
class StepProxyArguments(HostSyncArguments):
    arms: list[str] = field(default_factory=lambda: ["nanochat", "hfl3_muon", "hfl3_muon_l3"],
                            metadata={"help": f"any of {ARMS}"})
    depth: int | None = field(default=12, metadata={"help": "decoder layers (nanochat's d12)"})
    seq_len: int | None = field(default=256, metadata={"help": "row length on the CPU"})
    batch_size: int | None = field(default=2, metadata={"help": "rows per step on the CPU"})
    vocab_size: int | None = field(default=32768, metadata={"help": "the recipe's BPE vocabulary, also nanochat's"})
    head_dim: int | None = field(default=128, metadata={"help": "head width"})
    attend_across_documents: bool = field(default=True, metadata={
        "help": "hfl3: packed documents attend to each other, as the GPU suite's pretrain section and nanochat"})
    compile: bool = field(default=True, metadata={"help": "torch.compile as the GPU run (false: both phases eager)"})
    evaluate: bool = field(default=False, metadata={"help": "evaluate at the last step (the GPU suite does not)"})
    eager_steps: int = field(default=1, metadata={"help": "eager counted steps, after one eager warm-up (0: none)"})
    warmup_steps: int = field(default=2, metadata={"help": "compiled warm-up steps (compilation happens there)"})
    steps: int = field(default=2, metadata={"help": "compiled counted steps; then one more, where the Trainer logs"})
    gpu_batch_size: int = field(default=16, metadata={"help": "rows per step on the GPU (scaling, saved tensors)"})
    gpu_seq_len: int = field(default=2048, metadata={"help": "row length on the GPU (scaling, saved tensors)"})
    saved_tensors: bool = field(default=True, metadata={"help": "count the tensors saved for backward at the GPU "
                                                        "shape (eager under FakeTensorMode; compiled graph)"})

    def __post_init__(self):
        if self.eager_steps < 0 or self.warmup_steps < 1 or self.steps < 1:
            raise ValueError(f"--eager_steps {self.eager_steps} must be >= 0, --warmup_steps {self.warmup_steps} and "
                             f"--steps {self.steps} >= 1")
        steps, warmup = self.steps, self.warmup_steps
        self.steps, self.warmup_steps = 2, 1  # HostSyncArguments' own checks
        super().__post_init__()
        self.steps, self.warmup_steps = steps, warmup
        unknown = set(self.arms) - set(ARMS)
        if unknown:
            raise ValueError(f"--arms: unknown {sorted(unknown)}; expected some of {ARMS}")

    @property
    def total_steps(self) -> int:
        """Eager warm-up, eager counted, compiled warm-up, compiled counted, the last (logging) step."""
        return 1 + self.eager_steps + self.warmup_steps + self.steps + 1

    @property
    def gpu_tokens(self) -> int:
        return self.gpu_batch_size * self.gpu_seq_len


# ---- the phases of one arm's steps --------------------------------------------------------------------------------


class Phases:
    """Steps 1 … `args.total_steps` of one arm: `begin_step(n)` where step n starts, `step_kind(n, kind)` where it
    ends. Switches the compile stance, enters and leaves the counters, profiles the compiled counted steps, and
    collects the compiled graph's metrics. `device_tensors()` returns what lives on the device at a step's start
    (parameters, buffers, optimizer state, preloaded rows)."""

    def __init__(self, args: StepProxyArguments, device_tensors, nanochat_dir: str | None = None):
        self.args, self.device_tensors, self.nanochat_dir = args, device_tensors, nanochat_dir
        self.eager = StepEventCounter(nanochat_dir)
        self.runtime = RuntimeStepCounter(nanochat_dir)
        first_eager = 2
        self.eager_steps = list(range(first_eager, first_eager + args.eager_steps))
        self.compile_step = first_eager + args.eager_steps
        self.counted = list(range(self.compile_step + args.warmup_steps,
                                  self.compile_step + args.warmup_steps + args.steps))
        self.last = args.total_steps
        self.active: StepEventCounter | None = None
        self.step_seconds: dict[int, float] = {}
        self.step_kinds: dict[int, str] = {}
        self.graphs = {}
        self.profile = None
        self._profiler = None
        self._started = None
        self._modules_before = 0
        self._restore = []
        self.step = 0
        self.graph_copies_to_host: list[str] = []  # sites of `.cpu()`/`.item()` that a compiled graph keeps

    def begin_step(self, step: int) -> None:
        self.step = step
        if step == 1 and self.args.compile:
            torch.compiler.set_stance("force_eager")
        if step in self.eager_steps and self.active is None:
            self._enter(self.eager)
        if step == self.compile_step:
            self._leave()
            self._start_compiled_phase()
        if step == self.counted[0]:
            if self.args.compile:
                self.graphs["after warm-up"] = self._graph_state()
            self._enter(self.runtime)
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU])
            self._profiler.__enter__()
        if step == self.last and self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self.profile = profile_summary(self._profiler, len(self.counted))
            self._profiler = None
        if self.active is not None:
            self.active.begin_step(step)
            self.active.mark_device(*self.device_tensors())
        self._started = time.perf_counter()

    def step_kind(self, step: int, kind: str) -> None:
        self.step_seconds[step] = time.perf_counter() - self._started
        self.step_kinds[step] = kind
        for counter in (self.eager, self.runtime):
            counter.step_kind(step, kind)

    def finish(self) -> None:
        self._leave()
        for restore in self._restore:
            restore()
        if self.args.compile:
            self.graphs["after counted steps"] = self._graph_state()

    def mark_device(self, *trees) -> None:
        """Mark tensors as device tensors for the counter in use (gradients, the loss: a compiled graph's outputs)."""
        if self.active is not None:
            self.active.mark_device(*trees)

    def _enter(self, counter) -> None:
        self.active = counter
        counter.__enter__()

    def _leave(self) -> None:
        if self.active is not None:
            self.active.__exit__(None, None, None)
            self.active = None

    def _start_compiled_phase(self) -> None:
        if not self.args.compile:
            return
        from torch._dynamo.utils import counters
        from torch._inductor import compile_fx, metrics
        from torch._inductor.codecache import PyCodeCache

        counters.clear()
        metrics.reset()
        self._modules_before = len(PyCodeCache.modules)
        original = compile_fx.compile_fx

        def compile_and_scan(gm, *args, **kwargs):  # dynamo's inductor backend calls this with each graph
            self.graph_copies_to_host.extend(copies_to_host(gm))
            return original(gm, *args, **kwargs)

        compile_fx.compile_fx = compile_and_scan
        self._restore.append(lambda: setattr(compile_fx, "compile_fx", original))
        torch.compiler.set_stance("default")

    def _graph_state(self) -> dict:
        from torch._dynamo.utils import counters
        from torch._inductor import metrics
        from torch._inductor.codecache import PyCodeCache

        code = generated_code_summary(PyCodeCache.modules[self._modules_before:])
        return dict(stats=dict(counters["stats"]), graph_breaks=dict(counters["graph_break"]),
                    copies_to_host=dict(Counter(self.graph_copies_to_host)),
                    recompiles=sum(counters["recompiles"].values()) if "recompiles" in counters else 0,
                    inductor=dict(kernels_generated=metrics.generated_kernel_count,
                                  ir_nodes_pre_fusion=metrics.ir_nodes_pre_fusion), generated_code=code)

    def summary(self) -> dict:
        """Counts per step by phase (eager, compiled plain, compiled logging), the graph's metrics, step seconds."""
        plain = [s for s in self.counted if self.step_kinds.get(s) == PLAIN]
        logging_steps = [s for s in (self.last,) if self.step_kinds.get(s) == LOGGING]
        out = dict(eager=self.eager.summarize_events(self.eager_steps) if self.eager_steps else None,
                   compiled=self.runtime.summarize_events(plain),
                   compiled_logging_step=self.runtime.summarize_events(logging_steps) if logging_steps else None,
                   graphs=self.graphs, profile=self.profile,
                   step_seconds={str(k): round(v, 3) for k, v in sorted(self.step_seconds.items())})
        if self.args.compile:
            compiled_seconds = [self.step_seconds[s] for s in self.counted if s in self.step_seconds]
            warm = [self.step_seconds.get(s, 0.0) for s in range(self.compile_step, self.counted[0])]
            if compiled_seconds:
                out["compile_seconds"] = sum(warm) - len(warm) * min(compiled_seconds)
        return out


# ---- the arms -----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def arm_settings():
    """Inductor's C++ kernels recorded by the profiler, one compile thread (a shared CPU box), no FX graph or autograd
    cache (every graph is lowered here, so Inductor's metrics count it; the C++ stays cached); the compile stance put
    back at the end (an arm runs in a fresh process, a test in its own)."""
    import torch._inductor.config as inductor_config

    settings = {"cpp.enable_kernel_profile": True, "compile_threads": 1, "fx_graph_cache": False}
    with inductor_config.patch(settings), torch._functorch.config.patch(enable_autograd_cache=False):
        try:
            yield
        finally:
            torch.compiler.set_stance("default")


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    if inner is None:
        return []
    return [value for state in inner.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


def gpu_path(optimizer, compile_update: bool) -> list[str]:
    """MuonAdamW as it runs on CUDA: its stack update compiled (`compile_update`, CUDA's default), Polar Express in
    bf16 (CUDA's default), AdamW fused (`fused=True`, torch's CPU kernel here). Returns what was changed."""
    from hfl3.optim import muon

    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, muon.MuonAdamW):
        return []
    changed = []
    if compile_update:
        inner.compile_update = True
        changed.append("compile_update=True")
    for group in inner.param_groups:
        if group["kind"] == "muon" and group.get("orthogonalize_dtype") == "auto":
            group["orthogonalize_dtype"] = "bfloat16"
            changed.append(f"{group.get('name')}: orthogonalize_dtype=bfloat16")
    build_layout = inner._build_layout

    def build_fused_layout(group):  # this optimizer's AdamW lists fused, as on CUDA (torch has the CPU kernel)
        layout = build_layout(group)
        for part in layout.parts:
            if isinstance(part, muon._AdamWLists):
                part.fused = all(param.is_floating_point() for param in part.params)
        return layout

    inner._build_layout = build_fused_layout
    changed.append("AdamW fused=True")
    return changed


def measure_hfl3(args: StepProxyArguments, arm: str) -> dict:
    """hfl3's recipe step (`host_syncs.build_hfl3_trainer`) through the phases, in this process (call it in a fresh
    one)."""
    with arm_settings():
        return _measure_hfl3(args, arm)


def _measure_hfl3(args: StepProxyArguments, arm: str) -> dict:
    optim, l3 = HFL3_ARMS[arm]
    build_args = replace(args, warmup_steps=args.total_steps - 1, steps=1)  # the recipe's --max_steps: every step
    with tempfile.TemporaryDirectory() as scratch:
        trainer = host_syncs.build_hfl3_trainer(build_args, optim, l3, str(Path(scratch) / "run"))
        model = trainer.model
        phases = Phases(args, lambda: [*model.parameters(), *model.buffers(),
                                       *optimizer_state_tensors(trainer.optimizer)])
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(lambda param: phases.mark_device(param.grad))
        shims, captured = [], {}
        create_optimizer = trainer.create_optimizer

        def create_gpu_path_optimizer(*a, **k):
            optimizer = create_optimizer(*a, **k)
            if not captured:
                shims.extend(gpu_path(optimizer, args.compile))
                captured["grads"] = GradientCapture(optimizer, model.parameters(), lambda: phases.step,
                                                    phases.counted[0])
            return optimizer

        trainer.create_optimizer = create_gpu_path_optimizer
        compute_loss = trainer.compute_loss

        def counted_compute_loss(model_, inputs, *a, **k):
            phases.mark_device(inputs, a, k)  # the batch and num_items_in_batch, on the device
            out = compute_loss(model_, inputs, *a, **k)
            phases.mark_device(out)  # a compiled graph's outputs are made below the dispatch mode
            return out

        trainer.compute_loss = counted_compute_loss
        trainer.add_callback(host_syncs.StepMarks(phases, trainer))
        trainer.train()
        phases.finish()
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        l3_tables = {id(p) for g in optimizer.param_groups if g.get("name") == "l3_table" for p in g["params"]}
        result = dict(arm=arm, **phases.summary(), shims=shims, optimizer=type(optimizer).__name__,
                      bytes=state_bytes(model.named_parameters(), optimizer, captured["grads"].grads, l3_tables))
        config = model.config
        result |= dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                       heads=config.num_attention_heads, l3_after_layers=config.l3_after_layers)
        torch.compiler.set_stance("force_eager")
        model.train()

        def forward(ids, compiled=None):
            tokens = torch.tensor(ids.numel(), device=ids.device)
            with trainer.autocast_smart_context_manager():
                return (model if compiled is None else compiled)(input_ids=ids, labels=ids, num_items_in_batch=tokens).loss

        def pass_at(factor: int, counter) -> None:
            ids = torch.randint(1, config.vocab_size, (factor * args.batch_size, args.seq_len))
            counter.mark_device(ids)
            forward(ids).backward()
            model.zero_grad(set_to_none=True)

        result["token_fits"] = token_fit(pass_at, args.batch_size * args.seq_len, None)
        if args.saved_tensors:
            gpu_ids = lambda: torch.randint(1, config.vocab_size, (args.gpu_batch_size, args.gpu_seq_len))  # noqa
            result["saved_eager"] = _attempt(saved_eager, lambda mode: forward(gpu_ids()), list(model.parameters()))
            torch.compiler.set_stance("default")
            result["saved_compiled"] = _attempt(saved_compiled, model,
                                                lambda compiled: forward(gpu_ids(), compiled))
    return result


def measure_nanochat(args: StepProxyArguments, vocab_size: int) -> dict:
    """nanochat's step (`vs_nanochat.build_nanochat`, `nanochat_step`) through the phases, in this process."""
    with arm_settings():
        return _measure_nanochat(args, vocab_size)


def _measure_nanochat(args: StepProxyArguments, vocab_size: int) -> dict:
    import vs_nanochat

    nanochat_args = vs_nanochat.VsNanochatArguments(
        nanochat_dir=args.nanochat_dir, arms=["nanochat"], window_pattern=args.window_pattern, compile=args.compile,
        bf16=args.bf16, steps=1, warmup_steps=1, depth=args.depth, seq_len=args.seq_len, batch_size=args.batch_size,
        vocab_size=vocab_size, head_dim=args.head_dim)
    phases = Phases(args, lambda: [*module.parameters(), *module.buffers(), *optimizer_state_tensors(optimizer),
                                   built["rows"]], args.nanochat_dir)
    phases.begin_step(1)  # the stance before anything is compiled
    built = vs_nanochat.build_nanochat(nanochat_args, args.total_steps)
    module, optimizer = built["module"], built["optimizer"]
    for param in module.parameters():
        param.register_post_accumulate_grad_hook(lambda param: phases.mark_device(param.grad))
    grads = GradientCapture(optimizer, module.parameters(), lambda: phases.step, phases.counted[0])
    for step in range(1, args.total_steps + 1):
        if step > 1:
            phases.begin_step(step)
        phases.mark_device(vs_nanochat.nanochat_step(built, step, args.batch_size))
        phases.step_kind(step, PLAIN)
    phases.finish()
    result = dict(arm="nanochat", **phases.summary(), shims=[], optimizer="nanochat MuonAdamW",
                  bytes=state_bytes(module.named_parameters(), optimizer, grads.grads, set()),
                  vocab_size=vocab_size, hidden_size=nanochat_args.hidden_size,
                  heads=nanochat_args.hidden_size // args.head_dim, l3_after_layers=[],
                  precision=built["precision"], attention=built["attention"])
    torch.compiler.set_stance("force_eager")
    rows = built["rows"]

    def pass_at(factor: int, counter) -> None:
        batch = rows[: factor * args.batch_size]
        counter.mark_device(batch)
        module(batch[:, :-1].contiguous(), batch[:, 1:].contiguous()).backward()
        module.zero_grad(set_to_none=True)

    result["token_fits"] = token_fit(pass_at, args.batch_size * args.seq_len, args.nanochat_dir)
    if args.saved_tensors:
        def forward(compiled=None):
            ids = torch.randint(1, vocab_size, (args.gpu_batch_size, args.gpu_seq_len + 1))
            return (module if compiled is None else compiled)(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())

        result["saved_eager"] = _attempt(saved_eager, lambda mode: forward(), list(module.parameters()))
        torch.compiler.set_stance("default")
        result["saved_compiled"] = _attempt(saved_compiled, module, forward)
    return result


def _attempt(function, *arguments):
    """`function(*arguments)`, or `{"error": ...}` where it raised (a measurement that a shape cannot take)."""
    try:
        return function(*arguments)
    except Exception as error:  # noqa: BLE001 - reported in the table, the other rows stand
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"}


# ---- the table ----------------------------------------------------------------------------------------------------

# Today's GPU profile (vs_nanochat.py --profile_dir, H100, 2026-11-28, commit 53347dd; 3 compiled d12 steps, 16 × 2048,
# the last a logging step): hfl3 / nanochat, per step. The check that the rows predict.
GPU_PROFILE = {
    "syncs": "5 / 0 cudaStreamSynchronize",
    "copies": "48 / 0 cudaMemcpyAsync",
    D2D_MEMCPY: "43 / 0 Memcpy DtoD",
    D2D_FOREACH: "multi_tensor_apply ~3 ms / 0",
    ZEROING: "257 / 196 Memset",
    "kernels": "1,375 / 1,100 device events",
    "peak": "17.6 / 15.9 GB peak",
}
# Known causes, by a pattern in a site: what the notes say where hfl3 counts more than nanochat
CAUSES = (
    ("num_items_in_batch", "transformers' Trainer copies the step's token count to the device, blocking"),
    ("_prepare_input", "the Trainer copies each batch from the host, blocking (nanochat's harness preloads its rows "
                       "on the device)"),
    ("linear_cross_entropy", "the chunked loss, a CPU path (CUDA runs Liger's: below)"),
    ("trainers/metrics.py", "the step's metrics (NaN/inf flags, loss tally: StepMetrics), kept on the device (no sync)"),
    ("(pair_scores)", "the L3 lookup's chunks of pairs (65,536 a chunk on CUDA: scaled so)"),
    ("lookup", "the L3 lookup's custom ops (Python bodies, run eagerly in a compiled step too)"),
    ("muon.py", "MuonAdamW"),
)
# What hfl3's step does on CUDA that a CPU cannot run (docs/design.md, decision 12), counted from the code: Liger's
# from Liger-Kernel's ops/fused_linear_cross_entropy.py (the GPU run had liger-kernel 0.8.5), at 16 × 2048 × 32768
CUDA_ONLY = (
    "Liger's fused loss (hfl3's on CUDA; the chunked loss counted above is the CPU's): outside the compiled graph "
    "(1 graph break); per step 2 host syncs (`target_mask.sum().item()`, `torch.equal(grad_output, "
    "torch.tensor(1.0, device))`, which also copies its 1.0 to the device), 3 zeroings (`grad_input`, "
    "`grad_weight`, `loss_1d`), 32 chunks of 1,024 rows: 32 `liger_cross_entropy_kernel`, 32 `grad_input[chunk] "
    "= ...` slice copies (Memcpy DtoD) and their GEMMs",
    "L3's pair count in a compiled graph: `.cpu()` (row 4's copies kept inside the graphs), a blocking device→host "
    "copy on CUDA, one per forward; eager, it is copied without blocking (`pair_count_on_host`)",
    "inside the compiled graphs: Triton's fusion and its zero-initialised buffers (Memset), cuBLAS and cuDNN/flash "
    "SDPA kernels (C++ and CPU kernels here)",
)


def _cell(value, scaled=None, digits=1) -> str:
    if value is None:
        return "n/a"
    text = f"{value:,.{digits}f}".rstrip("0").rstrip(".") if isinstance(value, float) else f"{value:,}"
    if scaled is not None and abs(scaled - value) > 1e-9:
        text += f" → {_cell(scaled, digits=digits)}"
    return text


def _gb(nbytes) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 1e9:.3f}"


def _count(result: dict, category: str, kinds=None, phase="compiled", gpu=None) -> float | None:
    summary = result.get(phase)
    if not summary:
        return None
    if gpu is not None:
        return scaled_total(summary, category, result["token_fits"], *gpu, result["hidden_size"], kinds=kinds)
    by_kind = summary[category]["by_kind"]
    return sum(v for k, v in by_kind.items() if kinds is None or k in kinds)


def _notes(results: list[dict], category: str, kinds=None) -> str:
    """hfl3's sites of `category` (`kinds`) where an hfl3 arm counts more than nanochat: the largest, with causes."""
    by_arm = {r["arm"]: r for r in results}
    nanochat = by_arm.get("nanochat")
    reference = _count(nanochat, category, kinds) if nanochat else 0.0
    sites = Counter()
    for result in results:
        if result["arm"] == "nanochat" or (_count(result, category, kinds) or 0) <= (reference or 0):
            continue
        for key, count in result["compiled"][category]["by_site"].items():
            if kinds is None or key.split(" | ", 1)[0] in kinds:
                sites[key.split(" | ", 1)[1]] = max(sites[key.split(" | ", 1)[1]], count)
    notes = []
    for site, count in sites.most_common(2):
        cause = next((text for pattern, text in CAUSES if pattern in site), None)
        notes.append(f"{site} ×{count:g}" + (f": {cause}" if cause else ""))
    return "; ".join(notes)


def table_rows(args: StepProxyArguments, results: list[dict]) -> list[dict]:
    """The table: one dict per row with `row`, a value per arm (the CPU count → scaled to the GPU shape), `gpu` (the
    profile's hfl3 / nanochat) and `notes`."""
    gpu = (args.batch_size * args.seq_len, args.gpu_tokens)
    rows = []

    def add(row, values, gpu_check="", notes=""):
        rows.append(dict(row=row, **{r["arm"]: values(r) for r in results}, gpu=gpu_check, notes=notes))

    sync_kinds = sorted({k for r in results for k in r["compiled"][SYNC]["by_kind"]})
    add("1. host syncs per plain step, compiled", lambda r: _cell(_count(r, SYNC), _count(r, SYNC, gpu=gpu)),
        GPU_PROFILE["syncs"], _notes(results, SYNC))
    for kind in sync_kinds:
        add(f"   {kind}", lambda r, k=kind: _cell(_count(r, SYNC, {k}), _count(r, SYNC, {k}, gpu=gpu)))
    add("   eager step (what the code asks for)", lambda r: _cell(_count(r, SYNC, phase="eager")))
    add("2. host↔device copies, compiled", lambda r: _cell(_count(r, COPY, set(COPY_ROWS)),
                                                           _count(r, COPY, set(COPY_ROWS), gpu=gpu)),
        GPU_PROFILE["copies"])
    for kind in COPY_ROWS:
        kinds = {kind, kind + " (non_blocking)"}
        add(f"   {kind}", lambda r, k=kinds: _cell(_count(r, COPY, k), _count(r, COPY, k, gpu=gpu)),
            GPU_PROFILE.get(kind, ""), _notes(results, COPY, kinds))
    add("   eager step: copies (casts apart)", lambda r: _cell(_count(r, COPY, set(COPY_ROWS), phase="eager")))
    add("3. zeroings and fills, compiled", lambda r: _cell(_count(r, FILL), _count(r, FILL, gpu=gpu)), "",
        _notes(results, FILL))
    for kind in FILL_ROWS:
        add(f"   {kind}", lambda r, k=kind: _cell(_count(r, FILL, {k}), _count(r, FILL, {k}, gpu=gpu)),
            GPU_PROFILE.get(kind, ""), _notes(results, FILL, {kind}))
    add("   eager step", lambda r: _cell(_count(r, FILL, phase="eager")))

    def graph(r, key):
        state = r["graphs"].get("after warm-up") or {}
        return state.get("stats", {}).get(key) if state else None

    add("4. compiled graphs (dynamo)", lambda r: _cell(graph(r, "unique_graphs")))
    add("   graph breaks", lambda r: _cell(sum((r["graphs"].get("after warm-up") or {}).get("graph_breaks", {})
                                                   .values()) if r["graphs"] else None),
        "", "; ".join(f"{r['arm']}: {reason}" for r in results
                      for reason in (r["graphs"].get("after warm-up") or {}).get("graph_breaks", {})))
    add("   device→host copies kept inside the graphs (a sync each on CUDA)", lambda r: _cell(sum(
        (r["graphs"].get("after warm-up") or {}).get("copies_to_host", {}).values()) if r["graphs"] else None), "",
        "; ".join(f"{r['arm']}: {site} ×{n}" for r in results
                  for site, n in (r["graphs"].get("after warm-up") or {}).get("copies_to_host", {}).items()))
    add("   recompiles in the counted steps", lambda r: _cell(
        (graph_after(r, "unique_graphs") or 0) - (graph(r, "unique_graphs") or 0) if r["graphs"] else None))
    for key, label in (("graph_calls", "compiled graph calls per step"),
                       ("kernels", "Inductor kernels launched per step (C++ here)"),
                       ("extern_ops", "extern/fallback ops called by the graphs per step")):
        add(f"   {label}", lambda r, k=key: _cell((r.get("profile") or {}).get(k)),
            GPU_PROFILE["kernels"] if key == "kernels" else "")
    add("   device ops outside the graphs per step", lambda r: _cell(r["compiled"][OP]["total"]), "",
        "; ".join(f"{r['arm']}: " + ", ".join(f"{k} {v:g}" for k, v in list(r["compiled"][OP]["by_source"].items())[:5])
                  for r in results))
    add("   eager step: device ops (each a kernel or more)", lambda r: _cell((r.get("eager") or {}).get(OP, {})
                                                                          .get("total")))
    add("   Inductor kernels defined / IR nodes before fusion", lambda r: "/".join((
        _cell(((r["graphs"].get("after counted steps") or {}).get("generated_code") or {}).get("kernels_defined")),
        _cell(((r["graphs"].get("after counted steps") or {}).get("inductor") or {}).get("ir_nodes_pre_fusion"))))
        if r["graphs"] else "n/a")
    for part in ("parameters", "gradients", "optimizer_state"):
        add(f"5. {part.replace('_', ' ')}, GB", lambda r, p=part: _gb(r["bytes"][p]["total"]), "",
            "; ".join(f"{r['arm']}: " + ", ".join(f"{k} {_gb(v)}" for k, v in r["bytes"][part]["by_dtype"].items())
                      for r in results))
    for group in GROUPS:
        add(f"   {group}: parameters + gradients + state, GB",
            lambda r, g=group: _gb(sum(r["bytes"][p]["by_group"].get(g, 0)
                                       for p in ("parameters", "gradients", "optimizer_state"))))
    for key, label in (("saved_eager", "saved for backward @GPU shape, eager, GB"),
                       ("saved_compiled", "saved for backward @GPU shape, compiled, GB")):
        add(f"   {label}", lambda r, k=key: _gb((r.get(k) or {}).get("total")) if "error" not in (r.get(k) or {})
            else "error", "", "; ".join(f"{r['arm']}: " + ", ".join(f"{d} {_gb(v)}" for d, v in
                                                                     (r.get(key) or {}).get("by_dtype", {}).items())
                                        for r in results if r.get(key)))
    add("   sum: parameters + gradients + state + saved (compiled), GB", lambda r: _gb(
        sum(r["bytes"][p]["total"] for p in ("parameters", "gradients", "optimizer_state"))
        + ((r.get("saved_compiled") or {}).get("total") or 0)), GPU_PROFILE["peak"])
    return rows


def graph_after(result: dict, key: str):
    state = result["graphs"].get("after counted steps") or {}
    return state.get("stats", {}).get(key)


def print_table(args: StepProxyArguments, results: list[dict], rows: list[dict]) -> None:
    arms = [r["arm"] for r in results]
    first = results[0]
    print(f"\nCPU step proxies per optimizer step (plain steps): d{args.depth} (hidden {first['hidden_size']}, "
          f"{first['heads']} heads of {args.head_dim}), vocabulary {first['vocab_size']}, {args.batch_size} × "
          f"{args.seq_len} tokens on the CPU (a → b: b scaled to {args.gpu_batch_size} × {args.gpu_seq_len} where a "
          f"site's count is linear in tokens), bf16 {args.bf16}, compiled {args.compile}")
    widths = [62, *[16] * len(arms), 30]
    header = ["row", *arms, "GPU profile hfl3 / nanochat"]
    print("  ".join(f"{h:<{w}}" for h, w in zip(header, widths)))
    for row in rows:
        cells = [row["row"], *[str(row[arm]) for arm in arms], row["gpu"]]
        print("  ".join(f"{c:<{w}}" for c, w in zip(cells, widths)) + (f"  {row['notes']}" if row["notes"] else ""))
    print("\nCUDA-only, not counted here:\n" + "\n".join(f"- {line}" for line in CUDA_ONLY))
    for result in results:
        print(f"\n{result['arm']}: GPU-path changes {result['shims'] or 'none'}; compiled plain step by site:")
        for category in (SYNC, COPY, FILL):
            sites = [(site, count) for site, count in result["compiled"][category]["by_site"].items()
                     if not site.startswith(CAST)]
            for site, count in sites[:12]:
                print(f"  {category:<5}{count:7g}  {site}")


def markdown_table(results: list[dict], rows: list[dict]) -> str:
    arms = [r["arm"] for r in results]
    lines = ["| row | " + " | ".join(arms) + " | GPU profile hfl3 / nanochat | notes |",
             "|---|" + "---:|" * len(arms) + "---|---|"]
    for row in rows:
        lines.append(f"| {row['row'].strip()} | " + " | ".join(str(row[arm]) for arm in arms)
                     + f" | {row['gpu']} | {row['notes']} |")
    return "\n".join(lines + ["", "CUDA-only, not counted here:", *(f"- {line}" for line in CUDA_ONLY)])


def main(args: StepProxyArguments) -> dict:
    """Measure every arm of `args.arms`, each in a fresh process (nanochat last, at hfl3's vocabulary); print the
    table. Returns (and with `--json` writes) `{"args", "machine", "torch", "shape", "results", "table"}`."""
    results = []
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for arm in sorted(args.arms, key=lambda arm: arm == "nanochat"):
        started = time.perf_counter()
        if arm == "nanochat":
            vocab_size = results[0]["vocab_size"] if results else args.vocab_size
            result = in_fresh_process(measure_nanochat, args, vocab_size,
                                      env=env | {"NANOCHAT_DTYPE": "bfloat16" if args.bf16 else "float32"})
        else:
            result = in_fresh_process(measure_hfl3, args, arm, env=env)
        result["arm_seconds"] = time.perf_counter() - started
        results.append(result)
        print(f"{arm}: {result['compiled'][SYNC]['total']:g} host syncs, {_count(result, COPY, set(COPY_ROWS)):g} "
              f"copies, {result['compiled'][FILL]['total']:g} fills per compiled plain step "
              f"({result['arm_seconds']:.0f} s)", flush=True)
    rows = table_rows(args, results)
    print_table(args, results, rows)
    dataset = shown_path(args.dataset) if Path(args.dataset).exists() else args.dataset
    recorded = asdict(args) | {"nanochat_dir": shown_path(args.nanochat_dir), "dataset": dataset,
                               "json": shown_path(args.json)}
    return write_result(args.json, {"args": recorded, "machine": machine_name("cpu"), "torch": torch.__version__,
                                    "shape": asdict(ModelShape.of(args)), "results": results, "table": rows,
                                    "markdown": markdown_table(results, rows)})


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(HfArgumentParser(StepProxyArguments).parse_args_into_dataclasses()[0])
