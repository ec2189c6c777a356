"""nanochat's compute-optimal training dial: from a model's size to its training horizon, total batch size,
learning-rate scale and weight decay (karpathy/nanochat 92d63d4, scripts/base_train.py, "Scaling laws and muP
extrapolations").

Given the scaling parameters N of the model and N_ref of the reference model (the same architecture at depth 12,
dense: nanochat's `build_model_meta(12)`, where its batch size and hyperparameters were tuned):

    D      = int(r · N)                            compute-optimal tokens, r = target_param_data_ratio (12)
    D_ref  = r · N_ref
    B      = 2^round(log2(B_ref · (D / D_ref)^0.383)),  B_ref = 2^19 tokens      (auto total_batch_size; Power Lines,
                                                                                   arXiv 2505.13738)
    steps  = max_steps, else round(target_flops / (F · B)), else D // B         (F: FLOPs per token)
    lr     × √(B / B_ref)                           every group but nanochat's smear group (AdamW's √ batch rule)
    λ      = λ_ref · √(B / B_ref) · (D_ref / D)                                  (arXiv 2405.13698: constant
                                                                                   B / (η·λ·D))

D is the ratio's horizon even when `max_steps` or `target_flops` sets the steps, as in nanochat: the auto batch and
the weight decay depend on the model's size, not on the budget chosen. `compute_optimal_plan` computes all of it;
`apply_plan` puts it into the training arguments; the group learning rates
themselves (the √(B/B_ref) factor next to nanochat's (hidden_size/768)^-½) are `hfl3.optim.param_groups_by_kind`'s.
"""

import math
from dataclasses import asdict, dataclass

import torch

from hfl3.errors import InputError
from hfl3.models.l3gpt.configuration_l3gpt import flops_per_token

REFERENCE_DEPTH = 12  # nanochat tuned its hyperparameters and B_ref on d12
REFERENCE_TOTAL_BATCH_SIZE = 2**19  # B_ref, tokens (nanochat dev/LOG.md 2026-02-05, measured at d12)
BATCH_SIZE_EXPONENT = 0.383  # B_opt ∝ D^0.383 (Power Lines, arXiv 2505.13738)
TARGET_PARAM_DATA_RATIO = 12.0  # nanochat master's --target-param-data-ratio default (10.5 before it)

PARAMETER_KINDS = {  # hfl3's kind (a `param_groups_by_kind` group name) → nanochat's `num_scaling_params` key
    "matrix": "transformer_matrices",  # attention, MLP, value-embedding gates; and L3 up/mix projections
    "unembedding": "lm_head",
    "embedding": "wte",
    "value_embedding": "value_embeds",
    "l3_table": "-",  # hfl3 only
    "scalar": "scalars",  # per-layer lambdas, smear gate and lambda, backout lambda
}


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Trainable parameters of `model` by kind, the kinds of `hfl3.optim.param_groups_by_kind` with the scalar groups
    (`scalar`, `residual_scalar`, `smear`) summed into `scalar`, plus `scaling` and `total`.

    `scaling` = `matrix` + `unembedding`: the parameters that multiply the token stream (every `nn.Linear` weight but
    the smear gate's 24, which nanochat counts with the scalars) — nanochat's `transformer_matrices + lm_head`. Token
    embeddings, value embeddings and L3 tables are left out because they are lookups: a token reads one row (an L3
    layer reads its token's few rows), so they add capacity at almost no FLOPs and their size does not set how many
    tokens the model wants. nanochat counts its value embeddings this way (its dev/LOG.md 2026-01-27: with lookup
    tables holding most parameters, "Kaplan-style" counts of the projections including lm_head gave a stable
    tokens:params ratio across 1e18–1e19 FLOPs, counts of all parameters drifted 3.0 → 4.0); L3 tables are lookups
    of the same kind, so they count alike. An L3 layer's up and mix projections are matrices and count.

    Args:
        model: an L3GPT (or any model `param_groups_by_kind` groups); the meta device is enough.

    Returns:
        dict of ints: `matrix`, `unembedding`, `embedding`, `value_embedding`, `l3_table`, `scalar`, `scaling`,
        `total`.
    """
    from hfl3.optim import param_groups_by_kind

    counts = dict.fromkeys(PARAMETER_KINDS, 0)
    for group in param_groups_by_kind(model):
        kind = group["name"] if group["name"] in counts else "scalar"
        counts[kind] += sum(parameter.numel() for parameter in group["params"])
    counts["scaling"] = counts["matrix"] + counts["unembedding"]
    counts["total"] = sum(counts[kind] for kind in PARAMETER_KINDS)
    return counts


def meta_model(config) -> torch.nn.Module:
    """An `L3GPTForCausalLM` of `config` on the meta device (shapes only, no memory, no init work)."""
    from hfl3 import L3GPTForCausalLM

    with torch.device("meta"):
        return L3GPTForCausalLM(config)


def auto_total_batch_size(target_tokens: float, reference_tokens: float) -> int:
    """nanochat's `--total-batch-size -1`: `B_ref · (D / D_ref)^0.383` rounded to the nearest power of 2 (in log2),
    in tokens. `D` and `D_ref` in tokens (their ratio is what counts)."""
    predicted = REFERENCE_TOTAL_BATCH_SIZE * (target_tokens / reference_tokens) ** BATCH_SIZE_EXPONENT
    return 2 ** round(math.log2(predicted))


class PlanError(InputError):
    """A run the dial cannot size (a batch that does not divide, a budget under one step, a contradicting
    `--gradient_accumulation_steps`); the message names the numbers and the fix. Raised while the arguments are
    parsed or checked, or by `compute_optimal_plan` once the model is known: the recipes end with it in one line,
    exit status 2 (`hfl3.trainers.cli.exits`)."""


def derive_gradient_accumulation_steps(total_batch_size: int, per_device_train_batch_size: int, max_length: int,
                                world_size: int) -> int:
    """Micro-batches per optimizer step so that one step sees `total_batch_size` tokens: `total_batch_size /
    (per_device_train_batch_size · max_length · world_size)`.

    Raises:
        PlanError: the tokens of one micro-batch over all processes do not divide `total_batch_size`, naming the
            numbers and the fix.
    """
    micro_batch = per_device_train_batch_size * max_length * world_size
    if total_batch_size % micro_batch:
        raise PlanError(
            f"total_batch_size={total_batch_size:,} tokens is not a multiple of per_device_train_batch_size × "
            f"max_length × world size = {per_device_train_batch_size} × {max_length} × {world_size} = "
            f"{micro_batch:,} tokens; change --per_device_train_batch_size (a power of 2 divides the auto batch) or "
            "pass --total_batch_size as a multiple of it")
    return total_batch_size // micro_batch


@dataclass(frozen=True)
class ComputeOptimalPlan:
    """A run's size as nanochat's `base_train.py` computes it (see the module docstring). Token counts in tokens.

    Attributes:
        vocab_size: the model's (padded) vocabulary.
        parameter_counts: `parameter_counts` of the model; `reference_scaling_parameters`: N_ref.
        flops_per_token: training FLOPs per token (forward + backward), `configuration_l3gpt.flops_per_token`.
        target_param_data_ratio: r; `target_tokens`: D = int(r · N); `reference_tokens`: D_ref = r · N_ref.
        total_batch_size: B, tokens per optimizer step; `batch_size_rule`: `"auto"`, `"given"` (`--total_batch_size
            N`) or `"trainer"` (per-device batch × max_length × world size × `gradient_accumulation_steps` as set).
        per_device_train_batch_size, max_length, world_size, gradient_accumulation_steps: how B is made.
        max_steps: optimizer steps; `horizon`: what set them (`"max_steps"`, `"target_flops"`,
            `"target_param_data_ratio"`); `target_flops`: the budget given, or None.
        sized_by_dial: False for a run sized by hand (`max_steps` given, no `total_batch_size`): nothing rescaled.
        lr_scale: √(B / B_ref) when the dial sized the run, else 1 (the LRs as given).
        reference_weight_decay: λ_ref (`--weight_decay`); `weight_decay`: λ.
        learning_rates: the optimizer's group LRs after scaling (`use_muon`: per `MuonAdamW` group; else
            `learning_rate`).
    """

    vocab_size: int
    parameter_counts: dict
    reference_scaling_parameters: int
    flops_per_token: int
    target_param_data_ratio: float
    target_tokens: int
    reference_tokens: float
    total_batch_size: int
    batch_size_rule: str
    per_device_train_batch_size: int
    max_length: int
    world_size: int
    gradient_accumulation_steps: int
    max_steps: int
    horizon: str
    target_flops: float | None
    sized_by_dial: bool
    lr_scale: float
    reference_weight_decay: float
    weight_decay: float
    learning_rates: dict

    @property
    def training_tokens(self) -> int:
        return self.total_batch_size * self.max_steps

    def as_dict(self) -> dict:
        """The plan, with the derived `training_tokens`, `training_flops`, `tokens_per_scaling_parameter` and
        `reference_total_batch_size`: the `compute_optimal` section of metadata.json."""
        return {**asdict(self), "training_tokens": self.training_tokens,
                "training_flops": self.flops_per_token * self.training_tokens,
                "tokens_per_scaling_parameter": self.training_tokens / self.parameter_counts["scaling"],
                "reference_total_batch_size": REFERENCE_TOTAL_BATCH_SIZE}

    def table(self) -> str:
        """The plan as the text table the recipe prints at start: label, value, how the value came about."""
        counts, tokens = self.parameter_counts, self.training_tokens
        power = int(math.log2(self.total_batch_size))
        batch_rule = {"auto": f"auto: 2^19 · (D / D_ref)^{BATCH_SIZE_EXPONENT} → 2^{power}",
                      "given": "--total_batch_size",
                      "trainer": "per-device batch × max_length × processes × accumulation"}[self.batch_size_rule]
        steps_rule = {"max_steps": "--max_steps", "target_param_data_ratio": "D // B",
                      "target_flops": f"round({self.target_flops or 0:g} / (FLOPs per token · B))"}[self.horizon]
        by_hand = "sized by hand (--max_steps, no --total_batch_size)"
        scaling_kinds = ("matrix", "unembedding")
        rows = [(f"  {kind} ({nanochat})", f"{counts[kind]:,}", "scaling" if kind in scaling_kinds else "")
                for kind, nanochat in PARAMETER_KINDS.items()]
        rows += [
            ("  total", f"{counts['total']:,}", ""),
            ("scaling parameters N", f"{counts['scaling']:,}",
             f"matrix + unembedding; d{REFERENCE_DEPTH} reference N_ref {self.reference_scaling_parameters:,}"),
            ("FLOPs per token", f"{self.flops_per_token:.4e}", "6 · matmul parameters + attention"),
            ("target tokens D", f"{self.target_tokens:,}",
             f"int({self.target_param_data_ratio:g} · N); D_ref {self.reference_tokens:,.0f}"),
            ("total batch B (tokens)", f"{self.total_batch_size:,}", batch_rule),
            ("gradient accumulation", f"{self.gradient_accumulation_steps}", f"B / ({self.per_device_train_batch_size} "
             f"rows × {self.max_length} tokens × {self.world_size} process(es))"),
            ("steps", f"{self.max_steps:,}", steps_rule),
            ("training tokens", f"{tokens:,}", f"{tokens / counts['scaling']:.2f} per scaling parameter, "
                                               f"{self.flops_per_token * tokens:.3e} FLOPs"),
            ("LR scale", f"{self.lr_scale:.6f}", "√(B / 2^19)" if self.sized_by_dial else by_hand),
            ("weight decay", f"{self.weight_decay:.6g}",
             f"{self.reference_weight_decay:g} · √(B / 2^19) · D_ref / D" if self.sized_by_dial else "as given"),
            ("learning rates", "", ""),
        ]
        rows += [(f"  {name}", f"{lr:.6g}", "") for name, lr in self.learning_rates.items()]
        width = max(len(label) for label, _, _ in rows)
        lines = [f"{label:<{width}}  {value:>15}  {note}".rstrip() for label, value, note in rows]
        return "\n".join(["compute-optimal plan (nanochat base_train's dial); parameters (nanochat's name):", *lines])


def compute_optimal_plan(config, reference_config, args, world_size: int | None = None) -> ComputeOptimalPlan:
    """Size a pretraining run of an L3GPT as nanochat's `base_train.py` does (module docstring).

    Precedence for the steps: `args.max_steps` (> 0) > `args.target_flops` > `args.target_param_data_ratio` (None:
    12). `args.total_batch_size`: tokens per step, -1 = auto, None = -1 when the dial sets the steps, else the
    Trainer's batch as configured (a run sized by hand: LR scale 1 and `weight_decay` as given).

    Args:
        config: the `L3GPTConfig` to train.
        reference_config: the same architecture at depth 12 without L3 layers (nanochat's `build_model_meta(12)`).
        args: a `PretrainConfig` (`max_steps`, `target_flops`, `target_param_data_ratio`, `total_batch_size`,
            `per_device_train_batch_size`, `max_length`, `gradient_accumulation_steps`, `weight_decay`, `use_muon` and
            the `*_lr` fields).
        world_size: processes (default `args.world_size`).

    Returns:
        the `ComputeOptimalPlan`; nothing in `args` changes.

    Raises:
        PlanError: the micro-batches do not divide the total batch; `gradient_accumulation_steps` was set and
            differs from the one the total batch needs; the horizon comes to 0 steps.
    """
    from hfl3.optim import param_groups_by_kind

    world_size = args.world_size if world_size is None else world_size
    model = meta_model(config)
    counts = parameter_counts(model)
    reference_scaling = parameter_counts(meta_model(reference_config))["scaling"]
    flops = flops_per_token(config, args.max_length)
    ratio = TARGET_PARAM_DATA_RATIO if args.target_param_data_ratio is None else args.target_param_data_ratio
    target_tokens = int(ratio * counts["scaling"])
    reference_tokens = ratio * reference_scaling

    total_batch_size = args.total_batch_size
    if total_batch_size is None and args.max_steps <= 0:
        total_batch_size = -1
    if total_batch_size is None:
        rule, accumulation = "trainer", args.gradient_accumulation_steps
        total_batch_size = args.per_device_train_batch_size * args.max_length * world_size * accumulation
    else:
        rule = "given" if total_batch_size > 0 else "auto"
        if rule == "auto":
            total_batch_size = auto_total_batch_size(target_tokens, reference_tokens)
        accumulation = derive_gradient_accumulation_steps(total_batch_size, args.per_device_train_batch_size,
                                                          args.max_length, world_size)
        if args.gradient_accumulation_steps not in (1, accumulation):
            raise PlanError(
                f"gradient_accumulation_steps={args.gradient_accumulation_steps} contradicts total_batch_size="
                f"{total_batch_size:,} ({rule}), which needs {accumulation}: drop --gradient_accumulation_steps (it "
                "is derived) or --total_batch_size")

    if args.max_steps > 0:
        horizon, max_steps = "max_steps", args.max_steps
    elif args.target_flops is not None:
        horizon, max_steps = "target_flops", round(args.target_flops / (flops * total_batch_size))
    else:
        horizon, max_steps = "target_param_data_ratio", target_tokens // total_batch_size
    if max_steps < 1:
        budget = (f"target_flops={args.target_flops:g}" if horizon == "target_flops" else
                  f"target_param_data_ratio={ratio:g} ({target_tokens:,} tokens)")
        raise PlanError(f"{budget} is less than one step of {total_batch_size:,} tokens: raise it, or lower "
                         "--total_batch_size")

    sized_by_dial = horizon != "max_steps" or rule != "trainer"
    lr_scale = math.sqrt(total_batch_size / REFERENCE_TOTAL_BATCH_SIZE) if sized_by_dial else 1.0
    weight_decay = args.weight_decay * lr_scale * (reference_tokens / target_tokens) if sized_by_dial else \
        args.weight_decay
    if args.use_muon:
        groups = param_groups_by_kind(model, args, batch_lr_scale=lr_scale)
        learning_rates = {group["name"]: group["lr"] for group in groups}
    else:
        learning_rates = {"learning_rate": args.learning_rate * lr_scale}
    return ComputeOptimalPlan(
        vocab_size=config.vocab_size, parameter_counts=counts, reference_scaling_parameters=reference_scaling,
        flops_per_token=flops, target_param_data_ratio=ratio, target_tokens=target_tokens,
        reference_tokens=reference_tokens, total_batch_size=total_batch_size, batch_size_rule=rule,
        per_device_train_batch_size=args.per_device_train_batch_size, max_length=args.max_length,
        world_size=world_size, gradient_accumulation_steps=accumulation, max_steps=max_steps, horizon=horizon,
        target_flops=args.target_flops, sized_by_dial=sized_by_dial, lr_scale=lr_scale,
        reference_weight_decay=args.weight_decay, weight_decay=weight_decay, learning_rates=learning_rates,
    )


def apply_plan(training_args, plan: ComputeOptimalPlan) -> None:
    """Size a run by `plan` (computed from these `PretrainConfig` arguments): `max_steps`,
    `gradient_accumulation_steps`, `weight_decay` (λ, replacing λ_ref) and `batch_lr_scale` (which the trainer's
    `create_optimizer` applies). Call it once, before the Trainer is built (the Trainer's accelerator reads the
    accumulation); a DeepSpeed config given with `--deepspeed` has its "auto" values filled again, as the Trainer does
    after a hyperparameter search.

    Raises:
        RuntimeError: when a plan was already applied to `training_args` (a second one would rescale λ again).
    """
    if getattr(training_args, "_compute_optimal_plan", None) is not None:
        raise RuntimeError("apply_plan: a plan is already applied to these arguments")
    training_args._compute_optimal_plan = plan
    training_args.max_steps = plan.max_steps
    training_args.gradient_accumulation_steps = plan.gradient_accumulation_steps
    training_args.weight_decay = plan.weight_decay
    training_args.batch_lr_scale = plan.lr_scale
    if getattr(training_args, "hf_deepspeed_config", None) is not None:
        from accelerate.utils import DeepSpeedPlugin
        from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

        training_args.hf_deepspeed_config = HfTrainerDeepSpeedConfig(training_args.deepspeed)
        training_args.hf_deepspeed_config.trainer_config_process(training_args)
        training_args.deepspeed_plugin = DeepSpeedPlugin(hf_ds_config=training_args.hf_deepspeed_config)
