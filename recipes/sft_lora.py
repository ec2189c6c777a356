"""LoRA SFT of a causal LM on chat data, with the loss on assistant tokens only.

The model: a local folder or Hub id that `AutoModelForCausalLM` loads (Llama, Qwen2/3, Gemma2/3, ...), a GGUF file
(`--gguf_file NAME` in the `--model_name_or_path` folder, dequantized; `pip install 'hfl3[gguf]'`) or an L3GPT from
`recipes/pretrain.py`. The data: `--train_file F` (JSONL) or `--dataset_name D` (a Hub dataset, a local folder of
parquet/JSON files, or one such file; `--dataset_config`, `--dataset_train_split`, `--dataset_test_split`), in TRL's
formats: `{"messages": [...]}` (roles system/developer/user/assistant/tool, assistant `tool_calls` and
`reasoning_content`, `training: false`), ShareGPT's `conversations`, or `prompt`/`completion`; each with optional
`tools` (`hfl3.data.chat` lists the rules). Masks come from the model's own chat template (check them:
`python -m hfl3.data.inspect --tokenizer M --train_file F`); the rows are encoded by `--dataset_num_proc` processes and
cached by content in the `datasets` cache.

```bash
# the plainest run: no evaluation data, so no evaluation (one log line says so)
accelerate launch --config_file accelerate_configs/cpu.yaml recipes/sft_lora.py \
    --model_name_or_path MODEL --train_file train.jsonl --output_dir outputs/sft
# GSM8K on a small model (CPU), evaluated every epoch on GSM8K test chats
accelerate launch --config_file accelerate_configs/cpu.yaml recipes/sft_lora.py \
    --config recipes/configs/sft_gsm8k.yaml
# a Hub dataset (or a local folder of parquet files), evaluated on its test split, encoded by 4 processes
accelerate launch --config_file accelerate_configs/cpu.yaml recipes/sft_lora.py --model_name_or_path MODEL \
    --dataset_name HuggingFaceTB/smoltalk --dataset_config all --dataset_test_split test --dataset_num_proc 4 \
    --output_dir outputs/smoltalk
# the demo: stdlib-docstring chats on the pretrained demo L3GPT, then one answer from the adapter
accelerate launch --config_file accelerate_configs/cpu.yaml recipes/sft_lora.py \
    --config recipes/configs/sft_demo.yaml
```

Any field can be overridden on the command line (`--help` lists the recipe's own first), e.g. `--lora_r 32
--lora_target_modules all-linear`, `--val_split 0.05` or `--eval_file F`, `--early_stopping_patience 2`,
`--packing`, `--merge`, `--push_to_hub --hub_model_id USER/NAME` (with a local base model: `--base_model_hub_id
USER/BASE`, unless the base folder's metadata.json names its Hub repository). Every path and name given is checked
before any work (`check_inputs`): a mistyped one ends the run with one line and exit status 2.

Outputs in `--output_dir`: the adapter (`peft.AutoPeftModelForCausalLM.from_pretrained(output_dir)` from any working
directory: a local base is named by its absolute path in `adapter_config.json`, a Hub base by its id, and the copy
pushed to the Hub names the base's Hub id), the tokenizer, `metadata.json` (data sha256, counts, split, base model,
LoRA, arguments, versions, git commit; also in the safetensors header and README.md), `all_results.json`,
`loss.png`, checkpoints, and with `--merge` a full model in `merged/`.

Packing (`--packing`, TRL's best-fit `bfd`) passes `position_ids` without an attention mask; transformers then keeps
packed conversations apart (block-diagonal mask, or sequence boundaries for flash attention) in any model that uses
`position_ids`: `tests/test_chat_masks.py` checks packed and separate logits agree for Qwen3 and L3GPT.
"""

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import hfl3  # noqa: F401  (registers L3GPT; before transformers: keeps torchao's import-time warnings out)
from transformers import AutoModelForCausalLM, AutoTokenizer, EarlyStoppingCallback, GgufConfig
from trl import ModelConfig, get_peft_config

from hfl3.callbacks import save_loss_plot
from hfl3.data.chat import write_chat_jsonl
from hfl3.data.sft import load_sft_data
from hfl3.data.stdlib import stdlib_docstring_chats
from hfl3.distributed import main_writes
from hfl3.generation import answer_prompts
from hfl3.atomic import write_json_atomic
from hfl3.provenance import build_metadata, config_sha256
from hfl3.trainers.guards import check_vocabulary_fits, exit_on_training_error
from hfl3.trainers.launch import add_config_argument, check_launch, end_distributed_run, parse_recipe_args
from hfl3.trainers.inputs import (
    MODEL,
    MODEL_FILES,
    TOKENIZER,
    TOKENIZER_FILES,
    RecipeParser,
    check_file,
    check_hub_repo,
    check_pretrained,
    check_sft_dataset,
    is_hub_id,
)
from hfl3.trainers.outputs import base_model_hub_id, prepare_output_dir, work_dir
from hfl3.trainers.sft import HFL3SFTTrainer, SFTLoRAConfig, save_merged_model

logger = logging.getLogger("hfl3.recipes.sft_lora")


@dataclass
class SFTScriptArguments:
    """Data (`dataset_name`, `train_file` or `stdlib_chats`; evaluation from `dataset_test_split`, a seeded
    `val_split` or `eval_file`, or none) and outputs (`merge`: also a merged full model in `output_dir/merged`;
    `sample_prompts`: answered at the end). The `dataset_*` names are TRL's (`trl.ScriptArguments`)."""

    _argument_group_name = "data and outputs (recipes/sft_lora.py)"

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


@dataclass
class SFTModelArguments(ModelConfig):
    """`trl.ModelConfig` with `use_peft` on, `lora_target_modules` `["q_proj", "v_proj"]` (a single name stays a
    module name, not a regex), and `gguf_file`, `tokenizer_name_or_path`, `base_model_hub_id` added."""

    _argument_group_name = "model and LoRA (trl.ModelConfig; gguf_file, tokenizer_name_or_path, base_model_hub_id last)"

    use_peft: bool = field(default=True, metadata={"help": "Train LoRA adapters (the only mode of this recipe)."})
    lora_target_modules: list[str] | None = field(
        default_factory=lambda: ["q_proj", "v_proj"], metadata={"help": "Module names to adapt, or 'all-linear'."}
    )
    gguf_file: str | None = field(
        default=None, metadata={"help": "GGUF file inside model_name_or_path to load (dequantized to train it)."}
    )
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "Tokenizer if not the model's."})
    base_model_hub_id: str | None = field(
        default=None, metadata={"help": "Hub id of a local model_name_or_path: what the pushed adapter names as base."}
    )

    def __post_init__(self):
        super().__post_init__()  # ModelConfig unpacks a one-element list, which PEFT would take as a regex
        if isinstance(self.lora_target_modules, str) and self.lora_target_modules != "all-linear":
            self.lora_target_modules = [self.lora_target_modules]


def check_arguments(script_args: SFTScriptArguments, training_args: SFTLoRAConfig, model_args: SFTModelArguments):
    """Reject combinations that would train something else than asked; without evaluation data turn the default
    evaluation off; resolve `eval_on_start`.

    Raises:
        ValueError: no model; no or two data sources (or two evaluation sources); `dataset_*` options without
            `--dataset_name`; `use_peft=False`; evaluation, best-model loading or early stopping asked for without
            evaluation data.
    """
    if not model_args.model_name_or_path:
        raise ValueError("--model_name_or_path is required (a folder, a Hub id, or the folder of --gguf_file)")
    sources = [name for name in ("dataset_name", "train_file", "stdlib_chats") if getattr(script_args, name)]
    if len(sources) != 1:
        raise ValueError("give exactly one of --dataset_name, --train_file and --stdlib_chats")
    evaluation = [name for name in ("dataset_test_split", "val_split", "eval_file") if getattr(script_args, name)]
    if len(evaluation) > 1:
        raise ValueError(f"give at most one of --dataset_test_split, --val_split and --eval_file (got --"
                         f"{' and --'.join(evaluation)})")
    for name in ("dataset_config", "dataset_train_split", "dataset_test_split"):
        if getattr(script_args, name) and not script_args.dataset_name:
            raise ValueError(f"--{name} needs --dataset_name")
    if not model_args.use_peft:
        raise ValueError("this recipe trains LoRA adapters; --use_peft false is not supported")
    has_eval = bool(evaluation)
    if not has_eval and training_args.evaluate_by_default and not training_args.early_stopping_patience:
        logger.info("no --dataset_test_split, --val_split or --eval_file: training without evaluation (no "
                    "best-model selection)")
        training_args.without_evaluation()
    if training_args.eval_strategy != "no" and not has_eval:
        raise ValueError(f"eval_strategy={training_args.eval_strategy.value} needs --dataset_test_split, "
                         "--val_split or --eval_file")
    if training_args.early_stopping_patience and not (has_eval and training_args.load_best_model_at_end):
        raise ValueError("--early_stopping_patience needs evaluation data and --load_best_model_at_end true")
    if training_args.eval_on_start is None:
        training_args.eval_on_start = has_eval and not training_args.resume_from_checkpoint


def check_inputs(script_args: SFTScriptArguments, model_args: SFTModelArguments, training_args: SFTLoRAConfig):
    """Every path and name given, checked by the parser before any heavy work (`hfl3.trainers.inputs`): a bad one
    is an argument error (one line, exit status 2). Also `prepare_output_dir` (output folder, resume checkpoint, a
    push's `--hub_model_id` and network) and `check_arguments`; a push needs a Hub id for the base model
    (`base_model_hub_id`).

    Raises:
        ValueError, OSError: one line naming the argument, the value and what was expected.
    """
    prepare_output_dir(training_args)  # first: check_arguments needs --resume_from_checkpoint latest resolved
    check_arguments(script_args, training_args, model_args)
    for argument in ("train_file", "eval_file"):
        if getattr(script_args, argument):
            check_file(argument, getattr(script_args, argument), 'a chat JSONL file (one {"messages": [...]} per line)')
    if script_args.dataset_name:
        splits = {"dataset_train_split": script_args.dataset_train_split or "train"}
        if script_args.dataset_test_split:
            splits["dataset_test_split"] = script_args.dataset_test_split
        check_sft_dataset(script_args.dataset_name, script_args.dataset_config, splits)
    if training_args.chat_template_path:
        check_file("chat_template_path", training_args.chat_template_path, "a Jinja chat template file (applied "
                   "before tokenization)", suffixes=(".jinja", ".j2"))
    model, gguf = model_args.model_name_or_path, model_args.gguf_file
    if gguf and Path(model).is_dir():
        check_file("gguf_file", str(Path(model) / gguf), "a GGUF file inside --model_name_or_path", (".gguf",))
    check_pretrained("model_name_or_path", model, MODEL, [gguf] if gguf else MODEL_FILES, model_args.model_revision)
    if model_args.tokenizer_name_or_path:
        check_pretrained("tokenizer_name_or_path", model_args.tokenizer_name_or_path, TOKENIZER, TOKENIZER_FILES)
    if model_args.base_model_hub_id:
        if not Path(model).is_dir():
            raise ValueError(f"--base_model_hub_id {model_args.base_model_hub_id}: only for a local "
                             f"--model_name_or_path; {model} is a Hub id already")
        if not is_hub_id(model_args.base_model_hub_id):
            raise ValueError(f"--base_model_hub_id {model_args.base_model_hub_id}: not a Hub repository id; expected "
                             "USER/NAME, the Hub repository of --model_name_or_path")
    if training_args.push_to_hub and base_model_hub_id(model, model_args.base_model_hub_id) is None:
        raise ValueError(f"--push_to_hub: the base model {model} is a local folder with no Hub id in its "
                         "metadata.json; pass --base_model_hub_id USER/NAME (its Hub repository), which the pushed "
                         "adapter_config.json and model card name")
    if training_args.push_to_hub and model_args.base_model_hub_id:
        check_hub_repo("base_model_hub_id", model_args.base_model_hub_id, "the Hub repository of "
                       "--model_name_or_path")


def load_tokenizer(model_args: SFTModelArguments, training_args: SFTLoRAConfig):
    """The tokenizer, with `chat_template_path` (a `.jinja` file) applied before masking and cleared so that TRL does
    not apply it again (TRL's tokenizer-folder form would add tokens after the data were tokenized)."""
    gguf = {"gguf_file": model_args.gguf_file} if model_args.gguf_file and not model_args.tokenizer_name_or_path else {}
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name_or_path or model_args.model_name_or_path,
                                              trust_remote_code=training_args.trust_remote_code, **gguf)
    if training_args.chat_template_path:
        template = Path(training_args.chat_template_path)
        tokenizer.chat_template, training_args.chat_template_path = template.read_text(encoding="utf-8"), None
    return tokenizer


def build_trainer(script_args: SFTScriptArguments, training_args: SFTLoRAConfig, model_args: SFTModelArguments):
    """Tokenizer, masked data, base model, LoRA and trainer. Returns `(trainer, data, metadata)`; `metadata` is also
    `trainer.provenance`, so every checkpoint carries it. The arguments as `make_parser()` checked them
    (`check_inputs`)."""
    tokenizer = load_tokenizer(model_args, training_args)
    train_file = script_args.train_file
    if script_args.stdlib_chats:  # global rank 0 writes the file, every machine reads it (main_writes)
        train_file = work_dir(training_args.output_dir) / "stdlib_chats.jsonl"  # output_dir untouched until the end
        with main_writes(train_file) as writing:
            if writing:
                write_chat_jsonl(stdlib_docstring_chats(script_args.stdlib_chats, seed=training_args.seed), train_file)
    with training_args.main_process_first(desc="SFT data"):  # the others read the rows it cached
        data = load_sft_data(
            tokenizer, train_file, eval_file=script_args.eval_file, dataset_name=script_args.dataset_name,
            dataset_config=script_args.dataset_config, dataset_train_split=script_args.dataset_train_split,
            dataset_test_split=script_args.dataset_test_split, val_split=script_args.val_split,
            seed=training_args.seed, max_length=training_args.max_length,
            skip_invalid_records=script_args.skip_invalid_records, dataset_num_proc=training_args.dataset_num_proc)
    # A GGUF file is dequantized into dense weights and loses its quantizer, which the Trainer refuses to train
    gguf = dict(gguf_file=model_args.gguf_file, quantization_config=GgufConfig(dequantize=True)) \
        if model_args.gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path, dtype=model_args.dtype, attn_implementation=model_args.attn_implementation,
        trust_remote_code=training_args.trust_remote_code, revision=model_args.model_revision, **gguf)
    check_vocabulary_fits(tokenizer, model, [data.train, data.eval])  # not an IndexError in the first forward
    trained_length = getattr(model.config, "max_position_embeddings", None)
    if trained_length and training_args.max_length and training_args.max_length > trained_length:
        logger.warning("max_length %d exceeds the base model's max_position_embeddings %d: positions beyond it were "
                       "never trained; pass --max_length %d to stay inside", training_args.max_length,
                       trained_length, trained_length)
    peft_config = get_peft_config(model_args)
    metadata = build_metadata(
        data=data.provenance, lora=peft_config.to_dict(), script_args=script_args, model_args=model_args,
        base_model={"name_or_path": model_args.model_name_or_path, "gguf_file": model_args.gguf_file,
                    "hub_id": base_model_hub_id(model_args.model_name_or_path, model_args.base_model_hub_id),
                    "model_type": model.config.model_type, "config_sha256": config_sha256(model.config),
                    "num_parameters": model.num_parameters()},
        training_args=training_args.to_dict(),
    )
    patience = training_args.early_stopping_patience  # the step-0 evaluation does not count (transformers' rule)
    trainer = HFL3SFTTrainer(
        model=model, args=training_args, train_dataset=data.train, eval_dataset=data.eval,
        processing_class=tokenizer, peft_config=peft_config, provenance=metadata,
        callbacks=[EarlyStoppingCallback(patience, training_args.early_stopping_threshold)] if patience else None,
    )
    return trainer, data, metadata


def main(script_args: SFTScriptArguments, training_args: SFTLoRAConfig, model_args: SFTModelArguments) -> dict:
    """Train (evaluating at step 0 and after, when there is evaluation data), save the adapter with provenance,
    optionally merge and push, on the arguments as `make_parser()` parsed and checked them (output folder prepared,
    resume checkpoint resolved). Returns the results written to `all_results.json`."""
    check_launch(training_args)  # refuse a distributed setup that accelerate silently replaced
    trainer, data, metadata = build_trainer(script_args, training_args, model_args)
    log = trainer.accelerator.print
    for name, stats in data.stats.items():
        log(f"[hfl3] {name}: { {k: v for k, v in stats.as_dict().items() if k != 'first_errors'} }")
    log(f"[hfl3] train rows {len(data.train)}, eval rows {len(data.eval) if data.eval is not None else 0}")

    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    results = {**eval_before(trainer.state.log_history), **train_result.metrics}
    if data.eval is not None:
        results.update(trainer.evaluate())
    results["train_supervised_tokens"] = int(data.train_supervised_tokens * (trainer.state.epoch or 0.0))
    # Wall time of trainer.train, which includes the evaluations and checkpoint saves made during training
    results["train_supervised_tokens_per_second"] = results["train_supervised_tokens"] / results["train_runtime"]
    results["global_step"] = trainer.state.global_step
    results["best_model_checkpoint"] = trainer.state.best_model_checkpoint
    for key in ("eval_before_loss", "eval_loss", "eval_perplexity", "train_supervised_tokens_per_second"):
        if isinstance(results.get(key), float) and math.isfinite(results[key]):
            log(f"[hfl3] {key} = {results[key]:.4f}")

    trainer.provenance = {**metadata, "results": results}
    with trainer.finish_output() as folder:  # staged, committed whole when the block completes
        trainer.save_metrics("all", results)
        trainer.save_state()
        history = trainer.state.log_history
        if trainer.is_world_process_zero() and any("loss" in e or "eval_loss" in e for e in history):
            save_loss_plot(history, folder / "loss.png", ("loss", "eval_loss"))
        trainer.save_model()
        if script_args.sample_prompts and trainer.is_world_process_zero():
            samples = answer_prompts(
                trainer.model, trainer.processing_class, script_args.sample_prompts, script_args.max_new_tokens,
                end_of_turn=data.provenance["end_of_turn"],
            )
            write_json_atomic(folder / "samples.json", samples)
            for sample in samples:
                log(f"[hfl3] Q: {sample['prompt']}\n[hfl3] A: {sample['answer']}")
        if script_args.merge and trainer.is_world_process_zero():
            save_merged_model(trainer, folder / "merged", trainer.provenance)
            log(f"[hfl3] merged model written to {training_args.output_dir}/merged")
    if url := trainer.push_output("merged" if script_args.merge else None):
        log(f"[hfl3] pushed to {url}")
    return results


def eval_before(log_history: list[dict]) -> dict:
    """The step-0 evaluation (`eval_on_start`) renamed `eval_before_*`; empty when there was none."""
    for entry in log_history:
        if entry.get("step") == 0 and "eval_loss" in entry:
            return {k.replace("eval_", "eval_before_", 1): v for k, v in entry.items() if k.startswith("eval_")}
    return {}


def make_parser() -> RecipeParser:
    """`TrlParser` over the script, model and training arguments, in that order so that `--help` lists the
    recipe's own options first (after `--config`); it returns them in that order too, after `check_inputs`."""
    return add_config_argument(RecipeParser((SFTScriptArguments, SFTModelArguments, SFTLoRAConfig), check_inputs))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    script_args, model_args, training_args = parse_recipe_args(make_parser())
    with exit_on_training_error():  # a NaN/inf loss: one error line, exit status 1
        main(script_args, training_args, model_args)
    end_distributed_run()  # every rank: the others done, the process group destroyed, outputs flushed, exit 0
