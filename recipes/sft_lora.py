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
`--chatcore_every 200` (nanochat's ChatCORE every 200 steps and at the end, `hfl3.evaluate.chat_callback`),
`--packing`, `--merge`, `--push_to_hub --hub_model_id USER/NAME` (with a local base model: `--base_model_hub_id
USER/BASE`, unless the base folder's metadata.json names its Hub repository). Every path and name given is checked
before any work (`hfl3.trainers.cli.arguments.check_sft_inputs`, the first thing `main` runs): a mistyped one ends
the run with one line and exit status 2.

Outputs in `--output_dir`: the adapter (`peft.AutoPeftModelForCausalLM.from_pretrained(output_dir)` from any working
directory: a local base is named by its absolute path in `adapter_config.json`, a Hub base by its id, and the copy
pushed to the Hub names the base's Hub id), the tokenizer, `metadata.json` (data sha256, counts, split, base model,
LoRA, arguments, versions, git commit; also in the safetensors header and README.md), `all_results.json`,
`loss.png`, checkpoints, and with `--merge` a full model in `merged/`.

Packing (`--packing`, TRL's best-fit `bfd`) passes `position_ids` without an attention mask; transformers then keeps
packed conversations apart (block-diagonal mask, or sequence boundaries for flash attention) in any model that uses
`position_ids`: `tests/test_chat_masks.py` checks packed and separate logits agree for Qwen3 and L3GPT.
"""

import hfl3  # noqa: F401  (registers L3GPT; before transformers: keeps torchao's import-time warnings out)
from hfl3.trainers.cli.arguments import RecipeParser
from hfl3.trainers.cli.exits import run_recipe
from hfl3.trainers.cli.setup import set_up_sft
from hfl3.trainers.sft.builder import build_sft_trainer, finish_sft
from hfl3.trainers.sft.config import ChatSFTConfig, SFTModelArguments, SFTScriptArguments
from hfl3.trainers.training import train_and_evaluate


def make_parser() -> RecipeParser:
    """`TrlParser` over the script, training and model arguments (TRL's order; `--help` lists the recipe's own
    options first, after `--config`); it returns them in that order and nothing else."""
    return RecipeParser((SFTScriptArguments, ChatSFTConfig, SFTModelArguments))


def main(script_args: SFTScriptArguments, training_args: ChatSFTConfig, model_args: SFTModelArguments,
         given: frozenset[str] = frozenset()) -> dict:
    """Check the arguments as `make_parser()` parsed them (`given`: the fields the user set), then train (evaluating
    at step 0 and after, when there is evaluation data), save the adapter with provenance, optionally merge and
    push. Returns the results written to `all_results.json`."""
    setup = set_up_sft(script_args, training_args, model_args, given)  # launch, paths, output folder, evaluation
    run = build_sft_trainer(script_args, training_args, model_args, setup)  # tokenizer, data, base model, trainer
    results = train_and_evaluate(run.trainer)
    finish_sft(run, results)  # metadata.json, folder committed whole, samples, merge, push
    return results


if __name__ == "__main__":
    run_recipe(make_parser(), main)
