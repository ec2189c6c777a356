"""hfl3's pretraining step beside nanochat's own, at the same shape, on one GPU, in one run.

Arms (each in a fresh process, so compile caches and peak memory are its own):
- `nanochat`: nanochat's GPT and its MuonAdamW from a checkout you provide (`--nanochat_dir`; not vendored), driven
  as in its scripts/base_train.py: model built on the meta device, `init_weights()`, `torch.compile(model,
  dynamic=False)`, `setup_optimizer()`, then `loss = model(x, y); loss.backward(); optimizer.step();
  model.zero_grad(set_to_none=True)`. Its attention is FA3 when its loader can fetch the kernel from the Hub, else
  its SDPA fallback (the case on an offline machine; the arm reports which).
- `hfl3`: the recipe's path: the model and `PretrainTrainer` (HF Trainer) from `hfl3.trainers.pretraining.builder`
  (`build_model`, `build_trainer`: `MuonAdamW`, `PackedCollator`, the throughput of `hfl3.trainers.metrics`), bf16
  autocast on CUDA, `torch_compile` as asked.
- `hfl3_l3`: the same with one L3 layer after layer `depth // 2 - 1` (LZW allocation of the token stream).
- `hfl3_legacy`: the same dense model without nanochat master's value embeddings, smear and backout
  (`LEGACY_FIELD_VALUES`, the core before them), for the question whether the new core costs tokens/s.
- `hfl3_liger`, `hfl3_chunked`: `hfl3` with the memory-light training loss (`--loss_implementation liger` /
  `chunked`) instead of the default, the logits inside the compiled graph; `hfl3_fp32_embeddings`: `hfl3` with
  float32 token and value-embedding tables (`--embedding_dtype float32`) instead of bf16.
- `hfl3_reduce_overhead`, `hfl3_max_autotune`: `hfl3` compiled with `--torch_compile_mode reduce-overhead` (CUDA
  graphs: the host's launches replayed, against the device's idle time) / `max-autotune-no-cudagraphs` (Inductor
  benchmarks GEMM and kernel configurations at compile time).
- `hfl3_fp8_tensorwise`, `hfl3_fp8_rowwise`: `hfl3` with `convert_to_float8_training(model, recipe)` before the
  Trainer, as `recipes/pretrain.py --fp8 ...` does (bf16 autocast around the FP8 matmuls).
- `hfl3_fp8_ao`: `hfl3` with FP8 through accelerate's torchao backend, launched as
  `accelerate_configs/fp8_ao.yaml` launches it (its settings as environment variables, mixed precision fp8, no
  `bf16`; accelerate's own layer filter).

Same shape for all: `depth` layers, hidden = depth × 64 rounded up to a multiple of `head_dim`, rows of `seq_len`
tokens, `batch_size` rows per step, vocabulary `vocab_size`, window pattern `window_pattern`, rows attending across
documents (nanochat does: no document mask). Token ids are random, drawn from a Zipf law (rank r ∝ 1/r) so that L3
routes frequent ids to big tables as real text does; nanochat reads `(x, y) = (row[:-1], row[1:])`.

Timing: steps `warmup_steps + 1 … warmup_steps + steps` as one window, CUDA synchronised at both ends (compilation
happens in the warm-up); beside it the process's CPU time over the window (`host ms`: near `ms/step` when the
host paces the step), and from `--profile_steps` steps profiled after the window (torch.profiler) the device's busy
time (`busy ms`: its kernels, copies and fills; `ms/step` minus it is the time the device waits for the host), host
syncs and copies, memsets and device-to-device copies per step. tok/s = window tokens / window seconds. `first_step_seconds` (start of training to the end
of step 1) is where compilation happens: minus one window step, it is the compile time. MFU = tok/s × FLOPs/token /
peak bf16 FLOP/s (`hfl3.trainers.metrics.PEAK_BF16_FLOPS`; H100 SXM 989e12, also for the FP8 arms); FLOPs/token from
`configuration_l3gpt.flops_per_token` for hfl3 (plus the L3 lookups) and from nanochat's own `estimate_flops()` for
nanochat (both 6 × matmul params + 12·L·H·Q·T, PaLM appendix B). Peak memory: `torch.cuda.max_memory_allocated()`
over the whole arm (build, warm-up and window).

    python benchmarks/vs_nanochat.py --nanochat_dir build/nanochat --json benchmarks/results/vs_nanochat_h100.json
    python benchmarks/vs_nanochat.py --arms hfl3 --compile false       # hfl3 alone, eager
    python benchmarks/vs_nanochat.py --depth 20 --arms hfl3 hfl3_fp8_tensorwise hfl3_fp8_rowwise hfl3_fp8_ao
    python benchmarks/vs_nanochat.py                                   # no GPU: tiny shape on CPU, fp32, hfl3 only

Get nanochat with `git clone https://github.com/karpathy/nanochat build/nanochat` (`build/` is git-ignored). Goals
(docs/design.md, decision 12): hfl3 dense ≥ 1.1× nanochat's tok/s (≥ 44 % MFU) with peak memory ≤ 1.1× nanochat's; hfl3 with L3 ≥
0.9× hfl3 dense; FP8 tensorwise ≥ 1.2× bf16 at d20.
"""

import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import HfArgumentParser, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ModelShape, device_shape, in_fresh_process, shown_path, write_result  # noqa: E402

# What each hfl3 arm changes: an L3 layer, the core before nanochat master's features, an FP8 recipe
HFL3_ARMS = {
    "hfl3": {}, "hfl3_l3": {"l3": True}, "hfl3_legacy": {"legacy_core": True}, "hfl3_liger": {"loss": "liger"},
    "hfl3_chunked": {"loss": "chunked"}, "hfl3_fp32_embeddings": {"embedding_dtype": "float32"},
    "hfl3_reduce_overhead": {"compile_mode": "reduce-overhead"},
    "hfl3_max_autotune": {"compile_mode": "max-autotune-no-cudagraphs"},
    "hfl3_fp8_tensorwise": {"fp8": "tensorwise"}, "hfl3_fp8_rowwise": {"fp8": "rowwise"}, "hfl3_fp8_ao": {"fp8": "ao"},
}
ARMS = ("nanochat", *HFL3_ARMS)
# accelerate_configs/fp8_ao.yaml as the environment `accelerate launch` exports from it
AO_ENVIRONMENT = {"ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_FP8_BACKEND": "AO",
                  "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER": "false", "ACCELERATE_FP8_PAD_INNER_DIM": "true"}
# Steps when left unset, beside the shape (`common.device_shape`): nanochat's d12 on a GPU, a seconds-long model on CPU.
GPU_STEPS = dict(steps=20, warmup_steps=10)
CPU_STEPS = dict(steps=5, warmup_steps=2)
BOS = 0
PROFILE_STEPS = 3  # steps profiled after the timed window (the per-step counts; the table with --profile_dir)


@dataclass
class VsNanochatArguments:
    nanochat_dir: str | None = field(default=None, metadata={"help": "a nanochat checkout; without it, hfl3 alone"})
    arms: list[str] = field(default_factory=lambda: ["nanochat", "hfl3", "hfl3_l3"],
                            metadata={"help": f"any of {ARMS}"})
    depth: int | None = field(default=None, metadata={"help": "decoder layers (default 12 on CUDA, 2 on CPU)"})
    seq_len: int | None = field(default=None, metadata={"help": "row length (default 2048 on CUDA, 128 on CPU)"})
    batch_size: int | None = field(default=None, metadata={"help": "rows per step (default 16 on CUDA, 4 on CPU)"})
    vocab_size: int | None = field(default=None, metadata={"help": "vocabulary (default 32768 on CUDA, 2048 CPU)"})
    head_dim: int | None = field(default=None, metadata={"help": "head width (default 128 on CUDA, 64 on CPU)"})
    aspect_ratio: int = field(default=64, metadata={
        "help": "hidden size = depth × aspect_ratio, rounded up to head_dim (nanochat's --aspect-ratio); a small one "
                "with depth 12 on a CPU leaves the step's host work: `--depth 12 --aspect_ratio 8 --head_dim 32`"})
    window_pattern: str = field(default="L", metadata={"help": "S/L pattern, as nanochat's --window_pattern"})
    compile: bool | None = field(default=None, metadata={"help": "torch.compile every arm (default: on CUDA)"})
    bf16: bool | None = field(default=None, metadata={"help": "hfl3's bf16 autocast (default: on CUDA)"})
    dataloader_num_workers: int | None = field(default=None, metadata={"help": "hfl3's loader (default 2 on CUDA)"})
    l3_k_max: int = field(default=64, metadata={"help": "most L3 rows per token (hfl3_l3)"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "hfl3's attention: sdpa, flash_attention_2"})
    steps: int | None = field(default=None, metadata={"help": "timed steps (default 20 on CUDA, 5 on CPU)"})
    warmup_steps: int | None = field(default=None, metadata={"help": "untimed steps first (compilation), >= 1"})
    json: str | None = field(default=None, metadata={"help": "write the results here (JSON)"})
    profile_steps: int = field(default=PROFILE_STEPS, metadata={
        "help": "steps profiled after each arm's timed window (torch.profiler): host syncs and copies, device events "
                "and busy time per step (0: none)"})
    profile_dir: str | None = field(default=None, metadata={
        "help": "with --profile_steps, also write each arm's profile table <arm>_profile.txt here: "
                "<arm>_profile.txt here"})

    def __post_init__(self):
        cuda = torch.cuda.is_available()
        device_shape().fill(self)
        steps = GPU_STEPS if cuda else CPU_STEPS
        for name, default in (*steps.items(), ("compile", cuda), ("bf16", cuda),
                              ("dataloader_num_workers", 2 if cuda else 0)):
            if getattr(self, name) is None:
                setattr(self, name, default)
        unknown = set(self.arms) - set(ARMS)
        if unknown:
            raise ValueError(f"--arms: unknown {sorted(unknown)}; expected some of {ARMS}")
        if self.warmup_steps < 1 or self.steps < 1:
            raise ValueError(f"--warmup_steps {self.warmup_steps} and --steps {self.steps} must be >= 1 (the window "
                             "starts at the end of the last warm-up step)")
        if "nanochat" in self.arms and not self.nanochat_dir:
            self.arms = [arm for arm in self.arms if arm != "nanochat"]
        if self.nanochat_dir and not (Path(self.nanochat_dir) / "nanochat" / "gpt.py").is_file():
            raise ValueError(f"--nanochat_dir {self.nanochat_dir}: no nanochat/gpt.py there; clone "
                             "https://github.com/karpathy/nanochat into it")

    @property
    def hidden_size(self) -> int:
        """nanochat's sizing: depth × aspect_ratio rounded up to a multiple of head_dim (scripts/base_train.py)."""
        return -(-self.depth * self.aspect_ratio // self.head_dim) * self.head_dim


def zipf_rows(args: VsNanochatArguments, rows: int, length: int, seed: int = 0) -> np.ndarray:
    """`(rows, length)` token ids, BOS first, the rest Zipf-distributed over the other ids."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, args.vocab_size)
    ids = rng.choice(ranks, size=(rows, length), p=(1 / ranks) / (1 / ranks).sum())
    ids[:, 0] = BOS
    return ids


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Window:
    """Clock of one arm. `begin()` before the first step, `tick(step)` after every step; CUDA is synchronised only at
    the steps it keeps. `first_step_seconds`: begin → end of step 1 (compilation happens there); `seconds`: end of
    step `first` → end of step `last` (the timed window); `host_cpu_seconds`: the process's CPU time over the same
    window (`time.process_time`: the Python loop, autograd's device thread that launches the backward, the pin-memory
    thread; DataLoader workers are other processes), which reaches `seconds` when the host paces the step
    (host-bound) and stays below it when the device does."""

    def __init__(self, first: int, last: int):
        self.first, self.last = first, last
        self.began = self.start = self.seconds = self.first_step_seconds = None
        self.cpu_start = self.host_cpu_seconds = None

    def begin(self) -> None:
        synchronize()
        self.began = time.perf_counter()

    def tick(self, step: int) -> None:
        if step not in (1, self.first, self.last):
            return
        synchronize()
        now, cpu = time.perf_counter(), time.process_time()
        if step == 1:
            self.first_step_seconds = now - self.began
        if step == self.first:
            self.start, self.cpu_start = now, cpu
        if step == self.last:
            self.seconds, self.host_cpu_seconds = now - self.start, cpu - self.cpu_start


# What the profile summary counts per step: the host calls that wait for the device or copy, and the device's copies
HOST_CALLS = {"syncs": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
              "copies": ("cudaMemcpyAsync", "cudaMemcpy")}


# The host calls `call_sources` attributes to the code that made them (each cudaMemcpyAsync is a copy to, from or
# within the device: the H200 profile of 2026-11-28 counted 126 device-to-device copies per hfl3 step, 0 in nanochat's)
SOURCED_CALLS = (*HOST_CALLS["syncs"], *HOST_CALLS["copies"], "aten::item")


def call_sources(events, names, frames: int = 3, top: int = 20) -> list[tuple[str, int]]:
    """The `top` most frequent sources of the profiled host events named in `names`, as `(source, count)`: a source
    is the aten op that made the call (the nearest `aten::` ancestor) and its `frames` innermost Python frames outside
    torch's own files. A profile taken `with_stack=True` has the Python frames as ancestor events named
    `file.py(line): function`; without it a source is the op alone."""
    from collections import Counter

    sources = Counter()
    for event in events:
        if event.name not in names:
            continue
        op, stack, ancestor = None, [], event.cpu_parent
        while ancestor is not None and len(stack) < frames:
            if op is None and ancestor.name.startswith("aten::"):
                op = ancestor.name
            elif ".py(" in ancestor.name and "/torch/" not in ancestor.name:
                stack.append(ancestor.name.split("/")[-1])
            ancestor = ancestor.cpu_parent
        sources[" < ".join([event.name if op is None else f"{event.name} in {op}", *stack])] += 1
    return sources.most_common(top)


class StepProfiler:
    """torch.profiler over steps `first + 1 … last` (the arms profile `PROFILE_STEPS` steps after their timed window,
    so the window is not slowed). `summary` then holds, per step: `device_events`, `device_busy_ms` (the summed
    duration of the device's kernels, copies and fills: against the step's wall time, the device's idle time),
    `host_syncs` (cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize calls), `host_copies`
    (cudaMemcpyAsync calls), `memsets` and `memcpy_dtod` (device events). With `directory`, also writes
    `<arm>_profile.txt`: those, the host syncs and copies by name, the most frequent device events, and the 40 ops
    with the most device time."""

    def __init__(self, directory: str | None, arm: str, first: int, last: int):
        self.directory, self.arm, self.first, self.last = directory, arm, first, last
        self.profiler = None
        self.summary: dict | None = None

    def tick(self, step: int) -> None:
        if self.last <= self.first:
            return
        if step == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            # the Python stack of each op only where the table is written (`call_sources`)
            self.profiler = torch.profiler.profile(activities=activities, with_stack=self.directory is not None)
            self.profiler.__enter__()
        elif step == self.last and self.profiler is not None:
            synchronize()
            self.profiler.__exit__(None, None, None)
            self.write()

    def write(self) -> None:
        from collections import Counter

        steps = self.last - self.first
        events = self.profiler.events()
        device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                  and not getattr(e, "is_user_annotation", False)]
        kernels = Counter(e.name for e in device)
        host = Counter(e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU)
        syncs = {name: count for name, count in host.items()
                 if any(key in name for key in ("Synchronize", "Memcpy", "_local_scalar_dense", "aten::item",
                                                 "aten::nonzero", "cudaHostAlloc", "cudaMalloc"))}
        self.summary = {
            "device_events": sum(kernels.values()) / steps,
            "device_busy_ms": sum(e.device_time_total for e in device) / 1e3 / steps,
            "host_syncs": sum(host[name] for name in HOST_CALLS["syncs"]) / steps,
            "host_copies": sum(host[name] for name in HOST_CALLS["copies"]) / steps,
            "memsets": sum(count for name, count in kernels.items() if name.startswith("Memset")) / steps,
            "memcpy_dtod": sum(count for name, count in kernels.items() if "DtoD" in name) / steps,
        }
        if self.directory is None:
            return
        lines = [f"{self.arm}: {steps} profiled steps", f"device events per step: {sum(kernels.values()) / steps:.0f} "
                 f"({len(kernels)} distinct); device busy {self.summary['device_busy_ms']:.1f} ms per step",
                 "host syncs and copies per step:"]
        lines += [f"  {count / steps:8.1f}  {name}" for name, count in sorted(syncs.items(), key=lambda kv: -kv[1])]
        lines.append("host copies and syncs per step, by the code that called them (innermost frames first):")
        lines += [f"  {count / steps:8.1f}  {source}" for source, count in call_sources(events, SOURCED_CALLS)]
        lines.append("device events per step, most frequent:")
        lines += [f"  {count / steps:8.1f}  {name[:140]}" for name, count in kernels.most_common(25)]
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        lines.append(self.profiler.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=90))
        Path(self.directory).mkdir(parents=True, exist_ok=True)
        (Path(self.directory) / f"{self.arm}_profile.txt").write_text("\n".join(lines) + "\n")


class WindowCallback(TrainerCallback):
    def __init__(self, window: Window, profiler: StepProfiler | None = None):
        self.window, self.profiler = window, profiler

    def on_train_begin(self, args, state, control, **kwargs):
        self.window.begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.window.tick(state.global_step)
        if self.profiler is not None:
            self.profiler.tick(state.global_step)


def run_hfl3(args: VsNanochatArguments, arm: str, output_dir: str) -> dict:
    """hfl3's path: the recipe's `build_model` and `build_trainer` (`PretrainTrainer` + `MuonAdamW` + the collator
    and callbacks), changed as `HFL3_ARMS[arm]` says (L3 layer, legacy core, FP8)."""
    import datasets

    from hfl3 import fp8
    from hfl3.models.l3gpt.configuration_l3gpt import LEGACY_FIELD_VALUES, flops_per_token
    from hfl3.trainers.pretraining.compute_optimal import parameter_counts
    from hfl3.trainers.pretraining.config import PretrainConfig
    from hfl3.trainers.pretraining.builder import build_model, build_trainer
    from l3_flops import l3_lookup_flops_per_token

    change = HFL3_ARMS[arm]
    total = args.warmup_steps + args.steps
    profiled = args.profile_steps
    rows = zipf_rows(args, (total + profiled) * args.batch_size, args.seq_len)
    config = ModelShape.of(args).config(
        window_pattern=args.window_pattern, bos_token_id=BOS, attn_implementation=args.attn_implementation,
        l3_after_layers=[max(0, args.depth // 2 - 1)] if change.get("l3") else [], l3_k_max=args.l3_k_max,
        **(dict(LEGACY_FIELD_VALUES) if change.get("legacy_core") else {}),
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    recipe = change.get("fp8")
    window = Window(args.warmup_steps, total)
    training_args = PretrainConfig(
        output_dir=output_dir, max_steps=total + profiled, per_device_train_batch_size=args.batch_size,
        max_length=args.seq_len, optim="muon", bf16=args.bf16 and recipe != "ao", torch_compile=args.compile,
        torch_compile_mode=change.get("compile_mode"),
        warmup_steps=2, eval_strategy="no", report_to="none", logging_steps=args.steps, disable_tqdm=True,
        attend_across_documents=True, dataloader_num_workers=args.dataloader_num_workers, save_strategy="no",
        fp8=recipe if recipe != "ao" else None, use_cpu=device == "cpu",  # bf16 on a CPU needs use_cpu
        loss_implementation=change.get("loss", "auto"), embedding_dtype=change.get("embedding_dtype", "auto"),
    )
    # initialised where it trains: a d20 model's CPU init alone takes seconds
    model = build_model(config, training_args, lambda: rows[: max(1, 200_000 // args.seq_len)].tolist(), device)
    if recipe == "ao" and fp8.check_ao_backend(training_args, model) is None:
        raise RuntimeError(f"hfl3_fp8_ao: accelerate's AO backend is not on; the arm needs {AO_ENVIRONMENT}")
    fpt = flops_per_token(config, args.seq_len)
    if config.l3_after_layers:
        fpt += l3_lookup_flops_per_token(config, float(model.model.l3_counts().cpu().numpy()[rows].mean()))
    profiler = StepProfiler(args.profile_dir, arm, total, total + profiled)
    trainer = build_trainer(model, training_args, datasets.Dataset.from_dict({"input_ids": rows}), fpt,
                            bos_token_id=BOS, callbacks=[WindowCallback(window, profiler)])
    trainer.train()
    counts = parameter_counts(model)
    tables = counts["l3_table"]
    precision = f"fp8 {recipe}" + (" (accelerate's torchao backend)" if recipe == "ao" else " (hfl3 Float8Linear)")
    return dict(flops_per_token=fpt, seconds=window.seconds, first_step_seconds=window.first_step_seconds,
                host_cpu_seconds=window.host_cpu_seconds, profile=profiler.summary,
                attention=args.attn_implementation, dense_parameters=counts["total"] - tables,
                table_parameters=tables, precision=precision if recipe else "bf16" if args.bf16 else "fp32")


def build_nanochat(args: VsNanochatArguments, rows_per_step: int) -> dict:
    """nanochat's GPT + MuonAdamW as its scripts/base_train.py builds them (model on the meta device,
    `init_weights()`, `setup_optimizer()`, `torch.compile(model, dynamic=False)` with `args.compile`), and
    `rows_per_step` steps of rows on the device. Without `args.compile` nothing is compiled, its optimizer step
    included (it compiles that itself: minutes on a CPU). Returns `model` (compiled or not), `module` (the GPT),
    `optimizer`, `rows` (`(rows_per_step * batch_size, seq_len + 1)` token ids), `flops_per_token`, `parameters`,
    `precision` and `attention`."""
    if not args.compile:
        torch.compiler.set_stance("force_eager")
    sys.path.insert(0, str(Path(args.nanochat_dir).resolve()))
    from nanochat import flash_attention
    from nanochat.common import COMPUTE_DTYPE
    from nanochat.gpt import GPT, GPTConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = GPTConfig(sequence_len=args.seq_len, vocab_size=args.vocab_size, n_layer=args.depth,
                       n_head=args.hidden_size // args.head_dim, n_kv_head=args.hidden_size // args.head_dim,
                       n_embd=args.hidden_size, window_pattern=args.window_pattern)
    with torch.device("meta"):
        module = GPT(config)
    module.to_empty(device=device)
    module.init_weights()
    optimizer = module.setup_optimizer()
    model = torch.compile(module, dynamic=False) if args.compile else module
    rows = torch.from_numpy(zipf_rows(args, rows_per_step * args.batch_size, args.seq_len + 1)).to(device)
    return dict(model=model, module=module, optimizer=optimizer, rows=rows, flops_per_token=module.estimate_flops(),
                parameters=sum(p.numel() for p in module.parameters()),
                precision=str(COMPUTE_DTYPE).removeprefix("torch."),
                attention="fa3" if flash_attention.USE_FA3 else "sdpa (nanochat's fallback)")


def nanochat_step(built: dict, step: int, batch_size: int) -> torch.Tensor:
    """Optimizer step `step` (from 1) of base_train's loop (no gradient accumulation) on `build_nanochat`'s model and
    rows; returns the loss."""
    model, optimizer = built["model"], built["optimizer"]
    batch = built["rows"][(step - 1) * batch_size : step * batch_size]
    loss = model(batch[:, :-1].contiguous(), batch[:, 1:].contiguous())
    loss.backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    return loss


def run_nanochat(args: VsNanochatArguments) -> dict:
    """nanochat's GPT + MuonAdamW (`build_nanochat`), the loop of its scripts/base_train.py (`nanochat_step`)."""
    total = args.warmup_steps + args.steps
    profiled = args.profile_steps
    built = build_nanochat(args, total + profiled)
    window = Window(args.warmup_steps, total)
    profiler = StepProfiler(args.profile_dir, "nanochat", total, total + profiled)
    window.begin()
    for step in range(1, total + profiled + 1):
        nanochat_step(built, step, args.batch_size)
        window.tick(step)
        profiler.tick(step)
    return dict(flops_per_token=built["flops_per_token"], seconds=window.seconds,
                first_step_seconds=window.first_step_seconds, host_cpu_seconds=window.host_cpu_seconds,
                profile=profiler.summary, dense_parameters=built["parameters"], table_parameters=0,
                precision=built["precision"], attention=built["attention"])


def run_arm(args: VsNanochatArguments, arm: str) -> dict:
    """Measure `arm` in this process (call it in a fresh one: peak memory and compile caches are per process)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        result = run_nanochat(args) if arm == "nanochat" else run_hfl3(args, arm, scratch)
    from hfl3.trainers.metrics import peak_flops_per_second

    peak = peak_flops_per_second()
    result["tok_per_sec"] = args.steps * args.batch_size * args.seq_len / result["seconds"]
    result["mfu"] = 100 * result["tok_per_sec"] * result["flops_per_token"] / peak if peak else None
    result["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
    result["compile_seconds"] = result["first_step_seconds"] - result["seconds"] / args.steps
    result.update(compile_phases())
    result["ms_per_step"] = 1e3 * result["seconds"] / args.steps
    result["host_cpu_ms_per_step"] = 1e3 * result.pop("host_cpu_seconds") / args.steps
    for key, per_step in (result.pop("profile") or {}).items():
        result[f"{key}_per_step"] = per_step
    return dict(arm=arm, **result, arm_seconds=time.perf_counter() - started)


# torch._dynamo's timing keys (`compilation_time_metrics`): a compiled frame (dynamo, AOT autograd, the forward's
# Inductor), the backward's lazy compile, and where that time went
COMPILE_TOTAL_KEYS = ("_compile.compile_inner", "backward._backward_impl")
COMPILE_PHASE_KEYS = {"dynamo_tracing": "bytecode_tracing", "aot_autograd": "create_aot_dispatcher_function",
                      "inductor_forward": "compile_fx.<locals>.fw_compiler_base",
                      "inductor_backward": "compile_fx.<locals>.bw_compiler", "kernel_compile_wait": "async_compile.wait"}


def compile_phases() -> dict:
    """This process's compile time as torch._dynamo recorded it: `compile_wall_seconds` (every compiled frame and
    every backward compiled at its first call; the first step's other work — data loading, the optimizer's state —
    is not in it, as it is in `compile_seconds`), `compiled_graphs`, and `compile_phase_seconds` by phase."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    total = {key: sum(values) for key, values in compilation_time_metrics.items()}
    return {"compile_wall_seconds": sum(total.get(key, 0.0) for key in COMPILE_TOTAL_KEYS),
            "compiled_graphs": counters["stats"]["unique_graphs"],
            "compile_phase_seconds": {name: total.get(key, 0.0) for name, key in COMPILE_PHASE_KEYS.items()}}


def print_table(args: VsNanochatArguments, results: list[dict], device: str) -> dict:
    """Print the arms' table, with ratios against nanochat (else hfl3, else the first arm); returns that arm."""
    by_arm = {r["arm"]: r for r in results}
    reference = by_arm.get("nanochat") or by_arm.get("hfl3") or results[0]
    print(f"\nPretraining step on {device}: depth {args.depth}, hidden {args.hidden_size}, batch {args.batch_size}×"
          f"{args.seq_len}, vocab {args.vocab_size}, window {args.window_pattern}, compile {args.compile}, "
          f"{args.steps} timed steps after {args.warmup_steps}; ratios against {reference['arm']}")
    print(f"{'arm':<20}{'precision':<12}{'attention':<28}{'GFLOP/tok':>10}{'ms/step':>9}{'host ms':>8}{'busy ms':>8}"
          f"{'tok/s':>10}{'MFU %':>7}{'peak GB':>8}{'compile s':>10}{'tok/s ×':>9}{'memory ×':>9}")
    for r in results:
        memory_ratio = (f"{r['peak_memory_gb'] / reference['peak_memory_gb']:.3f}"
                        if r["peak_memory_gb"] and reference["peak_memory_gb"] else "n/a")
        print(f"{r['arm']:<20}{r['precision'][:11]:<12}{r['attention']:<28}{r['flops_per_token'] / 1e9:>10.3f}"
              f"{r['ms_per_step']:>9.1f}{r['host_cpu_ms_per_step']:>8.1f}"
              f"{r.get('device_busy_ms_per_step', float('nan')):>8.1f}{r['tok_per_sec']:>10.0f}"
              f"{r['mfu'] if r['mfu'] is None else round(r['mfu'], 1)!s:>7}"
              f"{r['peak_memory_gb'] if r['peak_memory_gb'] is None else round(r['peak_memory_gb'], 1)!s:>8}"
              f"{r['compile_seconds']:>10.1f}{r['tok_per_sec'] / reference['tok_per_sec']:>9.3f}{memory_ratio:>9}")
    if "hfl3" in by_arm and "hfl3_l3" in by_arm:
        print(f"hfl3 with L3 / hfl3 dense: {by_arm['hfl3_l3']['tok_per_sec'] / by_arm['hfl3']['tok_per_sec']:.3f}× "
              "tok/s (goal ≥ 0.9)")
    return reference


def main(args: VsNanochatArguments, on_result=None) -> dict:
    """Run `args.arms`, each in a fresh process, one after the other; `on_result(result)` after each arm. Returns
    (and with `--json` writes) `{"args", "device", "torch", "reference", "results"}`."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} threads)"
    results = []
    for arm in args.arms:
        if arm == "nanochat":  # its Linear layers cast to this dtype at import (nanochat/common.py), no autocast
            env = {"NANOCHAT_DTYPE": "bfloat16" if args.bf16 else "float32"}
        else:
            env = AO_ENVIRONMENT if HFL3_ARMS[arm].get("fp8") == "ao" else None
        results.append(in_fresh_process(run_arm, args, arm, env=env))
        print(f"{arm}: {results[-1]['tok_per_sec']:.0f} tok/s", flush=True)
        if on_result:
            on_result(results[-1])
        if args.json:  # what is done so far survives a run cut off by its time limit
            write_result(args.json, {"args": asdict(args) | {"nanochat_dir": shown_path(args.nanochat_dir)},
                                     "device": device, "torch": torch.__version__, "results": results})
    reference = print_table(args, results, device)
    recorded = asdict(args) | {"nanochat_dir": shown_path(args.nanochat_dir)}
    output = {"args": recorded, "device": device, "torch": torch.__version__, "reference": reference["arm"],
              "results": results}
    return write_result(args.json, output)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(HfArgumentParser(VsNanochatArguments).parse_args_into_dataclasses()[0])
