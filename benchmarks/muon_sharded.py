"""Cost of Muon's sharded step: an optimizer step under DeepSpeed ZeRO-2, ZeRO-3 and FSDP2 vs DDP, on W
gloo CPU processes, with the Muon state each rank holds.

Every arm trains the same L3GPT (same seed, same fixed batch of `rows_per_rank` rows per rank) for `warmup_steps` +
`steps` steps, one arm after the other in the same processes:
  ddp     `DistributedDataParallel` + `MuonAdamW` (whole matrices on every rank)
  zero2   `deepspeed.initialize` with ZeRO stage 2 + `MuonAdamW` (flat fp32 partitions: hfl3.optim.sharded)
  zero3   the same with stage 3 (parameters partitioned too)
  fsdp2   accelerate's `fsdp2_prepare_model` (fsdp2.yaml's plugin) + `MuonAdamW` (DTensor shards)
and `--optimizers muon adamw` adds each scheme with torch's AdamW (foreach) for scale.

Per arm (medians over the timed steps, rank 0's clock; gloo collectives block, so waits are included):
  optimizer ms   the client optimizer's `step()` (under ZeRO-2 DeepSpeed calls it once per param group: summed)
  train ms       forward + backward + the scheme's step (DeepSpeed's engine.step(): gradient partitions, clipping,
                 the optimizer, the parameter all-gather)
  state MB/rank  Muon state (momentum + NorMuon second moments) each rank holds, `MuonAdamW.muon_state_bytes()`
  max |w - w_ddp| / lr  after the same steps, over the Muon matrices and over all parameters, in units of each
                 group's LR. A sanity check, not the equality test (tests/distributed: within 1e-5·lr): FSDP2 gives
                 DDP's bits; DeepSpeed's gradient path gives the zero-initialised output projections gradients that
                 differ by round-off at the first step (with AdamW too), which random tokens and Adam's division by
                 sqrt(v) grow over the steps, in the AdamW arms as much as in the Muon ones

    OMP_NUM_THREADS=1 python benchmarks/muon_sharded.py --json benchmarks/results/muon_sharded_cpu.json

GPU numbers (NCCL, d12) are owed: this script runs gloo on the CPU (`--backend nccl` on a multi-GPU machine with one
process per GPU is the intended use, untested).
"""

import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import HfArgumentParser

from hfl3 import L3GPTForCausalLM
from hfl3.optim import MuonAdamW, param_groups_by_kind
from hfl3.distributed import end_distributed_run

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ModelShape, write_result  # noqa: E402

SCHEMES = ("ddp", "zero2", "zero3", "fsdp2")
ADAMW_LR = 1e-3


@dataclass
class ShardedArguments:
    depth: int = field(default=4, metadata={"help": "decoder layers"})
    aspect_ratio: int = field(default=64, metadata={"help": "hidden_size = depth * aspect_ratio, rounded to head_dim"})
    head_dim: int = field(default=64, metadata={"help": "attention head width"})
    vocab_size: int = field(default=4096, metadata={"help": "vocabulary"})
    l3_after_layers: list[int] = field(default_factory=lambda: [1], metadata={"help": "L3 layers; [] for dense"})
    seq_len: int = field(default=64, metadata={"help": "tokens per row"})
    rows_per_rank: int = field(default=2, metadata={"help": "rows per rank and step"})
    world_size: int = field(default=2, metadata={"help": "processes"})
    backend: str = field(default="gloo", metadata={"help": "gloo (CPU) or nccl (one GPU per process)"})
    schemes: list[str] = field(default_factory=lambda: list(SCHEMES), metadata={"help": f"of {SCHEMES}"})
    optimizers: list[str] = field(default_factory=lambda: ["muon"], metadata={"help": "muon and/or adamw"})
    steps: int = field(default=10, metadata={"help": "timed steps per arm"})
    warmup_steps: int = field(default=2, metadata={"help": "untimed steps per arm first"})
    json: str | None = field(default=None, metadata={"help": "write the results here (JSON)"})


def make_model(args: ShardedArguments, device: torch.device) -> L3GPTForCausalLM:
    torch.manual_seed(0)
    config = ModelShape.of(args).config(window_pattern="L", l3_after_layers=args.l3_after_layers)
    return L3GPTForCausalLM(config).to(device)


def make_optimizer(model, name: str):
    if name == "muon":
        return MuonAdamW(param_groups_by_kind(model), compile_update=False)
    return torch.optim.AdamW(model.parameters(), lr=ADAMW_LR, betas=(0.8, 0.95), foreach=True)


class StepTimer:
    """Wraps `optimizer.step` on the instance (what DeepSpeed and the loops call) and sums its wall time."""

    def __init__(self, optimizer):
        self.seconds, self.step = 0.0, optimizer.step
        optimizer.step = self

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        result = self.step(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        return result


def prepare(scheme: str, model, optimizer, args: ShardedArguments, device):
    """(forward module, backward function, step function) of `scheme` for `model` and its `optimizer`."""
    if scheme == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)

        def step():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return wrapped, lambda loss: loss.backward(), step
    if scheme == "fsdp2":
        from accelerate.utils import FullyShardedDataParallelPlugin
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model, fsdp2_switch_optimizer_parameters

        os.environ.update({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                           "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"})  # accelerate_configs/fsdp2.yaml
        accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=FullyShardedDataParallelPlugin()),
                                      mixed_precision="no", is_main_process=dist.get_rank() == 0, device=device)
        pointers = {name: param.data_ptr() for name, param in model.named_parameters()}
        for group in optimizer.param_groups:  # as Accelerator._prepare_fsdp2: placeholders that keep the pointer
            group["params"] = [SimpleNamespace(data_ptr=param.data_ptr()) for param in group["params"]]
        wrapped = fsdp2_prepare_model(accelerator, model)
        fsdp2_switch_optimizer_parameters(optimizer, {pointers[name]: p for name, p in wrapped.named_parameters()})

        def step():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return wrapped, lambda loss: loss.backward(), step
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": args.rows_per_rank, "gradient_accumulation_steps": 1,
              "train_batch_size": args.rows_per_rank * args.world_size, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": int(scheme[-1]), "overlap_comm": False, "contiguous_gradients": True}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, engine.backward, engine.step


def full_weights(scheme: str, wrapped) -> dict[str, torch.Tensor]:
    """Every rank's call gathers; rank 0 gets the full weights."""
    if scheme == "zero3":
        return wrapped._zero3_consolidated_16bit_state_dict() or {}
    if scheme == "fsdp2":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    module = wrapped.module
    return {name: value.detach().float().cpu().clone() for name, value in module.state_dict().items()}


def run_arm(scheme: str, optimizer_name: str, args: ShardedArguments, device) -> dict:
    model = make_model(args, device)
    optimizer = make_optimizer(model, optimizer_name)
    timer = StepTimer(optimizer)
    wrapped, backward, step = prepare(scheme, model, optimizer, args, device)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    input_ids = torch.randint(0, args.vocab_size, (args.rows_per_rank, args.seq_len), generator=generator).to(device)
    optimizer_ms, train_ms = [], []
    for index in range(args.warmup_steps + args.steps):
        dist.barrier()
        timer.seconds, start = 0.0, time.perf_counter()
        backward(wrapped(input_ids=input_ids, labels=input_ids).loss)
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if index >= args.warmup_steps:
            train_ms.append(1e3 * (time.perf_counter() - start))
            optimizer_ms.append(1e3 * timer.seconds)
    state_bytes = [0] * args.world_size
    dist.all_gather_object(state_bytes, optimizer.muon_state_bytes() if optimizer_name == "muon" else 0)
    return {"optimizer_ms": statistics.median(optimizer_ms), "train_ms": statistics.median(train_ms),
            "muon_state_bytes_per_rank": state_bytes, "weights": full_weights(scheme, wrapped)}


def worker(rank: int, args: ShardedArguments, store: str, results_path: str) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.world_size)})
    device = torch.device("cuda", rank) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method=f"file://{store}", rank=rank, world_size=args.world_size)
    if {"zero2", "zero3"} & set(args.schemes):
        import deepspeed

        deepspeed.init_distributed(dist_backend=args.backend)  # adopts the process group
    results = {f"{scheme}/{name}": run_arm(scheme, name, args, device)
               for name in args.optimizers for scheme in args.schemes}
    if rank == 0:
        torch.save(results, results_path)
    end_distributed_run()  # after FSDP2's DTensors, gloo's threads outlive destroy_process_group


def main(args: ShardedArguments) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        raw = Path(folder) / "rank0.pt"
        mp.spawn(worker, args=(args, str(Path(folder) / "store"), str(raw)), nprocs=args.world_size, join=True)
        arms = torch.load(raw, weights_only=False)
    reference_model = make_model(args, torch.device("cpu"))
    names = {id(param): name for name, param in reference_model.named_parameters()}
    muon_lrs = {names[id(p)]: (g["lr"], g["kind"]) for g in param_groups_by_kind(reference_model) for p in g["params"]}
    matrices = {name for name, (_, kind) in muon_lrs.items() if kind == "muon"}
    summary = {}
    for key, arm in arms.items():
        scheme, name = key.split("/")
        ddp = arms.get(f"ddp/{name}")
        differences = {}
        if ddp:
            for parameter, (lr, _) in muon_lrs.items():
                lr = lr if name == "muon" else ADAMW_LR
                differences[parameter] = (arm["weights"][parameter].float() - ddp["weights"][parameter].float()
                                          ).abs().max().item() / lr
        summary[key] = {
            "optimizer_ms": arm["optimizer_ms"], "train_ms": arm["train_ms"],
            "x_ddp_optimizer": arm["optimizer_ms"] / ddp["optimizer_ms"] if ddp else None,
            "x_ddp_train": arm["train_ms"] / ddp["train_ms"] if ddp else None,
            "muon_state_mb_per_rank": [b / 2**20 for b in arm["muon_state_bytes_per_rank"]],
            "max_difference_over_lr": {"matrices": max(differences[n] for n in matrices),
                                       "all": max(differences.values())} if differences else None,
        }
    load = os.getloadavg()
    print(f"\nL3GPT depth {args.depth}, hidden {reference_model.config.hidden_size}, vocab {args.vocab_size}, L3 after "
          f"{args.l3_after_layers or 'none'}: {len(matrices)} Muon matrices, "
          f"{sum(p.numel() for p in reference_model.parameters()) / 1e6:.1f} M parameters; {args.world_size} "
          f"{args.backend} processes x {args.rows_per_rank} rows x {args.seq_len} tokens; CPU, {os.cpu_count()} "
          f"cores, load average {load[0]:.2f}; medians of {args.steps} steps\n")
    print(f"{'arm':12s} {'optimizer ms':>12s} {'x DDP':>6s} {'train ms':>9s} {'x DDP':>6s} "
          f"{'Muon state MB / rank':>21s} {'max |w - w_ddp| / lr: matrices, all':>36s}")
    for key, row in summary.items():
        state = ", ".join(f"{mb:.2f}" for mb in row["muon_state_mb_per_rank"])
        difference = row["max_difference_over_lr"]
        difference = f"{difference['matrices']:.1e}, {difference['all']:.1e}" if difference else ""
        print(f"{key:12s} {row['optimizer_ms']:12.1f} {row['x_ddp_optimizer'] or float('nan'):6.2f} "
              f"{row['train_ms']:9.1f} {row['x_ddp_train'] or float('nan'):6.2f} {state:>21s} {difference:>36s}")
    results = {"args": asdict(args), "torch": torch.__version__, "load_average": load, "muon_matrices": len(matrices),
               "arms": summary}
    return write_result(args.json, results)


if __name__ == "__main__":
    main(HfArgumentParser(ShardedArguments).parse_args_into_dataclasses()[0])
