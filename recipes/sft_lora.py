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
before any work (`hfl3.trainers.inputs.check_sft_inputs`): a mistyped one ends the run with one line and exit status 2.

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
from dataclasses import dataclass, field

import hfl3  # noqa: F401  (registers L3GPT; before transformers: keeps torchao's import-time warnings out)
from transformers import AutoModelForCausalLM, EarlyStoppingCallback, GgufConfig
from trl import ModelConfig, get_peft_config

from hfl3.data.chat import write_chat_jsonl
from hfl3.data.sft import load_sft_data
from hfl3.data.stdlib import stdlib_docstring_chats
from hfl3.distributed import end_distributed_run, main_writes
from hfl3.provenance import build_metadata, config_sha256
from hfl3.trainers.guards import check_vocabulary_fits, exit_on_training_error
from hfl3.trainers.inputs import RecipeParser, check_sft_inputs
from hfl3.trainers.launch import LOG_FORMAT, add_config_argument, check_launch, parse_recipe_args
from hfl3.trainers.outputs import base_model_hub_id, work_dir
from hfl3.trainers.sft import (
    HFL3SFTTrainer,
    SFTLoRAConfig,
    load_sft_tokenizer,
    save_merged_model,
    save_samples,
    train_and_evaluate,
)

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


def build_trainer(script_args: SFTScriptArguments, training_args: SFTLoRAConfig, model_args: SFTModelArguments):
    """Tokenizer, masked data, base model, LoRA and trainer. Returns `(trainer, data, metadata)`; `metadata` is also
    `trainer.provenance`, so every checkpoint carries it. The arguments as `make_parser()` checked them
    (`check_sft_inputs`)."""
    tokenizer = load_sft_tokenizer(model_args, training_args)
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
    if training_args.local_process_index == 0:  # each source's counts: load_sft_data logs them
        logger.info("train rows %d, eval rows %d", len(data.train), len(data.eval) if data.eval is not None else 0)
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


def make_parser() -> RecipeParser:
    """`TrlParser` over the script, model and training arguments, in that order so that `--help` lists the
    recipe's own options first (after `--config`); it returns them in that order too, after `check_sft_inputs`."""
    return add_config_argument(RecipeParser((SFTScriptArguments, SFTModelArguments, SFTLoRAConfig), check_sft_inputs))


def main(script_args: SFTScriptArguments, training_args: SFTLoRAConfig, model_args: SFTModelArguments) -> dict:
    """Train (evaluating at step 0 and after, when there is evaluation data), save the adapter with provenance,
    optionally merge and push, on the arguments as `make_parser()` parsed and checked them (output folder prepared,
    resume checkpoint resolved). Returns the results written to `all_results.json`."""
    check_launch(training_args)  # refuse a distributed setup that accelerate silently replaced
    trainer, data, metadata = build_trainer(script_args, training_args, model_args)
    results = train_and_evaluate(trainer, data.train_supervised_tokens)
    trainer.provenance = {**metadata, "results": results}
    with trainer.finish_output() as folder:  # staged, committed whole when the block completes
        trainer.save_metrics("all", results)
        trainer.save_state()
        trainer.save_loss_plot(("loss", "eval_loss"))
        trainer.save_model()
        if script_args.sample_prompts:
            save_samples(trainer, script_args.sample_prompts, script_args.max_new_tokens,
                         data.provenance["end_of_turn"])
        if script_args.merge:
            save_merged_model(trainer, folder / "merged", trainer.provenance)
    if url := trainer.push_output("merged" if script_args.merge else None):  # the main process pushes
        logger.info("pushed to %s", url)
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    script_args, model_args, training_args = parse_recipe_args(make_parser())
    with exit_on_training_error():  # a NaN/inf loss: one error line, exit status 1
        main(script_args, training_args, model_args)
    end_distributed_run()  # every rank: the others done, the process group destroyed, outputs flushed, exit 0
