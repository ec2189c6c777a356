"""Small corpora in memory for the benchmarks that need the whole packed set at once (`l3_vs_dense.py`,
`muon_vs_adamw.py`, `trainer_overhead.py`): every document in a `datasets.Dataset`, pieces, tokenization with
`datasets.map` and best-fit packing. Not part of hfl3: the recipe streams (`hfl3.data.streaming`); both use the same
readers (`hfl3.data.sources`), the same cutting into pieces and the same packer (`hfl3.data.packing`).
"""

import datasets
import numpy as np

from hfl3.data.packing import BestFitPacker, PackingReport, chunk_text
from hfl3.data.sources import Corpus, open_corpus


def load_corpus(source: str, text_column: str = "text", split: str = "train",
                skip_invalid: bool = False) -> tuple[datasets.Dataset, Corpus]:
    """Every document of `source` (a `--dataset` spec, `hfl3.data.sources.open_corpus`; every `.txt` file is one
    document) as a `datasets.Dataset` with columns `text` and `source` (the shard's name). Loads it whole: for small
    corpora only.

    Raises:
        FileNotFoundError, ValueError: as `open_corpus`.
    """
    corpus = open_corpus(source, text_column, split, document_separator="", skip_invalid=skip_invalid)
    texts, names = [], []
    for shard in corpus.shards:
        for batch, _ in shard.read(None, batch_size=1024):
            texts += batch
            names += [shard.name] * len(batch)
    return datasets.Dataset.from_dict({"text": texts, "source": names}), corpus


def chunk_documents(dataset: datasets.Dataset, max_chars: int) -> datasets.Dataset:
    """Every document cut into pieces of at most `max_chars` characters (`hfl3.data.packing.chunk_text`), keeping
    its `source`."""

    def chunk(batch):
        pieces = [(piece, source) for text, source in zip(batch["text"], batch["source"])
                  for piece in chunk_text(text, max_chars)]
        return {"text": [p for p, _ in pieces], "source": [s for _, s in pieces]}

    return dataset.map(chunk, batched=True, remove_columns=dataset.column_names)


def tokenize_documents(dataset: datasets.Dataset, tokenizer, num_proc: int | None = None) -> datasets.Dataset:
    """Batched `datasets.map`: column `input_ids` = [BOS] + the document's tokens (no other special token)."""
    bos = tokenizer.bos_token_id

    def encode(batch):
        encoded = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [[bos, *ids] for ids in encoded]}

    return dataset.map(encode, batched=True, num_proc=num_proc, remove_columns=dataset.column_names)


def pack_best_fit(dataset: datasets.Dataset, max_seq_len: int,
                  buffer_size: int = 1000) -> tuple[datasets.Dataset, PackingReport]:
    """All documents of `dataset["input_ids"]`, in order, packed by `BestFitPacker`: a dataset with column
    `input_ids` (rows of `max_seq_len` ids) and the `PackingReport` (the last, partial row counted as cropped)."""
    packer = BestFitPacker(max_seq_len, buffer_size)
    documents = ((key, np.asarray(ids, dtype=np.int64)) for key, ids in enumerate(dataset["input_ids"]))
    rows = []
    while (row := packer.next_row(lambda: next(documents, None))) is not None:
        rows.append(row)
    packed = np.stack(rows) if rows else np.zeros((0, max_seq_len), dtype=np.int64)
    return datasets.Dataset.from_dict({"input_ids": packed}), packer.report
