"""Saving a checkpoint with provenance in its safetensors header: the header completed by copying the file (what
hfl3 did until 2026-11-24) vs in place (`add_safetensors_metadata`: over the old header, or after inserting
file-system blocks before the tensors where the file system can).

In one process: an L3GPT of about `--gigabytes` float32 weights saved with `save_pretrained` into a fresh folder,
then its header stamped with a real run's `provenance_header` by each arm, in turn, `--repeats` times (the median
reported). `save_pretrained`'s own time is the reference the stamping adds to. The files land in the page cache
(no fsync: neither the Trainer nor hfl3 syncs a save), so the copy's cost here is a memory copy plus the write-back
the kernel does afterwards; on a slow or network disk it is larger.

    python benchmarks/save_header.py --json benchmarks/results/save_header_cpu.json
"""

import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser

from hfl3 import L3GPTConfig, L3GPTForCausalLM
from hfl3.provenance import add_safetensors_metadata, build_metadata, package_versions, provenance_header
from hfl3.provenance.safetensors_header import _insert_blocks_at_start

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

ARMS = ("copy", "in_place")


@dataclass
class Args:
    gigabytes: float = field(default=1.0, metadata={"help": "float32 weights of the model saved (10^9 bytes)"})
    repeats: int = field(default=3, metadata={"help": "saves per arm (median reported)"})
    work: str = field(default="outputs/bench_save_header", metadata={"help": "folder the checkpoints go to"})
    json: str | None = field(default=None, metadata={"help": "write the results as JSON here"})


def sized_model(gigabytes: float) -> L3GPTForCausalLM:
    """A dense L3GPT (depth 12 shapes) whose vocabulary brings its float32 weights to about `gigabytes`."""
    def config(vocab: int) -> L3GPTConfig:
        return L3GPTConfig.from_depth(12, vocab_size=vocab, l3_after_layers=[], max_position_embeddings=256)

    small, larger = (4 * L3GPTForCausalLM(config(vocab)).num_parameters() for vocab in (64, 128))
    per_token = (larger - small) / 64  # the embedding, lm_head and value-embedding rows of one token
    return L3GPTForCausalLM(config(max(64, int((gigabytes * 1e9 - small) / per_token + 64) // 64 * 64)))


def main(args: Args) -> dict:
    torch.manual_seed(0)
    model = sized_model(args.gigabytes)
    header = provenance_header(build_metadata(data={"source": "stdlib", "train_tokens_sha256": "0" * 64},
                                              model=model.config.to_dict(), results={"eval_bpb": 1.0}))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    probe = work / "probe"
    probe.write_bytes(b"\0" * 8192)
    with open(probe, "r+b") as f:
        inserts = bool(_insert_blocks_at_start(f.fileno(), 1))
    probe.unlink()
    times = {"save_pretrained": [], **{arm: [] for arm in ARMS}}
    for repeat in range(args.repeats):
        for arm in ARMS:
            folder = work / f"{arm}_{repeat}"
            start = time.perf_counter()
            model.save_pretrained(folder)
            times["save_pretrained"].append(time.perf_counter() - start)
            file = folder / "model.safetensors"
            start = time.perf_counter()
            add_safetensors_metadata(file, header, in_place=arm == "in_place")
            times[arm].append(time.perf_counter() - start)
            size = file.stat().st_size
            for path in folder.iterdir():
                path.unlink()
            folder.rmdir()
    median = {name: statistics.median(values) for name, values in times.items()}
    save = median["save_pretrained"]
    print(f"\nmodel.safetensors {size / 1e9:.3f} GB, header {sum(map(len, header.values())) / 1e3:.1f} kB of provenance; "
          f"file system inserts blocks: {inserts}; median of {args.repeats}")
    print(f"{'':<22}{'seconds':>9}{'save + header / save':>22}")
    print(f"{'save_pretrained':<22}{save:>9.3f}{1:>22.3f}")
    for arm in ARMS:
        print(f"{'header by ' + arm:<22}{median[arm]:>9.3f}{(save + median[arm]) / save:>22.3f}")
    print(f"in place / copy: {median['in_place'] / median['copy']:.4f}")
    return write_result(args.json, {
        "args": asdict(args), "versions": package_versions(), "file_bytes": size, "inserts_blocks": inserts,
        "threads": torch.get_num_threads(), "seconds": times, "median_seconds": median})


if __name__ == "__main__":
    (parsed,) = HfArgumentParser(Args).parse_args_into_dataclasses(args=sys.argv[1:])
    main(parsed)
