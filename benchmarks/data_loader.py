"""The streamed pretraining data: packed tokens/s of the loader alone against the tokenizer's own
`encode_batch` rate in the same run, and the recipe's peak memory with a 2 GB corpus against a 50 MB one.

    python benchmarks/data_loader.py --json benchmarks/results/data_loader_cpu.json
    python benchmarks/data_loader.py --skip_memory          # throughput only (~4 minutes)

Corpora (built once under `--work_dir`, default build/data_loader, and reused): the nine Gutenberg novels of the
assets' text/gutenberg folder (see benchmarks/common.py), each cut at blank lines into paragraphs and the paragraphs
grouped into documents of at least `--document_chars` characters (about FineWeb-Edu's mean document), repeated
until the corpus size is reached and written half as parquet shards (column `text`, 1000 documents per row group)
and half as text shards (documents separated by `<|endoftext|>`), each shard ~25 MB: `corpus_50mb/` (2 shards) and
`corpus_2gb/` (80 shards).

Tokenizer: a 32768-token byte-level BPE (`hfl3.tokenization.train_tokenizer`) trained on the novels, saved under
`--work_dir` for the recipe runs.

Throughput, on documents of `corpus_50mb/` (`max_seq_len` 2048, documents whole, as recipes/configs/fineweb_d12.yaml;
`TOKENIZERS_PARALLELISM=false`, so every tokenizer call uses one thread):
- `encode_batch`: the loader's documents in its reading order, 64 per call, through the tokenizer's
  `encode_batch_fast` (what the loader calls); tokens produced per second, not counting the documents the loader
  reads before its first row (its buffers). Alternates with the loader (`--rounds`, medians), each with a fresh copy
  of the tokenizer (an empty BPE cache).
- `loader, main process`: `PackedStream` stream 0 of 1 (reading, hash split, tokenization, shuffle buffer, best-fit
  packing, a state update per batch of 16 rows); input tokens per second (tokens of the documents taken into rows,
  packed + cropped: the work done) and packed tokens per second (in rows). Their ratio to `encode_batch` is the
  pipeline's cost: goal >= 0.9.
- `DataLoader, N workers`: `stream_dataloader` with `PackedCollator`, as the Trainer reads it: packed tokens/s
  across N worker processes. The d12 step consumes ~450k tokens/s on one H100 (nanochat's d12: 444k, docs/design.md, nanochat and L3GPT); the table says whether this
  machine's loader reaches it.

Memory: `python recipes/pretrain.py` on each corpus with the same flags (`--max_steps 20`, a tiny dense model, rows
of 256 tokens, the 32k tokenizer, 2 DataLoader workers, 1% hash split, 16 validation rows): peak RSS of the process
tree (the recipe and its workers, sampled every 0.1 s with psutil; forked workers share pages, counted in each) and
the recipe process's own peak (Linux `VmHWM`). Goal: 2 GB / 50 MB <= 1.15.

The box is shared: the table prints `uptime`'s load next to the numbers; re-run on a quiet machine for the record.
"""

import copy
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
from transformers import HfArgumentParser

from hfl3.data.packing import PackingReport
from hfl3.data.sources import open_corpus
from hfl3.data.streaming import DocumentSource, DocumentSplit, PackedStream, StreamProgress, stream_dataloader
from hfl3.tokenization import load_tokenizer, train_tokenizer
from hfl3.trainers.pretraining.trainer import PackedCollator

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from common import find_asset, write_result  # noqa: E402

SEPARATOR = "<|endoftext|>"
SHARD_BYTES = 25_000_000
D12_TOKENS_PER_SECOND = 450_000  # nanochat's d12 step on one H100: 444k tok/s measured (docs/design.md, nanochat and L3GPT)


@dataclass
class LoaderArguments:
    work_dir: str = field(default=str(REPO_ROOT / "build" / "data_loader"), metadata={"help": "corpora, tokenizer"})
    document_chars: int = field(default=4000, metadata={"help": "paragraphs grouped into documents of >= this"})
    vocab_size: int = field(default=32768, metadata={"help": "BPE vocabulary"})
    max_seq_len: int = field(default=2048, metadata={"help": "packed row length"})
    throughput_tokens: int = field(default=3_000_000, metadata={"help": "packed tokens per throughput measurement"})
    rounds: int = field(default=3, metadata={"help": "loader and encode_batch measurements (medians reported)"})
    workers: list[int] = field(default_factory=lambda: [1, 2], metadata={"help": "DataLoader worker counts"})
    skip_memory: bool = field(default=False, metadata={"help": "throughput only"})
    json: str | None = field(default=None, metadata={"help": "write the results here (JSON)"})


def novel_documents(min_chars: int) -> list[str]:
    documents = []
    for novel in sorted(find_asset("text/gutenberg").glob("*.txt")):
        document = ""
        for paragraph in novel.read_text().split("\n\n"):
            document = f"{document}\n\n{paragraph}" if document else paragraph
            if len(document) >= min_chars:
                documents.append(document)
                document = ""
    return documents


def build_corpus(folder: Path, total_bytes: int, documents: list[str]) -> Path:
    """Parquet and text shards of ~SHARD_BYTES alternating until `total_bytes`; kept if already complete."""
    done = folder / "COMPLETE"
    if done.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    written, shard, cursor = 0, 0, 0
    while written < total_bytes:
        batch, size = [], 0
        while size < SHARD_BYTES:
            batch.append(documents[cursor % len(documents)])
            size += len(batch[-1].encode())
            cursor += 1
        if shard % 2 == 0:
            pq.write_table(pa.table({"text": batch}), folder / f"shard{shard:04d}.parquet", row_group_size=1000)
        else:
            (folder / f"shard{shard:04d}.txt").write_text(SEPARATOR.join(batch))
        written, shard = written + size, shard + 1
    done.write_text(f"{written} bytes of text in {shard} shards\n")
    return folder


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def encode_rate(packed: PackedStream, warmup_documents: int, max_tokens: int) -> dict:
    """`encode_batch_fast` over the documents of stream 0 of 1 in the loader's reading order (batches of
    `read_batch`), after `warmup_documents` untimed ones (the loader's first batch reads as many to fill its buffers);
    tokens produced per second."""
    backend, tokens, read, seconds = packed.tokenizer.backend_tokenizer, 0, 0, 0.0
    for texts, _, _ in packed.source.batches():
        start = time.perf_counter()
        produced = sum(len(e.ids) + 1 for e in backend.encode_batch_fast(texts, add_special_tokens=False))
        if read >= warmup_documents:
            seconds += time.perf_counter() - start
            tokens += produced
        read += len(texts)
        if tokens >= max_tokens:
            break
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}


def loader_rate(packed: PackedStream, max_tokens: int, batch_size: int = 16) -> dict:
    """Batches of rows with a state update each (what a batch carries to the trainer), timed after the first batch,
    which fills the shuffle and packing buffers; also how many documents that first batch read."""
    reader = packed.reader()
    for _ in range(batch_size):
        reader.next_row()
    warmup_documents, before = reader.counts["documents"], PackingReport.from_dict(vars(reader.packer.report))
    start = time.perf_counter()
    while reader.packer.report.packed_tokens - before.packed_tokens < max_tokens:
        for _ in range(batch_size):
            reader.next_row()
        reader.update()  # what every batch carries to the trainer
    seconds = time.perf_counter() - start
    report = reader.packer.report
    return {"warmup_documents": warmup_documents, "seconds": seconds,
            "packed_tokens_per_second": (report.packed_tokens - before.packed_tokens) / seconds,
            "input_tokens_per_second": (report.input_tokens - before.input_tokens) / seconds,
            "cropped_share": report.cropped_share}


def dataloader_rate(packed: PackedStream, workers: int, max_tokens: int, batch_size: int = 16) -> dict:
    progress = StreamProgress(packed.fingerprint(), rank=0, world_size=1, workers=workers)
    loader = stream_dataloader(packed, batch_size, PackedCollator(packed.tokenizer.bos_token_id), progress, workers)
    iterator, tokens = iter(loader), 0
    next(iterator)  # worker start-up is not throughput
    start = time.perf_counter()
    while tokens < max_tokens:
        tokens += next(iterator)["input_ids"].numel()
    seconds = time.perf_counter() - start
    del iterator
    return {"workers": workers, "packed_tokens_per_second": tokens / seconds, "seconds": seconds}


def recipe_memory(corpus: Path, tokenizer_dir: Path, output_dir: Path) -> dict:
    command = [sys.executable, str(REPO_ROOT / "recipes" / "pretrain.py"), "--dataset", str(corpus),
               "--document_separator", SEPARATOR, "--tokenizer_name_or_path", str(tokenizer_dir),
               "--output_dir", str(output_dir), "--max_steps", "20", "--depth", "2", "--aspect_ratio", "32",
               "--head_dim", "32", "--max_length", "256", "--window_pattern", "SL", "--per_device_train_batch_size",
               "4", "--per_device_eval_batch_size", "4", "--dataloader_num_workers", "2", "--val_fraction", "0.01",
               "--max_eval_rows", "16", "--eval_steps", "20", "--logging_steps", "10", "--report_to", "none",
               "--disable_tqdm", "true", "--sample_prompts", "The"]
    start, log = time.perf_counter(), output_dir.with_suffix(".log")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as out:
        process = psutil.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        peak_tree = peak_recipe = 0
        while process.poll() is None:
            try:
                tree = [process, *process.children(recursive=True)]
                peak_tree = max(peak_tree, sum(p.memory_info().rss for p in tree))
                peak_recipe = max(peak_recipe, high_water_mark(process.pid))
            except (psutil.Error, OSError):
                pass
            time.sleep(0.1)
    if process.returncode != 0:
        raise RuntimeError(f"recipe failed on {corpus}; log: {log}")
    return {"corpus": corpus.name, "seconds": time.perf_counter() - start, "peak_tree_rss_mb": peak_tree / 2**20,
            "recipe_process_peak_rss_mb": peak_recipe / 2**20}


def high_water_mark(pid: int) -> int:
    """Peak resident set size of process `pid` so far (Linux `VmHWM`), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def main(args: LoaderArguments) -> dict:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per tokenizer call, as in the recipe
    work = Path(args.work_dir)
    documents = novel_documents(args.document_chars)
    small = build_corpus(work / "corpus_50mb", 50_000_000, documents)
    tokenizer_dir = work / f"bpe_{args.vocab_size}"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        novels = [p.read_text() for p in sorted(find_asset("text/gutenberg").glob("*.txt"))]
        train_tokenizer(novels, args.vocab_size).save_pretrained(tokenizer_dir)
    tokenizer = load_tokenizer(str(tokenizer_dir))
    results = {"arguments": asdict(args), "load_before": load_average(), "cpus": os.cpu_count()}

    corpus = open_corpus(str(small), document_separator=SEPARATOR)
    source = DocumentSource(corpus, DocumentSplit(0.01, seed=0), seed=0)

    def fresh_stream():  # a tokenizer copy of its own: every measurement starts from an empty BPE cache
        return PackedStream(source, copy.deepcopy(tokenizer), args.max_seq_len, document_max_chars=0)

    results["rounds"] = []
    for _ in range(args.rounds):  # alternating, so that both see the same load
        loader = loader_rate(fresh_stream(), args.throughput_tokens)
        encode = encode_rate(fresh_stream(), loader["warmup_documents"], args.throughput_tokens)
        results["rounds"].append({"loader": loader, "encode_batch": encode})
    results["dataloader"] = [dataloader_rate(fresh_stream(), w, args.throughput_tokens) for w in args.workers]
    results["load_after_throughput"] = load_average()
    encode = statistics.median(r["encode_batch"]["tokens_per_second"] for r in results["rounds"])
    loader = {key: statistics.median(r["loader"][key] for r in results["rounds"])
              for key in ("input_tokens_per_second", "packed_tokens_per_second", "cropped_share")}
    results["median"] = {"encode_batch_tokens_per_second": encode, **loader}
    rows = [("encode_batch_fast (1 thread)", encode, "1.00", ""),
            ("loader, main process (input tokens)", loader["input_tokens_per_second"],
             f"{loader['input_tokens_per_second'] / encode:.2f}", "goal >= 0.90"),
            ("loader, main process (packed tokens)", loader["packed_tokens_per_second"],
             f"{loader['packed_tokens_per_second'] / encode:.2f}", f"cropped {loader['cropped_share']:.1%}")]
    rows += [(f"DataLoader, {r['workers']} worker(s) (packed tokens)", r["packed_tokens_per_second"],
              f"{r['packed_tokens_per_second'] / encode:.2f}",
              f"{r['packed_tokens_per_second'] / D12_TOKENS_PER_SECOND:.2f}x the d12 step's 450k")
             for r in results["dataloader"]]
    print(f"\n{args.vocab_size}-token BPE, rows of {args.max_seq_len}, {os.cpu_count()} CPUs, load "
          f"{results['load_before']} -> {results['load_after_throughput']}")
    print(f"{'':44s} {'tokens/s':>10s} {'vs encode':>10s}")
    for name, rate, ratio, note in rows:
        print(f"{name:44s} {rate:10,.0f} {ratio:>10s}  {note}")

    if not args.skip_memory:
        large = build_corpus(work / "corpus_2gb", 2_000_000_000, documents)
        results["memory"] = [recipe_memory(c, tokenizer_dir, work / f"run_{c.name}") for c in (small, large)]
        results["load_after_memory"] = load_average()
        ratio = results["memory"][1]["peak_tree_rss_mb"] / results["memory"][0]["peak_tree_rss_mb"]
        results["memory_ratio"] = ratio
        print(f"\nrecipe, --max_steps 20, same flags (load {results['load_after_memory']})")
        for r in results["memory"]:
            print(f"{r['corpus']:12s} peak RSS of the process tree {r['peak_tree_rss_mb']:7.0f} MB, recipe process "
                  f"{r['recipe_process_peak_rss_mb']:6.0f} MB, {r['seconds']:5.0f} s")
        print(f"2 GB / 50 MB: {ratio:.3f} (goal <= 1.15)")
    return write_result(args.json, results)


if __name__ == "__main__":
    main(*HfArgumentParser(LoaderArguments).parse_args_into_dataclasses())
