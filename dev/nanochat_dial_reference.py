"""Run nanochat's own `scripts/base_train.py` up to its training loop and print what its dial computed, as JSON.

The reference numbers of `tests/test_compute_optimal.py` come from this script. It executes base_train.py's own
source, unchanged, from a checkout of karpathy/nanochat (read-only here; nothing of it is copied into hfl3), with
only what a CPU box without nanochat's data lacks replaced: wandb, the parquet data loaders, the trained tokenizer
(a stand-in that reports `--vocab_size`), the CORE evaluator, `torch.compile` (identity: the dial reads parameter
counts and shapes only) and `compute_init`'s device (the meta device: no weights are allocated). The world size is
torchrun's `WORLD_SIZE`, set from `--world_size` (nanochat's `compute_init` then does not start a process group on
CPU). Everything up to the `# Go!` line runs: the model on meta, the parameter counts, FLOPs per token, the
horizon, the auto batch size, the LR and weight-decay rescaling, `setup_optimizer` and the accumulation steps.

    python dev/nanochat_dial_reference.py --nanochat_dir PATH/TO/nanochat --depth 12 --world_size 8

Extra arguments after `--` go to base_train.py (e.g. `-- --target-flops 1e18`).
"""

import argparse
import json
import os
import sys
import tempfile
import types


def stub_modules(vocab_size: int) -> None:
    """Modules base_train imports whose real versions need data, a trained tokenizer or a network."""

    class Tokenizer:
        def get_vocab_size(self):
            return vocab_size

    def loader(*args, **kwargs):
        while True:
            yield None, None, {}

    stubs = {
        "wandb": {},
        "nanochat.dataloader": {"tokenizing_distributed_data_loader_bos_bestfit": loader,
                                "tokenizing_distributed_data_loader_with_state_bos_bestfit": loader},
        "nanochat.tokenizer": {"get_tokenizer": lambda: Tokenizer(), "get_token_bytes": lambda device=None: None},
        "scripts.base_eval": {"evaluate_core": None},
    }
    for name, attributes in stubs.items():
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        sys.modules[name] = module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanochat_dir", required=True, help="a checkout of karpathy/nanochat")
    parser.add_argument("--depth", type=int, required=True)
    parser.add_argument("--world_size", type=int, default=1)
    parser.add_argument("--vocab_size", type=int, default=32768)
    parser.add_argument("extra", nargs="*", help="more base_train.py arguments (after --)")
    args = parser.parse_args()

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(args.world_size),
                      NANOCHAT_BASE_DIR=tempfile.mkdtemp(prefix="nanochat_dial_"))
    sys.path.insert(0, args.nanochat_dir)
    stub_modules(args.vocab_size)
    import torch

    import nanochat.common

    real_compute_init = nanochat.common.compute_init

    def compute_init_on_meta(device_type):
        ddp, rank, local_rank, world_size, _ = real_compute_init("cpu")
        return ddp, rank, local_rank, world_size, torch.device("meta")

    nanochat.common.compute_init = compute_init_on_meta
    torch.compile = lambda model=None, **kwargs: model if model is not None else (lambda function: function)

    script = os.path.join(args.nanochat_dir, "scripts", "base_train.py")
    with open(script) as file:
        source = file.read()
    source = source[: source.index("\n# Go!\n")]
    sys.argv = [script, "--device-type", "cpu", "--depth", str(args.depth), *args.extra]
    scope = {"__name__": "__main__", "__file__": script}
    exec(compile(source, script, "exec"), scope)

    # setup_optimizer's AdamW groups, in its order; then one Muon group per matrix shape
    adamw_names = ["lm_head", "wte", "value_embeds", "resid_lambdas", "x0_lambdas", "smear"]
    groups = []
    for index, group in enumerate(scope["optimizer"].param_groups):
        name = adamw_names[index] if group["kind"] == "adamw" else f"muon{tuple(group['params'][0].shape)}"
        groups.append({"name": name, "kind": group["kind"], "lr": group["lr"],
                       "weight_decay": group["weight_decay"]})
    print("NANOCHAT_DIAL " + json.dumps({
        "depth": args.depth, "world_size": args.world_size, "vocab_size": args.vocab_size,
        "argv": sys.argv[1:], "param_counts": scope["param_counts"],
        "num_scaling_params": scope["num_scaling_params"], "num_flops_per_token": scope["num_flops_per_token"],
        "target_tokens": scope["target_tokens"], "D_REF": scope["D_REF"], "B_REF": scope["B_REF"],
        "total_batch_size": scope["total_batch_size"], "num_iterations": scope["num_iterations"],
        "total_tokens": scope["total_tokens"], "grad_accum_steps": scope["grad_accum_steps"],
        "batch_lr_scale": scope["batch_lr_scale"], "weight_decay_scaled": scope["weight_decay_scaled"],
        "param_groups": groups,
    }))


if __name__ == "__main__":
    main()
