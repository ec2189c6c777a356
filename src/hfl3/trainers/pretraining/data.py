"""The pretraining data of a run, built once before the model: the corpus and its validation side (`open_data`), the
tokenizer (`prepare_tokenizer`), the training stream and the validation rows (`prepare_data`), and the `data` section
of `metadata.json` (`data_metadata`). `hfl3.trainers.pretraining.builder` builds the model and trainer on them."""

import logging
from dataclasses import dataclass

import numpy as np

from hfl3.data import sources
from hfl3.data.packing import PackingReport
from hfl3.data.streaming import SKIP_REASONS, DocumentSource, DocumentSplit, PackedStream
from hfl3.distributed import check_same_on_all_ranks, from_main, main_writes
from hfl3.errors import InputError
from hfl3.tokenization import load_tokenizer, train_tokenizer
from hfl3.trainers.outputs import OutputFolder, work_dir
from hfl3.trainers.pretraining.config import PretrainScriptArguments

logger = logging.getLogger(__name__)


def open_data(script_args: PretrainScriptArguments, seed: int) -> tuple[DocumentSource, DocumentSource]:
    """The training documents and the validation documents: a held-out `--eval_dataset`, else a hash split.

    Raises:
        InputError: a corpus file that is unreadable, empty or malformed without `--skip_invalid_files`
            (`hfl3.data.sources.open_corpus`); no document on one side of the split.
    """
    options = dict(text_column=script_args.text_column, split=script_args.dataset_split,
                   dataset_config=script_args.dataset_config, document_separator=script_args.document_separator,
                   skip_invalid=script_args.skip_invalid_files)
    held_out = sources.open_corpus(script_args.eval_dataset, **options) if script_args.eval_dataset else None
    corpus = sources.open_corpus(script_args.dataset, **options, exclude=held_out)
    split = None if held_out else DocumentSplit(script_args.val_fraction, seed)
    logger.info("corpus: %d shard(s), validation: %s", len(corpus.shards),
                script_args.eval_dataset or f"hash split, {script_args.val_fraction:.0%} of the documents")
    train = DocumentSource(corpus, split, seed=seed)
    validation = DocumentSource(held_out or corpus, split, validation=split is not None, seed=seed,
                                shuffle_shards=False, epochs=1)
    for side in (validation, train):  # a corpus too small for its split stops here, before the tokenizer is trained
        side.require_document()
    return train, validation


def prepare_tokenizer(script_args: PretrainScriptArguments, output: OutputFolder, documents: DocumentSource):
    """The resumed checkpoint's tokenizer (`output.resume_checkpoint`); else the given tokenizer, or a BPE trained on
    the first `tokenizer_train_chars` characters of the training documents by global rank 0 into the staging area
    (`output_dir` itself is not touched before training), read from there by every rank (`main_writes`: a machine
    that does not see rank 0's disk gets a copy through the process group)."""
    if output.resume_checkpoint:
        return load_tokenizer(output.resume_checkpoint)
    if script_args.tokenizer_name_or_path:
        return load_tokenizer(script_args.tokenizer_name_or_path)
    saved = work_dir(output.path) / "tokenizer"
    with main_writes(saved) as writing:
        if writing:
            train_tokenizer(documents.sample_texts(script_args.tokenizer_train_chars),
                            script_args.vocab_size).save_pretrained(saved)
    return load_tokenizer(str(saved))


@dataclass
class PretrainData:
    """The training stream and the validation rows (`(rows, max_length)`, built once from the `validation`
    documents), with their packing report and document counts."""

    train: PackedStream
    validation: DocumentSource
    eval_rows: np.ndarray
    eval_report: PackingReport
    eval_counts: dict


def prepare_data(script_args: PretrainScriptArguments, documents: tuple[DocumentSource, DocumentSource], tokenizer,
                 max_length: int, evaluate: bool = True) -> PretrainData:
    """The training stream over `documents[0]` and, when the run `evaluate`s, the validation rows of `documents[1]`
    (packed by global rank 0 for every rank; without evaluation, none), tokenized by `tokenizer`.

    Raises:
        ValueError: the training stream differs between ranks (another copy of the data on a machine).
        InputError: no full validation row (too few validation documents, or too short).
    """
    train_documents, eval_documents = documents
    max_chars = max_length if script_args.document_max_chars is None else script_args.document_max_chars
    stream = PackedStream(train_documents, tokenizer, max_length, max_chars, script_args.packing_buffer,
                          script_args.shuffle_buffer)
    check_same_on_all_ranks(stream.fingerprint(), "the training stream (data files, split, tokenizer, packing)",
                            "give every machine the same --dataset files and arguments")
    if not evaluate:
        logger.info("--eval_strategy no: no validation rows are built (the split still holds its documents out)")
        return PretrainData(stream, eval_documents, np.empty((0, max_length), dtype=np.int64), PackingReport(),
                            dict.fromkeys(("documents", *SKIP_REASONS), 0))
    eval_rows, eval_report, eval_counts = from_main(lambda: PackedStream(
        eval_documents, tokenizer, max_length, max_chars, script_args.packing_buffer, shuffle_buffer=0
    ).materialize(script_args.max_eval_rows))
    logger.info("validation: %d rows from %d documents (cropped %.2f%%; documents dropped: %d duplicates, %d without "
                "text, %d with empty text)", len(eval_rows), eval_counts["documents"], 100 * eval_report.cropped_share,
                eval_counts["duplicates"], eval_counts["missing_text"], eval_counts["empty_text"])
    if not len(eval_rows):
        raise InputError(f"no full validation row of {max_length} tokens ({eval_counts['documents']} validation "
                         "documents); raise --val_fraction, pass --eval_dataset or lower --max_length")
    return PretrainData(stream, eval_documents, eval_rows, eval_report, eval_counts)


def data_metadata(script_args: PretrainScriptArguments, data: PretrainData, consumed: dict) -> dict:
    """The `data` section of metadata.json: sources (files with sizes and sha256), the split, what was trained on
    (`consumed`: `StreamedTrainingData.summary`, also logged)."""
    logger.info("training stream: %d documents read, %d held out; dropped: %d duplicates within a shard, %d without "
                "text, %d with empty text", consumed["documents"], consumed["held_out_documents"],
                consumed["duplicate_documents"], consumed["missing_text_documents"], consumed["empty_text_documents"])
    train = data.train.source
    split = train.split.describe() if train.split else {"method": "held-out source",
                                                        "eval_dataset": script_args.eval_dataset}
    return {
        "source": script_args.dataset, "corpus": train.corpus.report(),
        "eval_corpus": None if train.split else data.validation.corpus.report(),
        "train_tokens_sha256": consumed["sha256"],
        "train_tokens_sha256_scheme": "sha256 over the ranks' chained digests (32 bytes each, rank order); a "
                                      "rank's chain: c0 = sha256(b''), c_b = sha256(c_(b-1) + batch b's input_ids as "
                                      "int64 little-endian) over its consumed batches, across resumes",
        "split": {**split, "validation_documents": data.eval_counts["documents"],
                  "validation_rows": len(data.eval_rows), "training_documents_read": consumed["documents"],
                  "held_out_documents_skipped": consumed["held_out_documents"],
                  "duplicate_documents_skipped": consumed["duplicate_documents"],
                  "missing_text_documents_skipped": consumed["missing_text_documents"],
                  "empty_text_documents_skipped": consumed["empty_text_documents"],
                  "validation_duplicate_documents_skipped": data.eval_counts["duplicates"],
                  "validation_missing_text_documents_skipped": data.eval_counts["missing_text"],
                  "validation_empty_text_documents_skipped": data.eval_counts["empty_text"]},
        "packing": {"train": consumed["packing"], "validation": data.eval_report.as_dict()},
        "stream": {"shuffle_buffer": script_args.shuffle_buffer, "packing_buffer": script_args.packing_buffer,
                   "ranks": consumed["ranks"]},
    }
