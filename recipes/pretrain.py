"""Pretrain an L3GPT on text with the HF Trainer: tokenizer, LZW allocation, streamed BOS-aligned packing, bpb eval.

    # the demo (stdlib sources, L3 on; `make demo` with its SFT step: 270 s on 2 CPU cores, dev/LOG.md 2026-11-26)
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/pretrain.py --config recipes/configs/demo.yaml
    # three Gutenberg novels (recipes/configs/gutenberg.yaml), Muon
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/pretrain.py \
        --config recipes/configs/gutenberg.yaml --optim muon
    # one GPU
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/pretrain.py \
        --config recipes/configs/gutenberg.yaml --depth 12 --bf16
    # nanochat's d12 on FineWeb-Edu, streamed from the Hub, 8 GPUs, sized by the compute-optimal dial
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/pretrain.py \
        --config recipes/configs/fineweb_d12.yaml
    # its plan only (parameters, FLOPs, steps, batch, LRs, weight decay), offline, no data read
    python recipes/pretrain.py --config recipes/configs/fineweb_d12.yaml --dry_run
    # + nanochat's CORE metric every 2000 steps and at the end (its eval bundle: --core_bundle_dir, or downloaded once)
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/pretrain.py \
        --config recipes/configs/fineweb_d12.yaml --core_metric_every 2000 --core_metric_max_per_task 500
    # nanochat's d12 on 2 machines of 8 GPUs: this command on each, with --machine_rank 0 and 1 (README: Scaling out)
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml --num_machines 2 --num_processes 16 \
        --machine_rank 0 --main_process_ip 10.0.0.1 --main_process_port 29500 recipes/pretrain.py \
        --config recipes/configs/fineweb_d12.yaml

The training data is a stream (`hfl3.data.streaming`): documents are read, tokenized and packed on the fly in each
process's DataLoader workers (`--dataloader_num_workers`), memory flat in corpus size, and a checkpoint resumes it
exactly. Outputs in `--output_dir`: model.safetensors + config.json + remote code, tokenizer, metadata.json (source
files with sha256, split, the sha256 of the consumed token rows), README.md (model card), all_results.json
(eval_bpb, train_loss and throughput over the whole run; with `--core_metric_every N`, the CORE metric of the
final model, also in metadata.json and in the card's model-index), loss.png. The folder is committed whole at the end
(`hfl3.trainers.outputs`): a non-empty `--output_dir` is refused unless the run resumes from it
(`--resume_from_checkpoint latest`, which also uses the checkpoint's tokenizer and L3 allocation) or
`--overwrite_output_dir` is given; checkpoints appear only when complete.

The run is sized at start by nanochat's compute-optimal dial (`hfl3.trainers.compute_optimal`): steps from
`--max_steps`, else `--target_flops`, else `--target_param_data_ratio` (12); `--total_batch_size` in tokens (-1: auto)
with the gradient accumulation derived from it; LRs and weight decay rescaled to that batch and horizon. The plan is
printed as a table and written to metadata.json (`compute_optimal`); `--dry_run` prints it and exits.
"""

import logging
import os
from dataclasses import asdict, dataclass, field, replace

import hfl3  # noqa: F401  (before transformers: keeps torchao import-time warnings out of the launch, fp8/ao.py)
import datasets
import numpy as np
import torch
from transformers import AutoModelForCausalLM, set_seed
from transformers.integrations import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

from hfl3 import L3GPTConfig, L3GPTForCausalLM, fp8, provenance
from hfl3.callbacks import SampleCallback, ThroughputCallback
from hfl3.data import sources
from hfl3.data.packing import PackingReport
from hfl3.data.streaming import DocumentSource, DocumentSplit, PackedStream
from hfl3.distributed import check_same_on_all_ranks, end_distributed_run, from_main, main_writes
from hfl3.evaluate import CoreMetricCallback, core_bundle_for_training
from hfl3.models.l3gpt import lzw_allocation
from hfl3.tokenization import load_tokenizer, token_bytes, train_tokenizer
from hfl3.trainers.compute_optimal import REFERENCE_DEPTH, ComputeOptimalPlan, compute_optimal_plan
from hfl3.trainers.guards import exit_on_training_error
from hfl3.trainers.inputs import RecipeParser, check_pretrain_inputs
from hfl3.trainers.launch import LOG_FORMAT, add_config_argument, check_launch, parse_recipe_args
from hfl3.trainers.outputs import work_dir
from hfl3.trainers.pretrain import BitsPerByte, L3GPTTrainer, PackedCollator, PretrainConfig

logger = logging.getLogger("hfl3.recipes.pretrain")


@dataclass
class ScriptArguments:
    _argument_group_name = "data and tokenizer (recipes/pretrain.py)"

    dataset: str = field(default="stdlib", metadata={"help": "comma-separated: stdlib, .txt/.jsonl/.json/.parquet "
                                                     "files, folders and globs, or datasets names (Hub or disk)"})
    dataset_config: str | None = field(default=None, metadata={"help": "configuration of a datasets source"})
    dataset_split: str = field(default="train", metadata={"help": "split of a datasets source"})
    text_column: str = field(default="text", metadata={"help": "text field of .jsonl/.json/.parquet and datasets"})
    document_separator: str | None = field(default=None, metadata={"help": "split .txt files at this string ('': "
                                                                   "whole files); default: a single .txt file is "
                                                                   "split at blank lines, others are whole"})
    skip_invalid_files: bool = field(default=False, metadata={"help": "skip non-UTF-8/empty files (counted)"})
    eval_dataset: str | None = field(default=None, metadata={"help": "held-out validation source (as --dataset; "
                                                             "its files leave the training data); default: a "
                                                             "seeded hash split of the documents"})
    val_fraction: float = field(default=0.05, metadata={"help": "share of documents held out (hash split)"})
    max_eval_rows: int = field(default=256, metadata={"help": "packed validation rows, built once"})
    document_max_chars: int | None = field(default=None, metadata={"help": "cut documents into pieces of at most "
                                                                   "this many characters (default: max_length; 0: "
                                                                   "whole)"})
    shuffle_buffer: int = field(default=1000, metadata={"help": "pieces in the seeded shuffle buffer (0: in order)"})
    packing_buffer: int = field(default=1000, metadata={"help": "pieces the best-fit packing chooses from"})
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "existing tokenizer; else train one"})
    vocab_size: int = field(default=32768, metadata={"help": "vocabulary of the trained BPE"})
    tokenizer_train_chars: int = field(default=20_000_000, metadata={"help": "characters to train the BPE on (from "
                                                                     "the start of the stream)"})
    l3_sample_tokens: int = field(default=2_000_000, metadata={"help": "training tokens LZW-scanned for L3 (from "
                                                               "the start of the stream)"})
    # No trailing space: BPE words carry their leading space (" foo"), so "def " would end on a lone-space token
    sample_prompts: list[str] = field(default_factory=lambda: ["def", "import", "class"],
                                      metadata={"help": "prompts for greedy samples at eval time"})
    dry_run: bool = field(default=False, metadata={"help": "print the compute-optimal plan and exit before reading "
                                                   "data (vocabulary: --tokenizer_name_or_path's, else --vocab_size)"})


@dataclass
class ModelArguments:
    """The model's size and shape: `L3GPTConfig.from_depth(depth, ...)` with the fields given here; a field left at
    None takes `L3GPTConfig`'s (or `from_depth`'s) own default, so no default is repeated here. The vocabulary comes
    from the tokenizer and `max_position_embeddings` from `--max_length`."""

    _argument_group_name = "model (L3GPTConfig.from_depth; None: the config's default)"

    depth: int = field(default=4, metadata={"help": "decoder layers; sizes the model (nanochat --depth)"})
    aspect_ratio: int | None = field(default=None, metadata={"help": "hidden_size = depth * aspect_ratio (rounded "
                                                             "up to head_dim)"})
    head_dim: int | None = field(default=None, metadata={"help": "attention head width"})
    num_key_value_heads: int | None = field(default=None, metadata={"help": "GQA key/value heads"})
    window_pattern: str | None = field(default=None, metadata={"help": "S = sliding window, L = full; last layer L"})
    l3_after_layers: list[int] | None = field(default=None, metadata={"help": "L3 after these layers (none: dense)"})
    l3_n_emb: int | None = field(default=None, metadata={"help": "total L3 rows"})
    l3_k_max: int | None = field(default=None, metadata={"help": "most L3 rows per token"})
    l3_d_up: int | None = field(default=None, metadata={"help": "L3 up-projection width"})
    l3_tie_kv: bool | None = field(default=None, metadata={"help": "one table for L3 keys and values"})
    attn_implementation: str | None = field(default=None, metadata={"help": "sdpa (default), eager or "
                                                                    "flash_attention_2"})

    def config(self, vocab_size: int, max_length: int, **token_ids) -> L3GPTConfig:
        """The `L3GPTConfig` for a vocabulary of `vocab_size` tokens, rows of `max_length` tokens and the tokenizer's
        `bos_token_id` / `eos_token_id` / `pad_token_id` (`token_ids`)."""
        given = {k: v for k, v in asdict(self).items() if v is not None and k != "depth"}
        return L3GPTConfig.from_depth(self.depth, vocab_size=vocab_size, max_position_embeddings=max_length,
                                      **token_ids, **given)


def make_parser() -> RecipeParser:
    """`TrlParser` over the script, model and training arguments, in that order so that `--help` lists the recipe's
    own options first (after `--config`); it returns them in that order too, after `check_pretrain_inputs`."""
    return add_config_argument(RecipeParser((ScriptArguments, ModelArguments, PretrainConfig), check_pretrain_inputs))


def plan_run(model_args: ModelArguments, training_args: PretrainConfig, vocab_size: int,
             show: bool = True) -> ComputeOptimalPlan:
    """nanochat's compute-optimal plan for this model at `vocab_size` (reference: the same model arguments at depth
    12 without L3 layers, nanochat's `build_model_meta(12)`), computed by global rank 0 for every rank, its table
    logged by the main process when `show`. Raises `PlanError` for a batch or budget that cannot be planned."""
    max_length = training_args.max_length
    reference = replace(model_args, depth=REFERENCE_DEPTH, l3_after_layers=None).config(vocab_size, max_length)
    plan = from_main(lambda: compute_optimal_plan(model_args.config(vocab_size, max_length), reference, training_args))
    if show and training_args.process_index == 0:
        logger.info("%s", plan.table())
    return plan


def open_data(script_args: ScriptArguments, seed: int) -> tuple[DocumentSource, DocumentSource]:
    """The training documents and the validation documents: a held-out `--eval_dataset`, else a hash split."""
    options = dict(text_column=script_args.text_column, split=script_args.dataset_split,
                   dataset_config=script_args.dataset_config, document_separator=script_args.document_separator,
                   skip_invalid=script_args.skip_invalid_files)
    held_out = sources.open_corpus(script_args.eval_dataset, **options) if script_args.eval_dataset else None
    corpus = sources.open_corpus(script_args.dataset, **options, exclude=held_out)
    split = None if held_out else DocumentSplit(script_args.val_fraction, seed)
    logger.info("corpus: %d shard(s), validation: %s", len(corpus.shards),
                script_args.eval_dataset or f"hash split, {script_args.val_fraction:.0%} of the documents")
    return (DocumentSource(corpus, split, seed=seed),
            DocumentSource(held_out or corpus, split, validation=split is not None, seed=seed, shuffle_shards=False,
                           epochs=1))


def prepare_tokenizer(script_args: ScriptArguments, training_args: PretrainConfig, documents: DocumentSource):
    """The checkpoint's tokenizer when resuming; else the given tokenizer, or a BPE trained on the first
    `tokenizer_train_chars` characters of the training documents by global rank 0 into the staging area (`output_dir`
    itself is not touched before training), read from there by every rank (`main_writes`: a machine that does not
    see rank 0's disk gets a copy through the process group)."""
    if training_args.resume_from_checkpoint:
        return load_tokenizer(training_args.resume_from_checkpoint)
    if script_args.tokenizer_name_or_path:
        return load_tokenizer(script_args.tokenizer_name_or_path)
    saved = work_dir(training_args.output_dir) / "tokenizer"
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


def prepare_data(script_args: ScriptArguments, documents: tuple[DocumentSource, DocumentSource], tokenizer,
                 max_length: int) -> PretrainData:
    """The training stream over `documents[0]` and the validation rows of `documents[1]` (packed by global rank 0
    for every rank), tokenized by `tokenizer`.

    Raises:
        ValueError: the training stream differs between ranks (another copy of the data on a machine); no full
            validation row.
    """
    train_documents, eval_documents = documents
    max_chars = max_length if script_args.document_max_chars is None else script_args.document_max_chars
    stream = PackedStream(train_documents, tokenizer, max_length, max_chars, script_args.packing_buffer,
                          script_args.shuffle_buffer)
    check_same_on_all_ranks(stream.fingerprint(), "the training stream (data files, split, tokenizer, packing)",
                            "give every machine the same --dataset files and arguments")
    eval_rows, eval_report, eval_counts = from_main(lambda: PackedStream(
        eval_documents, tokenizer, max_length, max_chars, script_args.packing_buffer, shuffle_buffer=0
    ).materialize(script_args.max_eval_rows))
    logger.info("validation: %d rows from %d documents (cropped %.2f%%, %d duplicate documents dropped)",
                len(eval_rows), eval_counts["documents"], 100 * eval_report.cropped_share, eval_counts["duplicates"])
    if not len(eval_rows):
        raise ValueError(f"no full validation row of {max_length} tokens ({eval_counts['documents']} documents); "
                         "raise --val_fraction, pass --eval_dataset or lower --max_length")
    return PretrainData(stream, eval_documents, eval_rows, eval_report, eval_counts)


def data_metadata(script_args: ScriptArguments, data: PretrainData, consumed: dict) -> dict:
    """The `data` section of metadata.json: sources (files with sizes and sha256), the split, what was trained on
    (`consumed`: `L3GPTTrainer.stream_summary`, also logged)."""
    logger.info("training stream: %d documents read, %d held out, %d duplicates within a shard dropped",
                consumed["documents"], consumed["held_out_documents"], consumed["duplicate_documents"])
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
                  "validation_duplicate_documents_skipped": data.eval_counts["duplicates"]},
        "packing": {"train": consumed["packing"], "validation": data.eval_report.as_dict()},
        "stream": {"shuffle_buffer": script_args.shuffle_buffer, "packing_buffer": script_args.packing_buffer,
                   "ranks": consumed["ranks"]},
    }


def main(script_args: ScriptArguments, training_args: PretrainConfig, model_args: ModelArguments) -> dict:
    """Train on the arguments as `make_parser()` parsed and checked them (output folder prepared, resume checkpoint
    resolved). Returns the results written to `all_results.json`; with `--dry_run`, the plan alone."""
    set_seed(training_args.seed)
    check_launch(training_args)  # refuse a distributed setup that accelerate silently replaced
    if script_args.dry_run:  # no data read: the vocabulary is the given tokenizer's, else the BPE's --vocab_size
        vocab_size = len(load_tokenizer(script_args.tokenizer_name_or_path)) if script_args.tokenizer_name_or_path \
            else script_args.vocab_size
        return plan_run(model_args, training_args, vocab_size).as_dict()
    core_bundle = core_bundle_for_training(training_args)  # --core_metric_every: read (or downloaded) before the data
    documents = open_data(script_args, training_args.seed)
    if not (script_args.tokenizer_name_or_path or training_args.resume_from_checkpoint):
        plan_run(model_args, training_args, script_args.vocab_size, show=False)  # its errors before the BPE is trained
    tokenizer = prepare_tokenizer(script_args, training_args, documents[0])
    plan = plan_run(model_args, training_args, len(tokenizer))  # sized before any row is packed
    training_args.apply_compute_optimal_plan(plan)
    data = prepare_data(script_args, documents, tokenizer, training_args.max_length)
    model = build_model(script_args, training_args, model_args, data)
    trainer, core = build_trainer(script_args, training_args, model, data, plan, core_bundle)
    metrics = train_and_evaluate(trainer, core)
    trainer.provenance = provenance.build_metadata(
        data=data_metadata(script_args, data, trainer.stream_summary()),  # every rank: gathers what each trained on
        model=model.config.to_dict(), script_args=asdict(script_args), model_args=asdict(model_args),
        training_args=training_args.to_dict(), compute_optimal=plan.as_dict(), results=metrics,
        evaluation={"core": core.latest.summary()} if core else {},
    )
    with trainer.finish_output():  # staged, committed whole: weights, tokenizer, metadata.json, card, results, plot
        trainer.save_metrics("all", metrics)
        trainer.save_loss_plot(("loss", "eval_bpb"))
        trainer.save_model()  # every rank: under ZeRO-3 the weights are gathered collectively
    reload_and_generate(trainer, (script_args.sample_prompts or ["def"])[0])
    trainer.push_output()
    return metrics


def build_model(script_args: ScriptArguments, training_args: PretrainConfig, model_args: ModelArguments,
                data: PretrainData) -> L3GPTForCausalLM:
    """A fresh L3GPT for the stream's tokenizer, with its L3 allocation from a sample of the training stream
    (computed by global rank 0 for every rank; a resumed run takes the checkpoint's), converted to FP8 when `--fp8`
    asks."""
    tokenizer = data.train.tokenizer
    config = model_args.config(len(tokenizer), training_args.max_length, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = L3GPTForCausalLM(config)
    if config.l3_after_layers and not training_args.resume_from_checkpoint:
        model.set_l3_allocation(from_main(lambda: lzw_allocation(data.train.sample_documents(
            script_args.l3_sample_tokens), config.vocab_size, config.l3_n_emb, config.l3_k_max)))
        counts = model.model.l3_counts().float()
        logger.info("L3 allocation: mean %.1f, max %d, tokens at k_max %d", counts.mean(), counts.max(),
                    int((counts == config.l3_k_max).sum()))
    ao_fp8 = fp8.check_ao_backend(training_args, model)  # accelerate's torchao backend (fp8_ao.yaml), or None
    if ao_fp8:
        logger.info("fp8 through accelerate's torchao backend: %s", ao_fp8)
    if training_args.fp8:
        fp8.convert_to_float8_training(model, recipe=training_args.fp8)  # logs the converted layers
    logger.info("model: %.2fM parameters (%.2fM in L3 tables)", model.num_parameters() / 1e6,
                sum(p.numel() for n, p in model.named_parameters() if "_table" in n) / 1e6)
    return model


def build_trainer(script_args: ScriptArguments, training_args: PretrainConfig, model: L3GPTForCausalLM,
                  data: PretrainData, plan: ComputeOptimalPlan, core_bundle) -> tuple:
    """`(L3GPTTrainer, CoreMetricCallback or None)` with the recipe's collator, bits-per-byte metric and callbacks."""
    tokenizer = data.train.tokenizer
    trainer = L3GPTTrainer(
        model=model, args=training_args, train_dataset=data.train,
        eval_dataset=datasets.Dataset.from_dict({"input_ids": data.eval_rows}),
        data_collator=PackedCollator(tokenizer.bos_token_id, training_args.attend_across_documents),
        processing_class=tokenizer, compute_metrics=BitsPerByte(token_bytes(tokenizer)),
        preprocess_logits_for_metrics=BitsPerByte.preprocess_logits_for_metrics,
        callbacks=[ThroughputCallback(plan.flops_per_token)],
    )
    if is_deepspeed_zero3_enabled():  # SampleCallback generates on rank 0 alone; ZeRO-3 needs every rank's shards
        logger.info("ZeRO-3: no samples at evaluation (SampleCallback generates on the main process only)")
    else:
        trainer.add_callback(SampleCallback(tokenizer, script_args.sample_prompts))
    core = CoreMetricCallback(trainer, core_bundle, training_args.core_metric_every) if core_bundle else None
    if core:
        trainer.add_callback(core)
    return trainer, core


def train_and_evaluate(trainer: L3GPTTrainer, core) -> dict:
    """Train (resuming when asked), evaluate, and return the run's metrics: the Trainer's over the whole run, the final
    evaluation's, CORE's at the end (when evaluated) and `initial_eval_bpb` (step 0)."""
    args = trainer.args
    # The step-0 evaluation runs inside train(): evaluate() before train() would leave the model without DDP (no
    # gradient all-reduce: accelerate marks it prepared for evaluation) and breaks DeepSpeed ZeRO
    args.eval_on_start = not args.resume_from_checkpoint
    train_metrics = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint).metrics
    metrics = {**train_metrics, **trainer.evaluate()}  # train_loss and throughput over the whole run
    if core:  # evaluated at the end of training
        metrics.update(core.latest.metrics())
    metrics["initial_eval_bpb"] = next((e["eval_bpb"] for e in trainer.state.log_history
                                        if e["step"] == 0 and "eval_bpb" in e), None)
    return metrics


def reload_and_generate(trainer: L3GPTTrainer, prompt: str) -> None:
    """On the main process, reload the finished folder with `AutoModelForCausalLM` and continue `prompt` (greedy, 40
    tokens): the folder that `--push_to_hub` uploads is exactly this one."""
    if is_deepspeed_zero3_enabled():  # training is over: the reload on the main process alone must not
        unset_hf_deepspeed_config()  # partition the model with zero.Init (a collective: it would hang or crash)
    if not trainer.is_world_process_zero():
        return
    output_dir = trainer.args.output_dir
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    tokenizer = load_tokenizer(output_dir)
    ids = [tokenizer.bos_token_id, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    with torch.no_grad():
        output = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)
    logger.info("reloaded from %s -> %r", output_dir, tokenizer.decode(output[0, 1:], skip_special_tokens=True))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    script_args, model_args, training_args = parse_recipe_args(make_parser())
    with exit_on_training_error():  # a NaN/inf loss: one error line, exit status 1
        main(script_args, training_args, model_args)
    end_distributed_run()  # every rank: the others done, the process group destroyed, outputs flushed, exit 0
