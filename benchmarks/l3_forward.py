"""L3 lookup: hfl3's pair-based forward vs the naive padded gather, on the same inputs.

Checks equal outputs and gradients (float32, relative error), then measures, for forward + backward of the lookup:
- activation memory: bytes of the tensors autograd saves for backward (parameters excluded; saved_tensors_hooks),
- peak memory: CUDA `max_memory_allocated` on a GPU; on CPU the growth of the peak RSS (VmHWM) of a fresh child
  process over its RSS before the measured forward + backward,
- time: median of `--repeats` runs.

Two routings: a uniform allocation (every token owns mean rows, `k_max = 16 × mean`), and the LZW allocation of a
real-text sample routed by that text (frequent tokens own k_max rows, so the routed mean is higher).

    python benchmarks/l3_forward.py                      # CPU, default sizes
    python benchmarks/l3_forward.py --device cuda --tokens 16384 --hidden_size 1024
    python benchmarks/l3_forward.py --json benchmarks/results/l3_forward.json
"""

import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser

from hfl3 import L3GPTConfig
from hfl3.models.l3gpt import bounds_from_counts, l3_routing, lzw_allocation, uniform_allocation
from hfl3.models.l3gpt.modeling_l3gpt import LargeLookupLayer
from hfl3.models.l3gpt.reference import padded_lookup_reference

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import find_asset, in_fresh_process, write_result  # noqa: E402


@dataclass
class Args:
    tokens: int = field(default=8192, metadata={"help": "routed tokens N = batch·seq"})
    hidden_size: int = field(default=512, metadata={"help": "C, width of hidden states and table rows"})
    vocab_size: int = field(default=8192, metadata={"help": "vocabulary size"})
    mean_rows: int = field(default=4, metadata={"help": "l3_n_emb / vocab_size"})
    k_max_factor: int = field(default=16, metadata={"help": "k_max = k_max_factor × mean_rows"})
    repeats: int = field(default=3, metadata={"help": "timed runs per method (median reported)"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda"})
    json: str | None = field(default=None, metadata={"help": "write the results as JSON here"})


def make_case(args: Args, allocation: str):
    """Layer, normed hidden states (N, C), ids (N,), bounds; deterministic for a given allocation name."""
    torch.manual_seed(0)
    n_emb, k_max = args.mean_rows * args.vocab_size, args.mean_rows * args.k_max_factor
    config = L3GPTConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_attention_heads=max(1, args.hidden_size // 128),
        num_hidden_layers=1, l3_after_layers=[0], l3_n_emb=n_emb, l3_k_max=k_max, l3_d_up=args.hidden_size,
    )
    layer = LargeLookupLayer(config).to(args.device)
    torch.nn.init.normal_(layer.key_table.weight)
    if allocation == "uniform":
        counts = uniform_allocation(args.vocab_size, n_emb, k_max)
        ids = torch.randint(0, args.vocab_size, (args.tokens,))
    else:
        ids = real_text_ids(args.vocab_size, args.tokens * 4)
        counts = lzw_allocation([ids.tolist()], args.vocab_size, n_emb, k_max)
        ids = ids[: args.tokens]
    bounds = bounds_from_counts(counts).to(args.device)
    x = torch.nn.functional.rms_norm(torch.randn(args.tokens, args.hidden_size), (args.hidden_size,))
    return layer, x.to(args.device), ids.to(args.device), bounds, k_max


def real_text_ids(vocab_size: int, n_tokens: int, max_chars: int | None = None) -> torch.LongTensor:
    """The first `n_tokens` tokens of (up to) three Gutenberg novels, their first `max_chars` characters if given,
    under a byte-level BPE of `vocab_size` ids trained here on that text.

    Raises:
        FileNotFoundError: no `text/gutenberg` assets folder (see `common.find_asset`).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = "".join(p.read_text() for p in sorted(find_asset("text/gutenberg").glob("*.txt"))[:3])[:max_chars]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text], trainer)
    ids = torch.tensor(tokenizer.encode(text).ids[:n_tokens])
    return ids


def run(method: str, layer, x, ids, bounds, k_max):
    """Forward + backward of one method; returns (output, grads, saved-activation bytes)."""
    x = x.detach().clone().requires_grad_()
    saved: dict[int, int] = {}
    params = {p.data_ptr() for p in layer.parameters()}

    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if method == "hfl3":
            out = layer.lookup(x, l3_routing(ids, bounds))
        else:
            table = layer.key_table.weight
            out = padded_lookup_reference(x, table, table, bounds, ids, k_max)
    grads = torch.autograd.grad(out, [x, layer.key_table.weight], torch.ones_like(out))
    return out.detach(), grads, sum(saved.values())


def cpu_resident_bytes(reset_peak: bool = False, peak: bool = False) -> int:
    """Resident set size (bytes) of this process from /proc (Linux); `reset_peak` restarts the high-water mark
    (writing 5 to clear_refs), `peak` reads it (VmHWM) instead of the current value (VmRSS)."""
    if reset_peak:
        Path("/proc/self/clear_refs").write_text("5")
    key = "VmHWM:" if peak else "VmRSS:"
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no /proc/self/status: CPU peak memory needs Linux")


def measure_method(args: Args, method: str, allocation: str) -> dict:
    """Memory and time of one method in this process (call it in a fresh one: the peak is the process's own)."""
    layer, x, ids, bounds, k_max = make_case(args, allocation)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = cpu_resident_bytes(reset_peak=True)
    _, _, activation_bytes = run(method, layer, x, ids, bounds, k_max)
    peak = (torch.cuda.max_memory_allocated() if args.device == "cuda" else cpu_resident_bytes(peak=True)) - base
    times = []
    for _ in range(args.repeats):
        sync()
        start = time.perf_counter()
        run(method, layer, x, ids, bounds, k_max)
        sync()
        times.append(time.perf_counter() - start)
    return {"activation_bytes": activation_bytes, "peak_bytes": peak, "seconds": statistics.median(times)}


def main(args: Args) -> None:
    results = []
    for allocation in ("uniform", "lzw-real-text"):
        layer, x, ids, bounds, k_max = make_case(args, allocation)
        fast_out, fast_grads, _ = run("hfl3", layer, x, ids, bounds, k_max)
        ref_out, ref_grads, _ = run("padded", layer, x, ids, bounds, k_max)
        rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
        errors = [rel(fast_out, ref_out)] + [rel(a, b) for a, b in zip(fast_grads, ref_grads)]
        sizes = (bounds[ids + 1] - bounds[ids]).float()
        row = {"allocation": allocation, "k_max": k_max, "routed_mean_rows": sizes.mean().item(),
               "max_rel_error": max(errors)}
        for method in ("hfl3", "padded"):
            row[method] = in_fresh_process(measure_method, args, method, allocation)
        results.append(row)
    print(f"\nL3 lookup fwd+bwd, N={args.tokens} tokens, C={args.hidden_size}, vocab={args.vocab_size}, "
          f"mean rows={args.mean_rows}, device={args.device}")
    header = f"{'allocation':<14}{'k_max':>6}{'routed mean':>12}{'rel err':>10}{'act MB ours':>12}" \
             f"{'act MB naive':>13}{'act ratio':>10}{'peak MB ours':>13}{'peak MB naive':>14}{'ms ours':>9}" \
             f"{'ms naive':>9}{'speedup':>8}"
    print(header)
    for r in results:
        ours, naive = r["hfl3"], r["padded"]
        print(f"{r['allocation']:<14}{r['k_max']:>6}{r['routed_mean_rows']:>12.1f}{r['max_rel_error']:>10.1e}"
              f"{ours['activation_bytes'] / 2**20:>12.1f}{naive['activation_bytes'] / 2**20:>13.1f}"
              f"{ours['activation_bytes'] / naive['activation_bytes']:>10.3f}"
              f"{ours['peak_bytes'] / 2**20:>13.1f}{naive['peak_bytes'] / 2**20:>14.1f}"
              f"{ours['seconds'] * 1e3:>9.1f}{naive['seconds'] * 1e3:>9.1f}{naive['seconds'] / ours['seconds']:>8.2f}")
    write_result(args.json, {"args": asdict(args), "results": results})


if __name__ == "__main__":
    main(HfArgumentParser(Args).parse_args_into_dataclasses()[0])
