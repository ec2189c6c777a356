"""A chat SFT run, built in one place for the recipe and the benchmarks: the argument classes (`SFTScriptArguments`,
`SFTModelArguments`, beside `hfl3.trainers.sft.ChatSFTConfig`), the tokenizer (`load_sft_tokenizer`), the trainer
with its data and base model (`build_sft_trainer`) and the output folder (`finish_sft`)."""

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer, EarlyStoppingCallback
from trl import ModelConfig, get_peft_config

from hfl3.data.chat import write_chat_jsonl
from hfl3.data.sft import SFTData, load_sft_data, sft_data_options
from hfl3.data.stdlib import stdlib_docstring_chats
from hfl3.distributed import main_writes
from hfl3.evaluate.chat_callback import ChatCoreCallback, chatcore_problems_for_training
from hfl3.provenance import base_lineage, build_metadata, config_sha256
from hfl3.trainers.arguments import RunSetup, apply_evaluation, check_sft_arguments, decide_evaluation
from hfl3.trainers.base_model import load_base_model, quantization_metadata
from hfl3.trainers.guards import check_vocabulary_fits
from hfl3.trainers.optimizers import optimizer_metadata
from hfl3.trainers.outputs import base_model_hub_id, work_dir
from hfl3.trainers.sft import ChatSFTConfig, ChatSFTTrainer, save_merged_model, save_samples
from hfl3.trainers.sft_inheritance import decide_from_base

logger = logging.getLogger(__name__)


@dataclass
class SFTScriptArguments:
    """Data (`dataset_name`, `train_file` or `stdlib_chats`; evaluation from `dataset_test_split`, a seeded
    `val_split` or `eval_file`, or none) and outputs (`merge`: also a merged full model in `output_dir/merged`;
    `sample_prompts`: answered at the end). The `dataset_*` names are TRL's (`trl.ScriptArguments`)."""

    _argument_group_name = "data and outputs (hfl3.trainers.sft_builder.SFTScriptArguments)"

    dataset_name: str | None = field(
        default=None, metadata={"help": "A datasets name: Hub dataset id, local folder of data files, or a "
                                        ".json/.jsonl/.parquet/.arrow file."})
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration of dataset_name."})
    dataset_train_split: str | None = field(
        default=None, metadata={"help": "Split of dataset_name to train on (default: train)."})
    dataset_test_split: str | None = field(
        default=None, metadata={"help": "Split of dataset_name to evaluate on (default: none)."})
    train_file: str | None = field(default=None, metadata={"help": "Chat JSONL: one {\"messages\": [...]} per line."})
    stdlib_chats: int = field(
        default=0, metadata={"help": "Instead of train_file: build this many chats from Python stdlib docstrings."}
    )
    eval_file: str | None = field(default=None, metadata={"help": "Chat JSONL for evaluation (instead of val_split)."})
    val_split: float = field(
        default=0.0, metadata={"help": "Fraction of the training conversations held out for evaluation (seeded)."}
    )
    skip_invalid_records: bool = field(
        default=False, metadata={"help": "Skip and count invalid records instead of stopping at the first one."}
    )
    merge: bool = field(default=False, metadata={"help": "Also write the merged full model to output_dir/merged."})
    sample_prompts: list[str] | None = field(
        default=None, metadata={"help": "Questions answered greedily by the trained model at the end (samples.json)."}
    )
    max_new_tokens: int = field(default=96, metadata={"help": "Tokens generated per sample prompt."})
    split_reasoning_turns: bool = field(default=False, metadata={
        "help": "Make each assistant turn with reasoning_content its own sample ending at that turn (earlier turns "
                "context only), so templates that drop earlier reasoning (Qwen3) still train every turn's reasoning."})
    ignore_empty_reasoning: bool = field(default=False, metadata={
        "help": "Leave the empty reasoning block the chat template inserts before a reply without reasoning (Qwen3: "
                "<think>\\n\\n</think>\\n\\n) out of the loss."})


@dataclass
class SFTModelArguments(ModelConfig):
    """`trl.ModelConfig` with `use_peft` on, `lora_target_modules` `["q_proj", "v_proj"]` (one value is a regular
    expression, as TRL takes it, when it has regular-expression syntax; a single name stays a module name, which
    PEFT would otherwise match against whole module names), and `gguf_file`, `tokenizer_name_or_path`,
    `base_model_hub_id` added."""

    _argument_group_name = ("model and LoRA (hfl3.trainers.sft_builder.SFTModelArguments: trl.ModelConfig; gguf_file, "
                             "tokenizer_name_or_path, base_model_hub_id last)")

    use_peft: bool = field(default=True, metadata={"help": "Train LoRA adapters (the only mode of this recipe)."})
    lora_target_modules: list[str] | None = field(
        default_factory=lambda: ["q_proj", "v_proj"],
        metadata={"help": "Module names to adapt, 'all-linear', or one regular expression matched against whole module "
                          "names (TRL's, e.g. '.*layers\\.[0-3]\\..*proj')."}
    )
    gguf_file: str | None = field(
        default=None, metadata={"help": "GGUF file inside model_name_or_path to load (dequantized to train it)."}
    )
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "Tokenizer if not the model's."})
    base_model_hub_id: str | None = field(
        default=None, metadata={"help": "Hub id of a local model_name_or_path: what the pushed adapter names as base."}
    )

    def __post_init__(self):
        super().__post_init__()  # ModelConfig unpacks a one-element list, which PEFT takes as a regex
        if isinstance(self.lora_target_modules, str) and not re.search(r"[][*+?(){}|^$\\]", self.lora_target_modules) \
                and self.lora_target_modules != "all-linear":
            self.lora_target_modules = [self.lora_target_modules]


def load_sft_tokenizer(model_args: "SFTModelArguments", training_args: ChatSFTConfig):
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
    checked them (`hfl3.trainers.arguments.check_sft_inputs`), with what those checks decided (`setup`: the output
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
        training_args=training_args.to_dict(), optimizer=optimizer_metadata(training_args, model),
        lineage=base_lineage(model_args.model_name_or_path, model_args.model_revision, model_args.gguf_file),
    )
    patience = training_args.early_stopping_patience  # the step-0 evaluation does not count (transformers' rule)
    trainer = ChatSFTTrainer(
        model=model, args=training_args, train_dataset=data.train,
        eval_dataset=data.eval if setup.evaluation.enabled else None, processing_class=tokenizer,
        peft_config=peft_config, provenance=metadata, output_folder=setup.output,
        optimizer_state=setup.optimizer_state,
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
