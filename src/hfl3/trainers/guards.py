"""The guard of an SFT run's inputs that needs its model: the tokenizer fits the model's embeddings
(`check_vocabulary_fits`). The NaN/inf guard of every step is `hfl3.trainers.metrics`."""

from __future__ import annotations

import logging

import pyarrow.compute as pc

logger = logging.getLogger(__name__)


def check_vocabulary_fits(tokenizer, model, datasets=()) -> None:
    """Refuse token ids the model has no embedding row for (the forward would fail with an IndexError, or on a GPU a
    device-side assert, deep in the first step).

    Without `datasets`, every id of the tokenizer (`len(tokenizer)`, added tokens included) must have a row. With
    `datasets` (tokenized `datasets.Dataset`s with `input_ids`; None entries are skipped), the ids that will be fed
    must: the largest id in them and the pad id. A tokenizer larger than the embeddings whose extra ids never occur
    (a GGUF file's tokenizer can carry one more added token than the model has rows) then only warns.

    Raises:
        ValueError: an id that will be (or, without `datasets`, may be) fed is >= the rows of the model's input
            embeddings.
    """
    weight = model.get_input_embeddings().weight
    rows = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 (zero.Init) leaves an empty partition here
    if len(tokenizer) <= rows:
        return
    fix = ("Use the model's own tokenizer (drop --tokenizer_name_or_path), or resize the model's embeddings "
           "(model.resize_token_embeddings(len(tokenizer))) and save it first")
    name = model.config.name_or_path or type(model).__name__
    datasets = [dataset for dataset in datasets if dataset is not None]
    if not datasets:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens (with added ones) but the model {name} has {rows} "
                         f"embedding rows: token ids >= {rows} have no embedding. {fix}")
    used = max(_largest_id(dataset) for dataset in datasets)
    used = max(used, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else -1)
    if used >= rows:
        raise ValueError(f"the data hold token id {used} (tokenizer: {len(tokenizer)} tokens with added ones) but the "
                         f"model {name} has {rows} embedding rows: token ids >= {rows} have no embedding. {fix}")
    logger.warning("the tokenizer has %d tokens but the model %s has %d embedding rows; the data and the pad id "
                   "stay below %d, so training runs", len(tokenizer), name, rows, rows)


def _largest_id(dataset) -> int:
    """The largest token id in a dataset's `input_ids`, read in Arrow batches (memory flat in the data)."""
    largest = -1
    for batch in dataset.with_format("arrow").iter(batch_size=1024):
        value = pc.max(pc.list_flatten(batch["input_ids"])).as_py()
        largest = max(largest, -1 if value is None else value)
    return largest


