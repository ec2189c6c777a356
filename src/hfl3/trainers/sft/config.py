"""The SFT recipe's three argument classes in one place, as TRL's `sft_config.py` sits beside its trainer:
`SFTScriptArguments` (the data and outputs), `ChatSFTConfig` (TRL's `SFTConfig` with hfl3's defaults) and
`SFTModelArguments` (TRL's `ModelConfig`), in the parser's order. They validate and derive values; they start
nothing (`recipes/sft_lora.py`'s `main` checks them first: `hfl3.trainers.cli.setup.set_up_sft`)."""

import logging
import re
from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments
from transformers.trainer_utils import IntervalStrategy
from trl import ModelConfig, SFTConfig

from hfl3.evaluate.chat_callback import ChatCoreArguments, check_chatcore_arguments
from hfl3.trainers.cli.arguments import check_training_arguments
from hfl3.trainers.cli.flag_checks import with_choices
from hfl3.trainers.cli.launch import ProcessGroupTimeout
from hfl3.trainers.optimizers import MuonTrainingArguments

logger = logging.getLogger(__name__)


@dataclass
class SFTScriptArguments:
    """Data (`dataset_name`, `train_file` or `stdlib_chats`; evaluation from `dataset_test_split`, a seeded
    `val_split` or `eval_file`, or none) and outputs (`merge`: also a merged full model in `output_dir/merged`;
    `sample_prompts`: answered at the end). The `dataset_*` names are TRL's (`trl.ScriptArguments`)."""

    _argument_group_name = "data and outputs (hfl3.trainers.sft.config.SFTScriptArguments)"

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

    _argument_group_name = ("model and LoRA (hfl3.trainers.sft.config.SFTModelArguments: trl.ModelConfig; gguf_file, "
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


@dataclass
class ChatSFTConfig(ProcessGroupTimeout, ChatCoreArguments, MuonTrainingArguments, SFTConfig):
    """`SFTConfig` with defaults for SFT that also run on a CPU, LoRA (`--use_peft`, the default) or every weight
    (`--use_peft false`), with the Trainer's optimizers or MuonAdamW (`--optim muon`: the fields and groups of
    pretraining, `hfl3.trainers.optimizers.MuonTrainingArguments`, with nanochat chat SFT's schedule).

    Defaults that differ from `SFTConfig`:
        assistant_only_loss: True (TRL: False): the loss is on the assistant replies, masked from the model's own
            template by hfl3 (`hfl3.data.masks`; TRL needs `{% generation %}` markers); False trains the whole
            sequence, as TRL does. `completion_only_loss` (TRL's None: on) acts on prompt-completion records.
        learning_rate: 2e-4 for LoRA adapters; full fine-tuning (`--use_peft false`) takes TRL's 2e-5 unless it is
            given (decided with the model arguments, `hfl3.trainers.cli.arguments.check_sft_inputs`). Not used by Muon.
        lr_scheduler_type: None -> "linear" (TRL's), or with Muon "warmup_stable_decay": warmup (`warmup_steps`,
            none by default) → constant → linear warmdown over the last `warmdown_ratio` (0.5) of the steps to
            `final_lr_frac` (0), starting at `init_lr_frac` (0.8) × the group LRs (karpathy/nanochat 92d63d4,
            scripts/chat_sft.py).
        activation_checkpointing (alias gradient_checkpointing): off (TRL: on; it costs ~30% time and small models
            do not need it).
        bf16: None -> True only on a CUDA GPU that supports it (TRL: True even on CPU).
        eval_strategy: None -> "epoch"; the recipe turns evaluation off when it has no evaluation data and
            `eval_strategy` was not given (`evaluate_by_default`, one log line says so).
        save_strategy: None -> "steps" when `save_steps` is given (transformers' and TRL's default strategy), else
            `eval_strategy` ("epoch" when that is "no"); with "steps", `save_steps` follows `eval_steps` unless given
            (a checkpoint at every evaluation, as `load_best_model_at_end` needs).
        load_best_model_at_end: None -> True when evaluating and the checkpoints follow the evaluations, else False
            with a log line saying why (`best_model_problem`: `--save_strategy no`, a `save_steps` given alone
            against epoch evaluations); metric_for_best_model: "eval_loss".
    A refusal that involves a value chosen here (`hfl3_choices`) says so and names the flag that changes it
    (`hfl3.trainers.cli.flag_checks.with_choices`).
        save_total_limit: 2 (the best and the latest checkpoint survive).
        eval_on_start: None -> True when there is evaluation data and the run does not resume
            (`hfl3.trainers.cli.arguments.decide_evaluation`); reported as `eval_before_*`
            (`hfl3.trainers.training.train_and_evaluate`). It runs inside `train()`: an evaluate() before train() would prepare the model for
            inference only (no DDP wrapper, a ZeRO inference engine).
        dataset_kwargs: None -> `{"skip_prepare_dataset": True}` unless packing: the rows come tokenized, masked and
            truncated to `max_length` (`hfl3.data.sft.load_sft_data`), and TRL's preparation would only copy them
            twice (truncating again, dropping rows without a label, of which there are none).
    Added:
        early_stopping_patience: stop when `eval_loss` has not improved this many evaluations in a row.
        early_stopping_threshold: minimum improvement that counts.
        init_lr_frac: with Muon, the LRs start at this fraction of the group LRs (nanochat chat SFT: 0.8).
        load_optimizer: with Muon or AdamW over every weight, warm-start the optimizer from the base's
            `optimizer/optimizer.safetensors` (nanochat chat SFT's `--load-optimizer`); None: when the base folder
            has the state of this run's optimizer.
        use_muon, the Muon group LRs (`matrix_lr`, ...), `warmdown_ratio` (here 0.5), `final_lr_frac`: as
            pretraining's, and inherited from a base that `recipes/pretrain.py` wrote unless given.
        chatcore_every, chatcore_max_cat, chatcore_max_sample, chatcore_max_new_tokens, chatcore_data_dir: ChatCORE
            during training (`hfl3.evaluate.chat_callback.ChatCoreArguments`).
    """

    _argument_group_name = "training (ChatSFTConfig: trl.SFTConfig with hfl3's defaults; early_stopping_* last)"

    learning_rate: float = field(default=2e-4, metadata={"help": "Initial AdamW learning rate (LoRA: 2e-4; full "
                                                                "fine-tuning: 2e-5 unless given; Muon: not used)."})
    assistant_only_loss: bool = field(default=True, metadata={
        "help": "Loss on the assistant replies the model's chat template renders (hfl3's masks; default: on); false: "
                "on the whole sequence, as TRL's default."})
    optim: str = field(default=TrainingArguments.optim, metadata={
        "help": "One of transformers' OptimizerNames (default: transformers' and TRL's, adamw_torch_fused with torch "
                ">= 2.8), or muon (MuonAdamW over every weight: --use_peft false)."})
    lr_scheduler_type: str | None = field(default=None, metadata={
        "help": "LR schedule (default: linear; with --optim muon: warmup_stable_decay, nanochat chat SFT's)."})
    warmdown_ratio: float = field(default=0.5, metadata={"help": "Share of steps in the final linear warmdown "
                                                         "(warmup_stable_decay; nanochat chat SFT: 0.5)."})
    init_lr_frac: float = field(default=0.8, metadata={"help": "With --optim muon: the LRs start at this fraction "
                                                       "of the group LRs (nanochat chat SFT)."})
    load_optimizer: bool | None = field(default=None, metadata={
        "help": "Warm-start the optimizer from the base's optimizer/optimizer.safetensors (a recipes/pretrain.py "
                "output); default: when it holds this run's optimizer's state."})
    save_steps: float | None = field(default=None, metadata={
        "help": "Save every N steps (given alone: --save_strategy steps); default: at every evaluation, else 500."})
    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Deprecated alias of activation_checkpointing (off unless set)."}
    )
    bf16: bool | None = field(default=None, metadata={"help": "bf16 mixed precision; default: on a bf16 CUDA GPU."})
    eval_strategy: str | None = field(
        default=None, metadata={"help": "When to evaluate: no, steps or epoch (default: epoch with evaluation data)."}
    )
    save_strategy: str | None = field(
        default=None, metadata={"help": "When to save a checkpoint: no, steps, epoch or best (default: as eval)."}
    )
    load_best_model_at_end: bool | None = field(
        default=None, metadata={"help": "Keep the adapter with the best eval_loss (default: when evaluating)."}
    )
    metric_for_best_model: str | None = field(default="eval_loss", metadata={"help": "Metric that picks the best."})
    save_total_limit: int | None = field(default=2, metadata={"help": "Checkpoints kept (the best one always)."})
    eval_on_start: bool | None = field(
        default=None, metadata={"help": "Evaluate at step 0 (default: with evaluation data, unless resuming)."}
    )
    early_stopping_patience: int | None = field(
        default=None, metadata={"help": "Stop after this many evaluations without eval_loss improvement."}
    )
    early_stopping_threshold: float = field(
        default=0.0, metadata={"help": "Minimum eval_loss decrease that counts as an improvement."}
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Replace a non-empty output_dir's files when this run finishes."}
    )

    def __post_init__(self):
        self.take_muon_out_of_optim()
        check_training_arguments(self)  # a zero/negative learning rate or max_steps 0 trains nothing
        check_chatcore_arguments(self)
        if self.lr_scheduler_type is None:
            self.lr_scheduler_type = "warmup_stable_decay" if self.use_muon else "linear"
        if self.bf16 is None:
            self.bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        self.evaluate_by_default = self.eval_strategy is None and not self.load_best_model_at_end
        choices = {}  # what hfl3 chose for the user: {field: what a refusal naming it adds}
        if self.eval_strategy is None:
            self.eval_strategy = "epoch"
            choices["eval_strategy"] = "hfl3's default with evaluation data"
        evaluating = IntervalStrategy(self.eval_strategy) != IntervalStrategy.NO
        steps_evaluation = IntervalStrategy(self.eval_strategy) == IntervalStrategy.STEPS
        if self.save_strategy is None:
            if self.save_steps is not None:  # a step count given alone saves by steps, as the Trainer's default does
                self.save_strategy = "steps"
                choices["save_strategy"] = "hfl3's choice for a --save_steps given alone"
            else:
                self.save_strategy = self.eval_strategy if evaluating else "epoch"
                choices["save_strategy"] = "hfl3's default: as --eval_strategy"
                if steps_evaluation:
                    self.save_steps = self.eval_steps or self.logging_steps
                    choices["save_steps"] = "hfl3's default: --eval_steps"
        if self.save_steps is None:
            self.save_steps = 500  # transformers' default
        if self.load_best_model_at_end is None:
            problem = self.best_model_problem() if evaluating else None
            if problem:
                logger.info("no best-model selection (hfl3's default when evaluating is off here): %s", problem)
            self.load_best_model_at_end = evaluating and problem is None
            choices["load_best_model_at_end"] = ("hfl3's default when evaluating" if self.load_best_model_at_end else
                                                 "hfl3's default where no checkpoint follows every evaluation")
        if self.dataset_kwargs is None and not self.packing and not self.eval_packing:
            self.dataset_kwargs = {"skip_prepare_dataset": True}
        self.hfl3_choices = {name: f"{name}={getattr(getattr(self, name), 'value', getattr(self, name))} is {why}, "
                             f"not a value you gave; --{name} changes it" for name, why in choices.items()}
        try:
            super().__post_init__()
        except ValueError as error:  # transformers' checks of the save and evaluation settings, among others
            raise ValueError(with_choices(str(error), self.hfl3_choices)) from None

    def best_model_problem(self) -> str | None:
        """Why the checkpoints do not follow the evaluations, which best-model selection needs (transformers'
        rule: the same strategy, or `--save_strategy best`; by steps, `--save_steps` a multiple of `--eval_steps`),
        naming the flags; None when they do."""
        save, evaluation = IntervalStrategy(self.save_strategy).value, IntervalStrategy(self.eval_strategy).value
        if save == "best":
            return None
        if save != evaluation:
            return (f"--save_strategy {save} with --eval_strategy {evaluation} keeps no checkpoint of every "
                    f"evaluation to pick the best from; pass --save_strategy {evaluation} for it")
        eval_steps = self.eval_steps or self.logging_steps
        if save == "steps" and eval_steps >= 1 and self.save_steps >= 1 and self.save_steps % eval_steps:
            return (f"--save_steps {self.save_steps:g} is not a multiple of --eval_steps {eval_steps:g}; pass a "
                    "multiple for it")
        return None
