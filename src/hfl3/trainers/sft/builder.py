"""A chat SFT run, built in one place for the recipe and the benchmarks, on the arguments of
`hfl3.trainers.sft.config`: the tokenizer (`load_sft_tokenizer`), the trainer with its data and base model
(`build_sft_trainer`) and the output folder (`finish_sft`)."""

import logging
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, EarlyStoppingCallback
from trl import get_peft_config

from hfl3.data.chat import write_chat_jsonl
from hfl3.data.sft import SFTData, load_sft_data, sft_data_options
from hfl3.data.stdlib import stdlib_docstring_chats
from hfl3.distributed import main_writes
from hfl3.evaluate.chat_callback import ChatCoreCallback, chatcore_problems_for_training
from hfl3.provenance import base_lineage, build_metadata, config_sha256
from hfl3.trainers.cli.arguments import RunSetup, apply_evaluation, check_sft_arguments, decide_evaluation
from hfl3.trainers.sft.base_model import load_base_model, quantization_metadata
from hfl3.trainers.cli.inputs import check_vocabulary_fits
from hfl3.trainers.optimizers import OptimizerSetup
from hfl3.trainers.outputs import OutputConfig, RunOutputs, base_model_hub_id, work_dir
from hfl3.trainers.sft.trainer import ChatSFTTrainer, save_merged_model, save_samples
from hfl3.trainers.sft.config import ChatSFTConfig, SFTModelArguments, SFTScriptArguments
from hfl3.trainers.sft.inheritance import decide_from_base

logger = logging.getLogger(__name__)


def load_sft_tokenizer(model_args: SFTModelArguments, training_args: ChatSFTConfig):
    """The tokenizer of `model_args`: `tokenizer_name_or_path`, else the model's at `model_revision` (or its GGUF
    file's), with `training_args.chat_template_path` (a `.jinja` file) as its chat template, before the data is
    masked with it (TRL's trainer sets the same file's text again: no change)."""
    source = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    options = {} if model_args.tokenizer_name_or_path else {"revision": model_args.model_revision}
    if model_args.gguf_file and not model_args.tokenizer_name_or_path:
        options["gguf_file"] = model_args.gguf_file
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=training_args.trust_remote_code, **options)
    if training_args.chat_template_path:
        tokenizer.chat_template = Path(training_args.chat_template_path).read_text(encoding="utf-8")
    return tokenizer


@dataclass
class SFTRun:
    """What `build_sft_trainer` built: the trainer, the data, the run's metadata (also `trainer.provenance`) and the
    script arguments (outputs: samples, merge)."""

    trainer: ChatSFTTrainer
    data: SFTData
    metadata: dict
    script_args: "SFTScriptArguments"


def build_sft_trainer(script_args: SFTScriptArguments, training_args: ChatSFTConfig, model_args: SFTModelArguments,
                      setup: RunSetup | None = None) -> SFTRun:
    """Tokenizer, masked data, base model, LoRA and trainer, each once, on the arguments as the recipe's parser
    checked them (`hfl3.trainers.cli.arguments.check_sft_inputs`), with what those checks decided (`setup`: the output
    folder and resume checkpoint, the evaluation; None: decided here the same way, for a run built in Python without
    the recipe's parser). The trainer's `provenance` is the run's metadata, so every checkpoint carries it.

    Raises:
        InvalidChatRecord, SFTDataError: bad records, or nothing usable left (before the model is loaded).
        ValueError: the tokenizer's ids do not fit the model's embeddings.
    """
    if setup is None:
        has_eval_data = check_sft_arguments(script_args, training_args, model_args)
        setup = RunSetup(None, decide_evaluation(training_args, has_eval_data, resuming=False),
                         *decide_from_base(model_args, training_args, frozenset()))
    apply_evaluation(training_args, setup.evaluation)
    chatcore_problems = chatcore_problems_for_training(training_args)  # --chatcore_every: read before the model
    for name, (value, source) in setup.settings.items():  # what a full fine-tuning takes from its base
        setattr(training_args, name, value)
        logger.info("%s = %s (from %s)", name, value, source)
    optimizer_setup = OptimizerSetup(training_args, setup.optimizer_state)  # Muon's refusals, before any data work
    tokenizer = load_sft_tokenizer(model_args, training_args)
    train_file = script_args.train_file
    if script_args.stdlib_chats:  # global rank 0 writes the file, every machine reads it (main_writes)
        train_file = work_dir(training_args.output_dir) / "stdlib_chats.jsonl"  # output_dir untouched until the end
        with main_writes(train_file) as writing:
            if writing:
                write_chat_jsonl(stdlib_docstring_chats(script_args.stdlib_chats, seed=training_args.seed), train_file)
    with training_args.main_process_first(desc="SFT data"):  # the others read the rows it cached
        data = load_sft_data(tokenizer, train_file, **sft_data_options(script_args, training_args, model_args))
    if training_args.local_process_index == 0:  # each source's counts: load_sft_data logs them
        logger.info("train rows %d, eval rows %d", len(data.train), len(data.eval) if data.eval is not None else 0)
    model = load_base_model(model_args, training_args)  # as `trl sft` loads it: dtype, revision, GGUF, QLoRA
    check_vocabulary_fits(tokenizer, model, [data.train, data.eval])  # not an IndexError in the first forward
    trained_length = getattr(model.config, "max_position_embeddings", None)
    if trained_length and training_args.max_length and training_args.max_length > trained_length:
        logger.warning("max_length %d exceeds the base model's max_position_embeddings %d: positions beyond it were "
                       "never trained; pass --max_length %d to stay inside", training_args.max_length,
                       trained_length, trained_length)
    peft_config = get_peft_config(model_args)
    metadata = build_metadata(
        data=data.provenance, lora=peft_config.to_dict() if peft_config else None, script_args=script_args,
        model_args=model_args,
        base_model={"name_or_path": model_args.model_name_or_path, "gguf_file": model_args.gguf_file,
                    "hub_id": base_model_hub_id(model_args.model_name_or_path, model_args.base_model_hub_id),
                    "model_type": model.config.model_type, "config_sha256": config_sha256(model.config),
                    "num_parameters": model.num_parameters(), "quantization": quantization_metadata(model)},
        training_args=training_args.to_dict(), optimizer=optimizer_setup.metadata(model),
        lineage=base_lineage(model_args.model_name_or_path, model_args.model_revision, model_args.gguf_file),
    )
    patience = training_args.early_stopping_patience  # the step-0 evaluation does not count (transformers' rule)
    trainer = ChatSFTTrainer(
        model=model, args=training_args, train_dataset=data.train,
        eval_dataset=data.eval if setup.evaluation.enabled else None, processing_class=tokenizer,
        peft_config=peft_config, provenance=metadata,
        outputs=RunOutputs(OutputConfig.from_args(training_args), setup.output), optimizer_setup=optimizer_setup,
        train_supervised_tokens=data.train_supervised_tokens,
        callbacks=[EarlyStoppingCallback(patience, training_args.early_stopping_threshold)] if patience else None,
    )
    if chatcore_problems is not None:
        trainer.add_callback(ChatCoreCallback(trainer, chatcore_problems, training_args.chatcore_every,
                                              training_args.chatcore_max_new_tokens))
    return SFTRun(trainer, data, metadata, script_args)


def finish_sft(run: SFTRun, results: dict) -> None:
    """The output folder of a trained run, staged and committed whole: `all_results.json`, the trainer state,
    `loss.png`, the adapter (or model) with `metadata.json` and card, `samples.json` from `--sample_prompts`, a merged
    model in `merged/` with `--merge`; then pushed with `--push_to_hub` (the merged model with `--merge`). Call on
    every rank."""
    trainer, script_args = run.trainer, run.script_args
    trainer.provenance = {**run.metadata, "results": results}
    if (chatcore := trainer.chatcore) and chatcore.latest:  # for the card's model-index too
        trainer.provenance["evaluation"] = {"chatcore": chatcore.latest.summary()}
    with trainer.finish_output() as folder:  # staged, committed whole when the block completes
        trainer.save_metrics("all", results)
        trainer.save_state()
        trainer.save_loss_plot(("loss", "eval_loss"))
        trainer.save_model()
        if script_args.sample_prompts:
            save_samples(trainer, script_args.sample_prompts, script_args.max_new_tokens,
                         run.data.provenance["end_of_turn"])
        if script_args.merge:
            save_merged_model(trainer, folder / "merged", trainer.provenance)
    if url := trainer.push_output("merged" if script_args.merge else None):  # the main process pushes
        logger.info("pushed to %s", url)
