"""Cost of one optimizer step: hfl3's MuonAdamW vs torch.optim.AdamW on the same L3GPT, in one run.

Goal on one H100 at d12 + one L3 layer: a MuonAdamW step ≤ 3× a fused AdamW step on the same parameters.

Arms (each owns a copy of the model's parameters; all read the same fixed random gradients, so a step is pure
optimizer work; the arms alternate step by step, so that they share the machine's load):
  adamw          `torch.optim.AdamW` on every parameter: `fused=True` on CUDA, `foreach=True` on the CPU (yardstick)
  muon_eager     `MuonAdamW(param_groups_by_kind(model), compile_update=False)`: same-shape matrices in stacks
  muon_compiled  the same with `compile_update=True` (each stack's update one compiled graph); MuonAdamW's default
                 on CUDA. `--compiled false` leaves it out (compiling takes ~10-30 s per shape on a CPU)
  per_parameter  the MuonAdamW step before same-shape stacks (commit 0d37b51), kept here as the baseline: one Polar Express
                 per matrix (`mm`/`addmm`), NorMuon and weight decay per matrix, torch's default functional AdamW;
                 with MuonEq and Muon+ per matrix when the group has them (nanochat 4e014d3), so that the math is the same

Per arm: median wall time of a step (CUDA: synchronised before and after), process CPU time of a step (on CUDA the
launch cost), GPU time (CUDA events), aten operations and matmuls dispatched in one step, optimizer state MB, and
on CUDA the GPU kernels launched and the extra peak memory of a step. Each MuonAdamW arm's first update (from the
same weights) is compared with per_parameter's: ‖Δw − Δw_per_parameter‖ / ‖Δw_per_parameter‖ (round-off, plus
cautious weight decay's mask where an update element is ~0; bf16 Polar Express on CUDA).

    OMP_NUM_THREADS=1 python benchmarks/muon_step.py --json benchmarks/results/muon_step_cpu.json  # depth 4, hidden 256
    python benchmarks/muon_step.py --depth 12 --vocab_size 32768 --head_dim 128 --l3_after_layers 5 \\
        --json benchmarks/results/muon_step_h100.json                                                # d12 + L3 on a GPU
"""

import copy
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.optim.adamw import adamw
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import HfArgumentParser

from hfl3 import L3GPTForCausalLM
from hfl3.optim import MuonAdamW, MuonSettings, muon_momentum, normuon_rescale, orthogonalize, param_groups_by_kind
from hfl3.optim.muon_scaling import equilibrate, renormalize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ModelShape, machine_name, write_result  # noqa: E402

MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}


@dataclass
class StepArguments:
    device: str = field(default="auto", metadata={"help": "cuda, cpu or auto (cuda when available)"})
    depth: int = field(default=4, metadata={"help": "decoder layers (same-shape matrices per layer: 6)"})
    aspect_ratio: int = field(default=64, metadata={"help": "hidden_size = depth * aspect_ratio, rounded to head_dim"})
    head_dim: int = field(default=64, metadata={"help": "attention head width"})
    vocab_size: int = field(default=4096, metadata={"help": "vocabulary (embedding, lm_head; L3 table = 4× rows)"})
    l3_after_layers: list[int] = field(default_factory=lambda: [1], metadata={"help": "L3 layers; [] for dense"})
    weight_decay: float = field(default=0.2, metadata={"help": "Muon groups' cautious weight decay (nanochat 0.2)"})
    compiled: bool = field(default=True, metadata={"help": "also time MuonAdamW with compile_update=True"})
    steps: int = field(default=20, metadata={"help": "timed steps per arm"})
    warmup_steps: int = field(default=3, metadata={"help": "untimed steps per arm first (compile, state allocation)"})
    json: str | None = field(default=None, metadata={"help": "write the results here (JSON)"})


class OperationCounter(TorchDispatchMode):
    """Counts the aten operations dispatched, and the matrix multiplications among them."""

    def __init__(self):
        super().__init__()
        self.operations = self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.operations += 1
        self.matmuls += func.overloadpacket in MATMULS
        return func(*args, **(kwargs or {}))


class PerParameterMuonAdamW:
    """MuonAdamW's step before same-shape stacks (commit 0d37b51), for timing: a Python loop over the matrices, torch's default AdamW."""

    def __init__(self, groups: list[dict]):
        self.param_groups = [MuonAdamW([group]).param_groups[0] for group in groups]  # the same defaults
        self.state = defaultdict(dict)

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon_step(group)
            else:
                self._adamw_step(group)
            group["step"] += 1

    def _muon_step(self, group: dict) -> None:
        momentum = muon_momentum(group["step"], group["momentum"], group["momentum_warmup_start"],
                                 group["momentum_warmup_steps"])  # fmt: skip
        lr, weight_decay = group["lr"], group["weight_decay"]
        for param in group["params"]:
            state = self.state[param]
            if not state:
                rows, cols = param.shape
                state["momentum_buffer"] = torch.zeros_like(param)
                state["second_moment"] = torch.zeros((rows, 1) if rows >= cols else (1, cols), device=param.device)
            state["momentum_buffer"].lerp_(param.grad, 1 - momentum)
            update = param.grad.lerp(state["momentum_buffer"], momentum)
            dtype = MuonSettings.from_group(group).orthogonalize_dtype_on(param.device)
            if group["muon_eq"] is not None:
                update = equilibrate(update, group["muon_eq"])
            update = orthogonalize(update, group["ns_coefficients"], norm_safety=group["ns_norm_safety"],
                                   eps=group["eps"], dtype=dtype)  # fmt: skip
            if group["muon_plus"]:
                update = renormalize(update)
            update = normuon_rescale(update, state["second_moment"], group["beta2"])
            param.sub_(param * (update * param >= 0), alpha=lr * weight_decay)
            param.add_(update, alpha=-lr * max(1.0, param.size(0) / param.size(1)) ** 0.5)

    def _adamw_step(self, group: dict) -> None:
        for param in group["params"]:
            if not self.state[param]:
                self.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                     "exp_avg_sq": torch.zeros_like(param)}  # fmt: skip
        states = [self.state[param] for param in group["params"]]
        beta1, beta2 = group["betas"]
        adamw(group["params"], [p.grad for p in group["params"]], [s["exp_avg"] for s in states],
              [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], amsgrad=False, beta1=beta1,
              beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
              maximize=False)  # fmt: skip


def make_model(args: StepArguments, device: torch.device) -> L3GPTForCausalLM:
    config = ModelShape.of(args).config(window_pattern="L", l3_after_layers=args.l3_after_layers)
    torch.manual_seed(0)
    with torch.device(device):
        return L3GPTForCausalLM(config)


def make_arms(model: L3GPTForCausalLM, args: StepArguments, device: torch.device) -> dict:
    """Each arm: (its copy of the model's parameters, its optimizer on them)."""

    def copy_of_model() -> L3GPTForCausalLM:
        return copy.deepcopy(model)

    def muon_groups(twin: L3GPTForCausalLM) -> list[dict]:
        groups = param_groups_by_kind(twin)
        for group in groups:
            if group["kind"] == "muon":
                group["weight_decay"] = args.weight_decay
        return groups

    fused = device.type == "cuda"
    twins = {"adamw": copy_of_model()}
    optimizers = {"adamw": torch.optim.AdamW(twins["adamw"].parameters(), lr=1e-3, fused=fused, foreach=not fused)}
    for name, compiled in (("muon_eager", False), ("muon_compiled", True))[: 2 if args.compiled else 1]:
        twins[name] = copy_of_model()
        optimizers[name] = MuonAdamW(muon_groups(twins[name]), compile_update=compiled)
    twins["per_parameter"] = copy_of_model()
    optimizers["per_parameter"] = PerParameterMuonAdamW(muon_groups(twins["per_parameter"]))
    return {name: (list(twins[name].parameters()), optimizers[name]) for name in optimizers}


def state_megabytes(optimizer) -> float:
    storages = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values()) / 2**20


def time_step(optimizer, device: torch.device) -> dict:
    if device.type != "cuda":
        wall, cpu = time.perf_counter(), time.process_time()
        optimizer.step()
        return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    wall, cpu = time.perf_counter(), time.process_time()
    start.record()
    optimizer.step()
    end.record()
    cpu = time.process_time() - cpu
    torch.cuda.synchronize()
    return {"wall": time.perf_counter() - wall, "cpu": cpu, "gpu": start.elapsed_time(end) / 1e3}


def count_step(optimizer, device: torch.device) -> dict:
    """What one step dispatches: aten operations and matmuls (not under compile, which a dispatch mode turns off),
    on CUDA the GPU kernels and copies launched and the step's extra peak memory; and the optimizer state MB."""
    counts = {"state_mb": state_megabytes(optimizer), "operations": None, "matmuls": None}
    if not getattr(optimizer, "compile_update", False):
        with OperationCounter() as counter:
            optimizer.step()
        counts.update(operations=counter.operations, matmuls=counter.matmuls)
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            optimizer.step()
            torch.cuda.synchronize()
        counts["step_extra_peak_mb"] = (torch.cuda.max_memory_allocated() - before) / 2**20
        counts["gpu_kernels"] = sum(event.device_type == torch.autograd.DeviceType.CUDA for event in profile.events())
    return counts


def print_table(summary: dict, gpu: bool) -> None:
    columns = ["wall ms", "× adamw", "CPU ms"] + (["GPU ms", "GPU kernels", "extra peak MB"] if gpu else [])
    columns += ["aten ops", "matmuls", "state MB"]
    print("| arm | " + " | ".join(columns) + " |\n" + "|---" * (len(columns) + 1) + "|")
    for name, row in summary.items():
        values = [f"{row['wall']:.2f}", f"{row['x_adamw']:.2f}", f"{row['cpu']:.2f}"]
        values += [f"{row['gpu']:.2f}", str(row["gpu_kernels"]), f"{row['step_extra_peak_mb']:.0f}"] if gpu else []
        values += ["—" if row[key] is None else str(row[key]) for key in ("operations", "matmuls")]
        print(f"| {name} | " + " | ".join(values + [f"{row['state_mb']:.1f}"]) + " |")


def update_difference(model, params: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """‖Δw − Δw_reference‖ / ‖Δw_reference‖ over all weights, Δw = the first step's change of the weights. (The
    largest elementwise difference says little: cautious weight decay flips where an update element is ~0.)"""
    squares = [((p - r).square().sum().item(), (r - w).square().sum().item())
               for p, r, w in zip(params, reference, model.parameters())]  # fmt: skip
    return (sum(s[0] for s in squares) / sum(s[1] for s in squares)) ** 0.5


def main(args: StepArguments) -> dict:
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    model = make_model(args, device)
    generator = torch.Generator(device).manual_seed(1)
    grads = [torch.randn(p.shape, device=device, generator=generator) for p in model.parameters()]
    arms = make_arms(model, args, device)
    for params, _ in arms.values():
        for param, grad in zip(params, grads):
            param.grad = grad  # steps never modify gradients: every arm reads the same ones at every step

    for _, optimizer in arms.values():
        optimizer.step()
    differences = {name: update_difference(model, params, arms["per_parameter"][0])
                   for name, (params, _) in arms.items() if name.startswith("muon")}  # fmt: skip
    for _, optimizer in arms.values():
        for _ in range(args.warmup_steps - 1):
            optimizer.step()
    counts = {name: count_step(optimizer, device) for name, (_, optimizer) in arms.items()}
    samples = {name: [] for name in arms}
    for _ in range(args.steps):
        for name, (_, optimizer) in arms.items():
            samples[name].append(time_step(optimizer, device))

    summary = {}
    for name, steps in samples.items():
        summary[name] = {key: 1e3 * statistics.median(step[key] for step in steps) for key in steps[0]}
        summary[name].update(counts[name], x_adamw=summary[name]["wall"] / summary["adamw"]["wall"])
    default = "muon_compiled" if device.type == "cuda" and args.compiled else "muon_eager"
    matrices = next(group for group in param_groups_by_kind(model) if group["kind"] == "muon")["params"]
    machine = machine_name(device.type)
    load = os.getloadavg()
    print(f"\nOptimizer step, L3GPT depth {args.depth}, hidden {model.config.hidden_size}, vocab "
          f"{model.config.vocab_size}, L3 after {args.l3_after_layers or 'none'}: {len(matrices)} Muon matrices in "
          f"{len({tuple(p.shape) for p in matrices})} shapes, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
          f"parameters; {machine}, torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
          f"{load[0]:.2f}; medians of {args.steps} alternating steps\n")  # fmt: skip
    print_table(summary, device.type == "cuda")
    ratio = summary[default]["x_adamw"]
    verdict = ("met" if ratio <= 3 else "NOT met") if device.type == "cuda" else "set for the GPU"
    print(f"\nMuonAdamW ({default}, the default here) / AdamW: {ratio:.2f}× (goal ≤ 3×: {verdict}); "
          f"per_parameter / {default}: {summary['per_parameter']['wall'] / summary[default]['wall']:.2f}×; "
          "first update vs per_parameter's, relative difference: "
          + ", ".join(f"{name} {value:.1e}" for name, value in differences.items()))  # fmt: skip
    results = {"args": asdict(args), "machine": machine, "torch": torch.__version__,
               "threads": torch.get_num_threads(), "load_average": load, "muon_matrices": len(matrices),
               "default_arm": default, "relative_update_difference_vs_per_parameter": differences, "arms": summary,
               "samples_ms": {name: [1e3 * s["wall"] for s in steps] for name, steps in samples.items()}}  # fmt: skip
    return write_result(args.json, results)


if __name__ == "__main__":
    main(HfArgumentParser(StepArguments).parse_args_into_dataclasses()[0])
