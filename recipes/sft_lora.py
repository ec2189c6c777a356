"""LoRA SFT of a causal LM on chat JSONL, with the loss on assistant tokens only.

The model can be any local folder or Hub id that `AutoModelForCausalLM` loads (Llama, Qwen2/3, Gemma2/3, ...), a
GGUF file (`--gguf_file NAME` inside `--model_name_or_path FOLDER`, dequantized for training; needs
`pip install 'hfl3[gguf]'`) or an L3GPT from `recipes/pretrain.py`.
Data: `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}]}` per line; masks come from the model's
own chat template (`hfl3.data.masks`); check them with
`python -m hfl3.data.inspect --tokenizer MODEL --data FILE --n 3`.

GSM8K on a small model (CPU):
```bash
accelerate launch --config_file accelerate_configs/cpu.yaml recipes/sft_lora.py \
    --config recipes/configs/sft_gsm8k.yaml
accelerate launch --config_file accelerate_configs/cpu.yaml recipes/sft_lora.py \
    --config recipes/configs/sft_gsm8k.yaml --model_name_or_path outputs/pretrain_demo --packing
```

The demo (stdlib-docstring chats on the pretrained demo L3GPT, then one answer from the adapter):
```bash
accelerate launch --config_file accelerate_configs/cpu.yaml recipes/sft_lora.py \
    --config recipes/configs/sft_demo.yaml
```

Any field can be overridden on the command line, e.g. `--lora_r 32 --lora_target_modules all-linear`,
`--val_split 0.05` (instead of `--eval_file`), `--early_stopping_patience 2`, `--skip_invalid_records`, `--merge`,
`--push_to_hub --hub_model_id USER/NAME`.

Outputs in `--output_dir`: `adapter_model.safetensors` + `adapter_config.json` (`peft.PeftModel.from_pretrained`),
the tokenizer, `metadata.json` (data sha256, counts, split, base model, LoRA, arguments, versions, git commit; the
same in the safetensors header and in README.md), `all_results.json`, `loss.png`, checkpoints, and with `--merge`
a full model in `merged/`.

Packing (`--packing`, TRL's best-fit `bfd`) keeps each conversation's labels and passes `position_ids` without an
attention mask; without a KV cache (training) transformers then builds a block-diagonal mask from the position resets
(sdpa, eager, flex) or passes the sequence boundaries to flash attention, so packed conversations do not attend to
each other. A model
that ignores `position_ids` (a custom attention that only applies a causal mask) would let them attend to each
other: `tests/test_chat_masks.py` checks packed and separate logits agree for Qwen3 and L3GPT.
"""

import logging
import math

from trl import TrlParser

from hfl3.callbacks import save_loss_plot
from hfl3.provenance import write_json_atomic
from hfl3.trainers.guards import exit_on_training_error
from hfl3.trainers.launch import check_world_size, parse_recipe_args
from hfl3.trainers.outputs import prepare_output_dir
from hfl3.trainers.sft import (
    SFTLoRAConfig,
    SFTModelArguments,
    SFTScriptArguments,
    add_early_stopping,
    answer_prompts,
    build_sft_trainer,
    save_merged_model,
)

logger = logging.getLogger("hfl3.recipes.sft_lora")


def main(script_args: SFTScriptArguments, training_args: SFTLoRAConfig, model_args: SFTModelArguments) -> dict:
    """Train (evaluating at step 0 and after), save the adapter with provenance, optionally merge and push.

    Returns:
        The results written to `all_results.json`.
    """
    prepare_output_dir(training_args)  # refuse a non-empty output_dir; resolve --resume_from_checkpoint latest
    check_world_size(training_args)
    trainer, data, metadata = build_sft_trainer(script_args, training_args, model_args)
    log = trainer.accelerator.print
    for name, stats in data.stats.items():
        counts = {k: v for k, v in stats.as_dict().items() if k != "first_errors"}
        log(f"[hfl3] {name}: {counts}")
    log(f"[hfl3] train rows {len(data.train)}, eval rows {len(data.eval) if data.eval is not None else 0}")

    add_early_stopping(trainer)
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    results = eval_before(trainer.state.log_history)
    results.update(train_result.metrics)
    if data.eval is not None:
        results.update(trainer.evaluate())

    supervised_per_epoch = sum(sum(label != -100 for label in row[1:]) for row in data.train["labels"])
    epochs = trainer.state.epoch or 0.0
    results["train_supervised_tokens"] = int(supervised_per_epoch * epochs)
    # Wall time of trainer.train, which includes the evaluations and checkpoint saves made during training
    results["train_supervised_tokens_per_second"] = results["train_supervised_tokens"] / results["train_runtime"]
    results["global_step"] = trainer.state.global_step
    results["best_model_checkpoint"] = trainer.state.best_model_checkpoint
    for key in ("eval_before_loss", "eval_loss", "eval_perplexity", "train_supervised_tokens_per_second"):
        if key in results and isinstance(results[key], float) and math.isfinite(results[key]):
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
    trainer.end()
    return results


def eval_before(log_history: list[dict]) -> dict:
    """The step-0 evaluation (`eval_on_start`) renamed `eval_before_*`; empty when there was none (no evaluation
    data, or a resumed run)."""
    for entry in log_history:
        if entry.get("step") == 0 and "eval_loss" in entry:
            return {k.replace("eval_", "eval_before_", 1): v for k, v in entry.items() if k.startswith("eval_")}
    return {}


def make_parser(subparsers=None):
    dataclass_types = (SFTScriptArguments, SFTLoRAConfig, SFTModelArguments)
    if subparsers is not None:
        return subparsers.add_parser("sft_lora", help="LoRA SFT on chat JSONL", dataclass_types=dataclass_types)
    return TrlParser(dataclass_types)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    script_args, training_args, model_args = parse_recipe_args(make_parser())
    with exit_on_training_error():  # a NaN/inf loss: one error line, exit status 1
        main(script_args, training_args, model_args)
