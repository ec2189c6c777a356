"""Parameter groups by module kind for `MuonAdamW`, and its construction from `TrainingArguments` for the Trainer.

`param_groups_by_kind` sorts parameters by module type and shape, never by name patterns; `create_muon_optimizer`
is the one-liner for any `transformers.Trainer`; `refuse_sharded_training` stops DeepSpeed/FSDP setups early.
"""

import logging
import math
import os

from torch import nn

from .muon import MUON_DEFAULTS, MuonAdamW

logger = logging.getLogger(__name__)

# nanochat's defaults (scripts/base_train.py, nanochat/gpt.py setup_optimizer), tuned at hidden size 768.
MATRIX_LR = MUON_DEFAULTS["lr"]  # 0.02
EMBEDDING_LR = 0.3
UNEMBEDDING_LR = 0.004
SCALAR_LR = 0.5
LR_REFERENCE_HIDDEN_SIZE = 768
RESIDUAL_SCALAR_LR_FACTOR = 0.01  # nanochat: resid_lambdas "accumulate in the residual stream", 100x lower LR
VALUE_EMBEDDING_LR_FACTOR = 0.5  # nanochat 6ed7d1d: value embeddings at half the embedding LR
SMEAR_LR = 0.2  # nanochat a825e63: smear gate, smear_lambda and backout_lambda, not scaled by the hidden size

# L3GPT's module classes, matched by name so that they are also found when L3GPT is loaded as remote code.
_L3_LAYER_CLASS_NAMES = ("LargeLookupLayer",)
_VALUE_EMBEDDINGS_CLASS_NAMES = ("L3GPTValueEmbeddings",)
_SMEAR_CLASS_NAMES = ("L3GPTSmear",)


def param_groups_by_kind(
    model: nn.Module,
    *,
    matrix_lr: float = MATRIX_LR,
    embedding_lr: float = EMBEDDING_LR,
    unembedding_lr: float = UNEMBEDDING_LR,
    scalar_lr: float = SCALAR_LR,
    l3_table_lr: float | None = None,
    value_embedding_lr: float | None = None,
    smear_lr: float = SMEAR_LR,
    hidden_size: int | None = None,
) -> list[dict]:
    """Split the trainable parameters of `model` into MuonAdamW groups by module type and shape.

    | group name        | kind  | what                                                       | lr                       |
    |-------------------|-------|------------------------------------------------------------|--------------------------|
    | `matrix`          | muon  | 2-D weights of every `nn.Linear` except the output head    | `matrix_lr`              |
    | `embedding`       | adamw | `get_input_embeddings()` and any other `nn.Embedding`      | `embedding_lr · s`       |
    | `l3_table`        | adamw | the `nn.Embedding`s inside an L3 `LargeLookupLayer`        | `l3_table_lr · s`        |
    | `value_embedding` | adamw | the `nn.Embedding`s inside L3GPT's `L3GPTValueEmbeddings`  | `value_embedding_lr · s` |
    | `unembedding`     | adamw | `get_output_embeddings()` (when tied: the shared weight)   | `unembedding_lr · s`     |
    | `scalar`          | adamw | 0-/1-D parameters: norm gains, biases, `x0_lambdas`        | `scalar_lr`              |
    | `residual_scalar` | adamw | a module's `resid_lambdas` (L3GPT, nanochat)               | `scalar_lr · 0.01`       |
    | `smear`           | adamw | `L3GPTSmear` (gate, `smear_lambda`) and `backout_lambda`   | `smear_lr`               |

    `s = (hidden_size / 768) ** -0.5` (nanochat scales its AdamW LRs so, having tuned them at 768).
    The L3 tables default to `embedding_lr`: they are embedding rows gathered by token id, updated
    only for the tokens in the batch, like the token embedding. The value embeddings default to
    `0.5 · embedding_lr` and the smear group to 0.2, unscaled (nanochat's `setup_optimizer`); the value-embedding
    gates are `nn.Linear`s in the decoder layers and go to Muon with the other matrices, as in nanochat. A tied
    input/output embedding gets the unembedding LR (the input embedding's 0.3 would blow up the logits). Empty
    groups are dropped; frozen parameters (`requires_grad=False`) are left out. Not reproduced from nanochat
    (since 6ed7d1d): its per-group AdamW betas and weight decays (e.g. value embeddings betas (0.8, 0.995), weight
    decay 0.01); here every AdamW group gets the same betas (`create_muon_optimizer`: the TrainingArguments') and
    no weight decay.

    Args:
        model: any `nn.Module`; `get_output_embeddings()` / `get_input_embeddings()` are used when the
            model has them (transformers `PreTrainedModel`), which also covers Qwen3 and Llama.
        hidden_size: for the LR scale `s`; default `model.config.hidden_size`, else the input
            embedding width.

    Returns:
        list of dicts with `params`, `kind`, `name`, `lr`, ready for `MuonAdamW`.

    Raises:
        ValueError: for a trainable parameter of 2 or more dimensions outside `nn.Linear` / `nn.Embedding`
            (e.g. a convolution), naming it: Muon's LR and shape rules are not defined for it.
    """
    output_embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    input_embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if hidden_size is None:
        hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
        if hidden_size is None and isinstance(input_embeddings, nn.Embedding):
            hidden_size = input_embeddings.embedding_dim
    scale = (hidden_size / LR_REFERENCE_HIDDEN_SIZE) ** -0.5 if hidden_size else 1.0

    placed: dict[int, str] = {}

    def place(param: nn.Parameter | None, name: str) -> None:
        if isinstance(param, nn.Parameter) and param.requires_grad and id(param) not in placed:
            placed[id(param)] = name

    if output_embeddings is not None:
        place(output_embeddings.weight, "unembedding")
    if input_embeddings is not None:
        place(input_embeddings.weight, "embedding")
    for module in model.modules():
        place(getattr(module, "resid_lambdas", None), "residual_scalar")
        place(getattr(module, "backout_lambda", None), "smear")
        class_name = type(module).__name__
        if class_name in _SMEAR_CLASS_NAMES:
            for param in module.parameters():
                place(param, "smear")
        for table_group, class_names in (("l3_table", _L3_LAYER_CLASS_NAMES),
                                         ("value_embedding", _VALUE_EMBEDDINGS_CLASS_NAMES)):  # fmt: skip
            if class_name in class_names:
                for child in module.modules():
                    if isinstance(child, nn.Embedding):
                        place(child.weight, table_group)
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if param.ndim <= 1:
                place(param, "scalar")
            elif isinstance(module, nn.Linear) and param is module.weight:
                place(param, "matrix")
            elif isinstance(module, nn.Embedding) and param is module.weight:
                place(param, "embedding")
            elif param.requires_grad and id(param) not in placed:
                qualified = f"{module_name}.{param_name}" if module_name else param_name
                raise ValueError(
                    f"param_groups_by_kind: parameter {qualified!r} of shape {tuple(param.shape)} in "
                    f"{type(module).__name__} is neither an nn.Linear/nn.Embedding weight nor 0-/1-D; MuonAdamW "
                    "has no rule for it. Freeze it, or build the param groups yourself (kind='adamw')."
                )
    learning_rates = {
        "matrix": matrix_lr,
        "embedding": embedding_lr * scale,
        "l3_table": (embedding_lr if l3_table_lr is None else l3_table_lr) * scale,
        "value_embedding": (
            embedding_lr * VALUE_EMBEDDING_LR_FACTOR if value_embedding_lr is None else value_embedding_lr
        ) * scale,
        "unembedding": unembedding_lr * scale,
        "scalar": scalar_lr,
        "residual_scalar": scalar_lr * RESIDUAL_SCALAR_LR_FACTOR,
        "smear": smear_lr,
    }
    by_name: dict[str, list[nn.Parameter]] = {name: [] for name in learning_rates}
    for param in model.parameters():  # each shared parameter once, in model order
        if id(param) in placed:
            by_name[placed[id(param)]].append(param)
    return [
        {"params": params, "kind": "muon" if name == "matrix" else "adamw", "name": name, "lr": learning_rates[name]}
        for name, params in by_name.items()
        if params
    ]


def create_muon_optimizer(
    model: nn.Module,
    args,
    num_training_steps: int | None = None,
    compile_update: bool | None = None,
    **hyperparameters,
) -> MuonAdamW:
    """Build a `MuonAdamW` for `model` from a `TrainingArguments`, ready for `Trainer(optimizers=...)`.

    One line for any `transformers.Trainer`::

        trainer = Trainer(model=model, args=args, train_dataset=ds,
                          optimizers=(create_muon_optimizer(model, args, num_training_steps=1000), None))

    The Trainer then builds its LR scheduler (`args.lr_scheduler_type`, warm-up) on this optimizer;
    the scheduler multiplies every group's own LR, and checkpoints save/restore the optimizer state,
    including its step count. Build it after moving `model` to its device and before wrapping it.

    How `TrainingArguments` apply:
        - `args.learning_rate` is NOT used: each group has its own absolute LR (nanochat's, see
          `param_groups_by_kind`; override with `matrix_lr=`, `embedding_lr=`, `unembedding_lr=`,
          `scalar_lr=`, `l3_table_lr=`, `value_embedding_lr=`, `smear_lr=`). A warning says so when it differs
          from `matrix_lr`. The Trainer's logged `learning_rate` is the first group's: the Muon matrix LR.
        - `args.weight_decay` -> the Muon groups' (cautious, linearly decaying) weight decay; the AdamW
          groups get none, as in nanochat.
        - `args.adam_beta1`, `args.adam_beta2`, `args.adam_epsilon` -> every AdamW group (nanochat uses
          0.8, 0.95, 1e-10; transformers' defaults are 0.9, 0.999, 1e-8).
        - `num_training_steps` (or `args.max_steps` when positive) sets the weight-decay decay horizon.

    `compile_update`: `MuonAdamW`'s (None: each same-shape stack's Muon update is `torch.compile`d on CUDA only).

    Other `hyperparameters`: `hidden_size` (LR scale) and any Muon group key of `MUON_DEFAULTS`
    (`momentum`, `momentum_warmup_start`, `momentum_warmup_steps`, `beta2`, `cautious_weight_decay`,
    `ns_coefficients`, `orthogonalize_dtype`, ...).

    Raises:
        RuntimeError: under DeepSpeed or FSDP (accelerate's state, `ACCELERATE_USE_DEEPSPEED` /
            `ACCELERATE_USE_FSDP`, `args.deepspeed`, `args.fsdp`), which would hand Muon pieces of matrices.
        ValueError: when the total number of steps is unknown and the weight decay is not 0, or for an
            unknown hyperparameter.
    """
    refuse_sharded_training(args)
    lr_keys = ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "l3_table_lr", "value_embedding_lr",
               "smear_lr", "hidden_size")
    group_kwargs = {key: hyperparameters.pop(key) for key in lr_keys if key in hyperparameters}
    allowed = set(MUON_DEFAULTS) - {"lr", "weight_decay"}
    if set(hyperparameters) - allowed:
        raise ValueError(
            f"create_muon_optimizer: unknown hyperparameters {sorted(set(hyperparameters) - allowed)}; the LRs are "
            f"{list(lr_keys[:-1])}, the weight decay is args.weight_decay, the Muon keys are {sorted(allowed)}"
        )
    if num_training_steps is None and getattr(args, "max_steps", -1) > 0:
        num_training_steps = args.max_steps
    if num_training_steps is None and args.weight_decay != 0:
        raise ValueError(
            "create_muon_optimizer: weight_decay decays linearly to 0 over training, so the number of steps is "
            "needed: pass num_training_steps=... or set max_steps in the TrainingArguments"
        )
    groups = param_groups_by_kind(model, **group_kwargs)
    matrix_lr = group_kwargs.get("matrix_lr", MATRIX_LR)
    if not math.isclose(args.learning_rate, matrix_lr):
        logger.warning(
            "create_muon_optimizer: TrainingArguments.learning_rate=%g is not used; MuonAdamW groups keep their own "
            "LRs (%s). Pass matrix_lr=... etc. to change them.",
            args.learning_rate,
            ", ".join(f"{group['name']}={group['lr']:.4g}" for group in groups),
        )
    for group in groups:
        if group["kind"] == "muon":
            group.update(hyperparameters, weight_decay=args.weight_decay)
        else:
            group.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    return MuonAdamW(groups, num_training_steps=num_training_steps, compile_update=compile_update)


def refuse_sharded_training(args) -> None:
    """Raise `RuntimeError` if training is set up for DeepSpeed or FSDP, which would hand Muon pieces of matrices.

    Reads accelerate's state (once an `Accelerator` exists, e.g. after `Trainer.__init__`), the variables
    `accelerate launch` sets (`ACCELERATE_USE_DEEPSPEED`, `ACCELERATE_USE_FSDP`) and `args.deepspeed` / `args.fsdp`.
    `create_muon_optimizer` calls it; a Trainer that picks Muon from a config should call it in `__init__` too,
    because with an `optimizer` section in the DeepSpeed config the Trainer never calls `create_optimizer`.
    """
    from accelerate.state import AcceleratorState, DistributedType

    distributed_type = AcceleratorState._shared_state.get("distributed_type")
    deepspeed = (
        distributed_type == DistributedType.DEEPSPEED
        or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        or bool(getattr(args, "deepspeed", None))
    )
    fsdp = (
        distributed_type == DistributedType.FSDP
        or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        or bool(getattr(args, "fsdp", None))
    )
    if deepspeed or fsdp:
        what = "DeepSpeed ZeRO (flattened 1-D partitions)" if deepspeed else "FSDP (DTensor shards)"
        raise RuntimeError(
            f"MuonAdamW does not support {what}: Muon must orthogonalise whole matrices, and this hfl3 version "
            "neither gathers them nor shards whole matrices across ranks. Train with DDP (accelerate launch "
            "--config_file accelerate_configs/multi_gpu.yaml, on CPU multi_cpu_ddp.yaml), or keep "
            f"{'ZeRO' if deepspeed else 'FSDP'} with AdamW (the pretrain recipe's --optimizer adamw, a Trainer's "
            "optim='adamw_torch')."
        )
