"""Parameter groups by module kind for `MuonAdamW`, and its construction from `TrainingArguments` for the Trainer.

`param_groups_by_kind` sorts parameters by module type and shape, never by name patterns; `create_muon_optimizer`
is the one-liner for any `transformers.Trainer`: it refuses the DeepSpeed/FSDP setups in which Muon cannot run
(`hfl3.optim.launch`), then builds the groups and the optimizer.
"""

import logging
import math
from dataclasses import fields

from torch import nn

from .launch import refuse_unsupported_sharding
from .muon import MuonAdamW
from .settings import GroupLearningRates, MuonSettings

logger = logging.getLogger(__name__)

# L3GPT's module classes, matched by name so that they are also found when L3GPT is loaded as remote code.
_L3_LAYER_CLASS_NAMES = ("LargeLookupLayer",)
_VALUE_EMBEDDINGS_CLASS_NAMES = ("L3GPTValueEmbeddings",)
_SMEAR_CLASS_NAMES = ("L3GPTSmear",)


def param_groups_by_kind(
    model: nn.Module,
    learning_rates: GroupLearningRates | None = None,
    *,
    hidden_size: int | None = None,
    batch_lr_scale: float = 1.0,
    **changes,
) -> list[dict]:
    """Split the trainable parameters of `model` into MuonAdamW groups by module type and shape.

    | group name        | kind  | what                                                      | lr                       |
    |-------------------|-------|-----------------------------------------------------------|--------------------------|
    | `matrix`          | muon  | 2-D weights of every `nn.Linear` except the output head   | `matrix_lr·b`            |
    | `embedding`       | adamw | `get_input_embeddings()` and any other `nn.Embedding`     | `embedding_lr·s·b`       |
    | `l3_table`        | adamw | the `nn.Embedding`s inside an L3 `LargeLookupLayer`       | `l3_table_lr·s·b`        |
    | `value_embedding` | adamw | the `nn.Embedding`s inside L3GPT's `L3GPTValueEmbeddings` | `value_embedding_lr·s·b` |
    | `unembedding`     | adamw | `get_output_embeddings()` (when tied: the shared weight)  | `unembedding_lr·s·b`     |
    | `scalar`          | adamw | 0-/1-D parameters: norm gains, biases, `x0_lambdas`       | `scalar_lr·b`            |
    | `residual_scalar` | adamw | a module's `resid_lambdas` (L3GPT, nanochat)              | `scalar_lr·0.01·b`       |
    | `smear`           | adamw | `L3GPTSmear` (gate, `smear_lambda`) and `backout_lambda`  | `smear_lr`               |

    The LRs, their defaults (nanochat master 92d63d4's) and the scales `s` (hidden size) and `b` (total batch) are
    `GroupLearningRates`'. The value-embedding gates are `nn.Linear`s in the decoder layers and go to Muon with the
    other matrices, as in nanochat. A tied input/output embedding gets the unembedding LR (the input embedding's 0.3
    would blow up the logits). Empty groups are dropped; frozen parameters (`requires_grad=False`) are left out. Not
    reproduced from nanochat (since 6ed7d1d): its per-group AdamW betas and weight decays (e.g. value embeddings
    betas (0.8, 0.995), weight decay 0.01); here every AdamW group gets the same betas (`create_muon_optimizer`: the
    TrainingArguments') and no weight decay. A parameter's shape is its `ds_shape` when DeepSpeed ZeRO-3 has already
    partitioned it (`zero.Init`: the tensor itself is then empty and 1-D; grouping by that shape would send every
    matrix to AdamW, DeepSpeed's own Muon bug, deepspeedai/DeepSpeed#8438).

    Args:
        model: any `nn.Module`; `get_output_embeddings()` / `get_input_embeddings()` are used when the
            model has them (transformers `PreTrainedModel`), which also covers Qwen3 and Llama.
        learning_rates: the LRs (any object with `GroupLearningRates`' fields, e.g. a `PretrainConfig`; None: the
            defaults).
        hidden_size: for the LR scale `s`; default `model.config.hidden_size`, else the input embedding width.
        batch_lr_scale: `b`.
        changes: LR fields that replace `learning_rates`' (`matrix_lr=0.03`, ...).

    Returns:
        list of dicts with `params`, `kind`, `name`, `lr`, ready for `MuonAdamW`.

    Raises:
        ValueError: for a trainable parameter of 2 or more dimensions outside `nn.Linear` / `nn.Embedding`
            (e.g. a convolution), naming it: Muon's LR and shape rules are not defined for it.
        TypeError: for a key of `changes` that is no LR field.
    """
    rates = GroupLearningRates.of(learning_rates, **changes)
    group_of = _group_of_each_parameter(model)
    group_lrs = rates.learning_rates(_hidden_size(model) if hidden_size is None else hidden_size, batch_lr_scale)
    by_name: dict[str, list[nn.Parameter]] = {name: [] for name in group_lrs}
    for param in model.parameters():  # each shared parameter once, in model order
        if id(param) in group_of:
            by_name[group_of[id(param)]].append(param)
    return [
        {"params": params, "kind": "muon" if name == "matrix" else "adamw", "name": name, "lr": group_lrs[name]}
        for name, params in by_name.items()
        if params
    ]


def _hidden_size(model: nn.Module) -> int | None:
    """`model.config.hidden_size`, else the input embedding's width, else None."""
    hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
    input_embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if hidden_size is None and isinstance(input_embeddings, nn.Embedding):
        hidden_size = input_embeddings.embedding_dim
    return hidden_size


def _group_of_each_parameter(model: nn.Module) -> dict[int, str]:
    """The group name of every trainable parameter of `model`, keyed by `id(param)`: the heads and L3GPT's special
    modules first (they hold `nn.Embedding`s and scalars that are not plain embeddings or scalars), then the rest by
    module type and shape. Raises `ValueError` as `param_groups_by_kind` says."""
    placed: dict[int, str] = {}

    def place(param: nn.Parameter | None, name: str) -> None:
        if isinstance(param, nn.Parameter) and param.requires_grad and id(param) not in placed:
            placed[id(param)] = name

    for accessor, name in (("get_output_embeddings", "unembedding"), ("get_input_embeddings", "embedding")):
        head = getattr(model, accessor, lambda: None)()  # first the output: a tied weight gets the unembedding LR
        if head is not None:
            place(head.weight, name)
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
            if len(getattr(param, "ds_shape", param.shape)) <= 1:
                place(param, "scalar")
            elif isinstance(module, nn.Linear) and param is module.weight:
                place(param, "matrix")
            elif isinstance(module, nn.Embedding) and param is module.weight:
                place(param, "embedding")
            elif param.requires_grad and id(param) not in placed:
                qualified = f"{module_name}.{param_name}" if module_name else param_name
                raise ValueError(
                    f"param_groups_by_kind: parameter {qualified!r} of shape "
                    f"{tuple(getattr(param, 'ds_shape', param.shape))} in "
                    f"{type(module).__name__} is neither an nn.Linear/nn.Embedding weight nor 0-/1-D; MuonAdamW "
                    "has no rule for it. Freeze it, or build the param groups yourself (kind='adamw')."
                )
    return placed


def create_muon_optimizer(
    model: nn.Module,
    args,
    num_training_steps: int | None = None,
    compile_update: bool | None = None,
    **hyperparameters,
) -> MuonAdamW:
    """Build a `MuonAdamW` for `model` from a `TrainingArguments`, after refusing a distributed setup Muon cannot
    run under (`refuse_unsupported_sharding`): the one line for any `transformers.Trainer`::

        trainer = Trainer(model=model, args=args, train_dataset=ds,
                          optimizers=(create_muon_optimizer(model, args, num_training_steps=1000), None))

    The Trainer then builds its LR scheduler (`args.lr_scheduler_type`, warm-up) on this optimizer;
    the scheduler multiplies every group's own LR, and checkpoints save/restore the optimizer state,
    including its step count. Build it after moving `model` to its device and before wrapping it.

    How `TrainingArguments` apply:
        - `args.learning_rate` is NOT used: each group has its own absolute LR, `GroupLearningRates`' (nanochat's,
          or `args`' own `matrix_lr`, `embedding_lr`, ... when `args` is a `GroupLearningRates`, as `PretrainConfig`
          is; a keyword `matrix_lr=...` replaces either). A warning says so when it differs from `matrix_lr`, unless
          `args.group_lrs_from_learning_rate` (an SFT run derived the group LRs from it:
          `GroupLearningRates.for_fine_tuning`). The Trainer's logged `learning_rate` is the first group's: the Muon
          matrix LR.
        - `args.weight_decay` -> the Muon groups' (cautious, linearly decaying) weight decay; the AdamW
          groups get none, as in nanochat.
        - `args.adam_beta1`, `args.adam_beta2`, `args.adam_epsilon` -> every AdamW group (nanochat uses
          0.8, 0.95, 1e-10; transformers' defaults are 0.9, 0.999, 1e-8).
        - `num_training_steps` (or `args.max_steps` when positive) sets the weight-decay decay horizon.

    `compile_update`: `MuonAdamW`'s (None: each same-shape stack's Muon update is `torch.compile`d on CUDA only).

    Other `hyperparameters`: the LR fields of `GroupLearningRates`, `hidden_size` and `batch_lr_scale` (the LR
    scales, see `param_groups_by_kind`), and the fields of `MuonSettings` (`momentum`, `beta2`, `muon_eq`, ...: the
    Muon groups' keys).

    Under DeepSpeed ZeRO-1/2/3 and FSDP2 the optimizer then runs Muon's sharded step (`hfl3.optim.sharded`).

    Raises:
        RuntimeError: for a distributed setup Muon cannot run under (`refuse_unsupported_sharding`).
        ValueError: when the total number of steps is unknown and the weight decay is not 0, or for an
            unknown hyperparameter.
    """
    refuse_unsupported_sharding(args)
    learning_rate_keys = {item.name for item in fields(GroupLearningRates)}
    muon_keys = {item.name for item in fields(MuonSettings)}
    unknown = set(hyperparameters) - learning_rate_keys - muon_keys - {"hidden_size", "batch_lr_scale"}
    if unknown:
        raise ValueError(
            f"create_muon_optimizer: unknown hyperparameters {sorted(unknown)}; the LRs are {sorted(learning_rate_keys)}, "
            f"the weight decay is args.weight_decay, the Muon keys are {sorted(muon_keys)}"
        )
    if num_training_steps is None and getattr(args, "max_steps", -1) > 0:
        num_training_steps = args.max_steps
    if num_training_steps is None and args.weight_decay != 0:
        raise ValueError(
            "create_muon_optimizer: weight_decay decays linearly to 0 over training, so the number of steps is "
            "needed: pass num_training_steps=... or set max_steps in the TrainingArguments"
        )
    muon = {key: value for key, value in hyperparameters.items() if key in muon_keys}
    rates = GroupLearningRates.of(args if isinstance(args, GroupLearningRates) else None,
                                  **{key: value for key, value in hyperparameters.items() if key in learning_rate_keys})
    groups = param_groups_by_kind(model, rates, hidden_size=hyperparameters.get("hidden_size"),
                                  batch_lr_scale=hyperparameters.get("batch_lr_scale", 1.0))
    derived = getattr(args, "group_lrs_from_learning_rate", False)  # then the LRs come from learning_rate
    if not math.isclose(args.learning_rate, rates.matrix_lr) and not derived:
        logger.warning(
            "create_muon_optimizer: TrainingArguments.learning_rate=%g is not used; MuonAdamW groups keep their own "
            "LRs (%s). Pass matrix_lr=... etc. to change them.",
            args.learning_rate,
            ", ".join(f"{group['name']}={group['lr']:.4g}" for group in groups),
        )
    for group in groups:
        if group["kind"] == "muon":
            group.update(muon, weight_decay=args.weight_decay)
        else:
            group.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    return MuonAdamW(groups, num_training_steps=num_training_steps, compile_update=compile_update)
