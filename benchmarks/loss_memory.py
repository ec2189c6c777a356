"""Training loss of L3GPT: the plain path (full float32 logits, softcap, `loss_function`) vs the memory-light one
(`linear_cross_entropy`: Liger's fused kernel on CUDA when installed, the chunked PyTorch function elsewhere). Where
Liger is the memory-light path, a third path runs the chunked PyTorch function on the same device (`pytorch_chunked`):
the one that `torch.compile` keeps inside the training graph, against Liger's two host syncs per step and graph break.

One forward + backward of a small dense L3GPT with `labels` in training mode, each path in a fresh child process
(`return_logits=True` selects the plain path): peak memory over the step (CUDA `max_memory_allocated`; on CPU the
growth of the peak RSS, VmHWM, over the RSS before the step, with glibc's mmap threshold fixed so that freed tensors
leave the RSS), median time of `--repeats` steps, and the loss and gradient norm (both paths must agree).

    python benchmarks/loss_memory.py                                   # CPU: vocab 32768, hidden 256, 8 × 512
    python benchmarks/loss_memory.py --json benchmarks/results/loss_memory_cpu.json
    python benchmarks/loss_memory.py --device cuda --batch_size 16 --seq_len 2048 --bf16 true
"""

import contextlib
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser

from hfl3 import L3GPTForCausalLM
from hfl3.models.l3gpt import linear_cross_entropy
from hfl3.models.l3gpt.linear_cross_entropy import liger_applies

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ModelShape, in_fresh_process, write_result  # noqa: E402
from l3_forward import cpu_resident_bytes  # noqa: E402

PATHS = ("plain", "chunked")
PYTORCH_CHUNKED = "pytorch_chunked"  # the chunked function where Liger would be chosen


@dataclass
class Args:
    vocab_size: int = field(default=32768, metadata={"help": "V"})
    hidden_size: int = field(default=256, metadata={"help": "C (depth = C / 64, head_dim 128)"})
    batch_size: int = field(default=8, metadata={"help": "B"})
    seq_len: int = field(default=512, metadata={"help": "T"})
    bf16: bool = field(default=False, metadata={"help": "bf16 autocast (as the Trainer's --bf16)"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda"})
    repeats: int = field(default=3, metadata={"help": "timed steps per path (median reported)"})
    json: str | None = field(default=None, metadata={"help": "write the results as JSON here"})


def step(model, ids, path: str, bf16: bool) -> torch.Tensor:
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = model(input_ids=ids, labels=ids, return_logits=path == "plain").loss
    loss.backward()
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    return loss.detach()


def peak_growth(run, device: str):
    """`(run(), bytes)`: the peak memory during `run` above the memory before it (CUDA allocator, or VmHWM)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        return run(), torch.cuda.max_memory_allocated() - before
    before = cpu_resident_bytes(reset_peak=True)
    return run(), cpu_resident_bytes(peak=True) - before


@contextlib.contextmanager
def without_liger(active: bool):
    """`linear_cross_entropy` picks its chunked function while active, as where liger-kernel is not installed."""
    installed = linear_cross_entropy.LIGER_INSTALLED
    linear_cross_entropy.LIGER_INSTALLED = installed and not active
    try:
        yield
    finally:
        linear_cross_entropy.LIGER_INSTALLED = installed


def measure_path(args: Args, path: str) -> dict:
    """One path's step in this process (call it in a fresh one: the peak is the process's own); `path` is one of
    `PATHS` or `PYTORCH_CHUNKED`."""
    with without_liger(path == PYTORCH_CHUNKED):
        return _measure_path(args, path)


def _measure_path(args: Args, path: str) -> dict:
    torch.manual_seed(0)
    config = ModelShape.of(args, depth=args.hidden_size // 64, head_dim=128).config(l3_after_layers=[])
    model = L3GPTForCausalLM(config).to(args.device).train()
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.05)  # nanochat's 0.001 init would make every logit ~0
    ids = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), device=args.device)
    loss, peak = peak_growth(lambda: step(model, ids, path, args.bf16), args.device)
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    times = []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step(model, ids, path, args.bf16)
        times.append(time.perf_counter() - start)
    return {"path": path, "peak_bytes": peak, "seconds": statistics.median(times), "loss": loss.item(),
            "grad_norm": grad_norm, "threads": torch.get_num_threads()}


def main(args: Args) -> dict:
    """The paths, each in a fresh process; returns (and with `--json` writes) `{"args", "versions", "fused",
    "logits_bytes", "results": [plain, chunked(, pytorch_chunked where fused is Liger)]}`."""
    fused = "liger" if liger_applies(torch.empty(0, device=args.device)) else "chunked (PyTorch)"
    paths = PATHS + ((PYTORCH_CHUNKED,) if fused == "liger" else ())
    # glibc's fixed mmap threshold returns every freed large tensor to the OS, so the RSS tracks live tensors
    results = [in_fresh_process(measure_path, args, path, env={"MALLOC_MMAP_THRESHOLD_": "65536"}) for path in paths]
    plain, chunked = results[:2]
    logits_bytes = args.batch_size * args.seq_len * args.vocab_size * 4
    print(f"\nL3GPT training forward+backward, B={args.batch_size} T={args.seq_len} V={args.vocab_size} "
          f"C={args.hidden_size}, {args.device}{' bf16 autocast' if args.bf16 else ''}, memory-light loss: {fused}; "
          f"(B, T, V) float32 logits = {logits_bytes / 2**20:.0f} MiB")
    header = f"{'path':<16}{'peak MiB':>10}{'ratio':>7}{'s/step':>8}{'ratio':>7}{'loss':>10}{'grad norm':>11}"
    print(header + "\n" + "-" * len(header))
    def ratio(value: float, reference: float) -> float:
        return value / reference if reference else math.nan  # an RSS peak can read 0 when measured in-process

    for r in results:
        print(f"{r['path']:<16}{r['peak_bytes'] / 2**20:>10.0f}{ratio(r['peak_bytes'], plain['peak_bytes']):>7.3f}"
              f"{r['seconds']:>8.2f}{ratio(r['seconds'], plain['seconds']):>7.2f}{r['loss']:>10.5f}"
              f"{r['grad_norm']:>11.5f}")
    print(f"|Δ loss| = {abs(chunked['loss'] - plain['loss']):.2e}, "
          f"relative Δ grad norm = {abs(ratio(chunked['grad_norm'], plain['grad_norm']) - 1):.2e}")
    from hfl3.provenance import package_versions

    return write_result(args.json, {"args": asdict(args), "versions": package_versions(), "fused": fused,
                                    "logits_bytes": logits_bytes, "results": results})


if __name__ == "__main__":
    main(HfArgumentParser(Args).parse_args_into_dataclasses()[0])
