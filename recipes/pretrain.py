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
`--overwrite_output_dir` is given (the old folder stays whole until this run commits); checkpoints appear only when
complete.

The run is sized at start by nanochat's compute-optimal dial (`hfl3.trainers.pretraining.compute_optimal`): steps from
`--max_steps`, else `--target_flops`, else `--target_param_data_ratio` (12); `--total_batch_size` in tokens (-1: auto)
with the gradient accumulation derived from it; LRs and weight decay rescaled to that batch and horizon. The plan is
printed as a table and written to metadata.json (`compute_optimal`); `--dry_run` prints it and exits.
"""

import hfl3  # noqa: F401  (before transformers: keeps torchao import-time warnings out of the launch, fp8/ao.py)
from transformers import set_seed

from hfl3.trainers.cli.arguments import RecipeParser
from hfl3.trainers.cli.exits import run_recipe
from hfl3.trainers.pretraining.builder import build_pretraining, finish_pretraining, plan_only
from hfl3.trainers.pretraining.config import L3GPTModelArguments, PretrainConfig, PretrainScriptArguments
from hfl3.trainers.cli.setup import set_up_pretraining
from hfl3.trainers.training import train_and_evaluate


def make_parser() -> RecipeParser:
    """`TrlParser` over the script, training and model arguments (TRL's order; `--help` lists the recipe's own
    options first, after `--config`); it returns them in that order and nothing else."""
    return RecipeParser((PretrainScriptArguments, PretrainConfig, L3GPTModelArguments))


def main(script_args: PretrainScriptArguments, training_args: PretrainConfig, model_args: L3GPTModelArguments,
         given: frozenset[str] = frozenset()) -> dict:
    """Check the arguments as `make_parser()` parsed them (`given`: the fields the user set), then train. Returns the
    results written to `all_results.json`; with `--dry_run`, the plan alone."""
    setup = set_up_pretraining(script_args, training_args, model_args, given)  # launch, paths, output folder
    set_seed(training_args.seed)
    if script_args.dry_run:
        return plan_only(script_args, training_args, model_args).as_dict()
    run = build_pretraining(script_args, training_args, model_args, setup)  # data, tokenizer, plan, model, trainer
    results = train_and_evaluate(run.trainer)
    finish_pretraining(run, results)  # metadata.json, folder committed whole, reloaded, pushed
    return results


if __name__ == "__main__":
    run_recipe(make_parser(), main)
