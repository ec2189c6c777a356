"""What a full SFT run takes from the pretraining run of its base, as nanochat's chat SFT does
(karpathy/nanochat 92d63d4, scripts/chat_sft.py): the sequence length, the batch, the group learning rates and the
optimizer's state, unless given. Decided once, when the arguments are checked (`decide_from_base`, called by
`hfl3.trainers.cli.arguments.check_sft_inputs`); the builder applies the settings and logs each with its source.

| setting | from the base's `metadata.json` (a `recipes/pretrain.py` output) | when |
|---|---|---|
| `max_length`, `per_device_train_batch_size` | `training_args` | every weight trained (`--use_peft false`) |
| `gradient_accumulation_steps` | `compute_optimal.total_batch_size` tokens / (rows × `max_length` × processes) | none of the three given |
| `matrix_lr`, `embedding_lr`, ... (`GroupLearningRates`), `batch_lr_scale` | `training_args`, `compute_optimal.lr_scale` | with `--optim muon`, from a base pretrained with Muon |
| the optimizer's state (`--load_optimizer`) | the base's `optimizer/optimizer.safetensors` | its optimizer is this run's |

A full fine-tuning takes TRL's learning rate, 2e-5, unless given (hfl3's 2e-4 is LoRA's): with AdamW, and with Muon
on a base that Muon did not pretrain (any base but a `recipes/pretrain.py --optim muon` output), whose group LRs not
given are then derived from `--learning_rate` by one rule, `GroupLearningRates.for_fine_tuning` (nanochat's
pretraining-scale LRs wreck such a base), each logged with its source.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields
from pathlib import Path

from safetensors import safe_open

from hfl3.errors import InputError
from hfl3.optim.settings import GroupLearningRates
from hfl3.optim.state_file import FILE as OPTIMIZER_FILE
from hfl3.optim.state_file import read_header, state_problem

logger = logging.getLogger(__name__)

FULL_FINE_TUNING_LEARNING_RATE = 2e-5
"""TRL's `SFTConfig.learning_rate` default (trl 1.16), for a full fine-tuning with AdamW."""
LEARNING_RATES = tuple(item.name for item in fields(GroupLearningRates))


def pretraining_metadata(name_or_path: str) -> dict | None:
    """The `metadata.json` of a local base folder that `recipes/pretrain.py` wrote (it has `compute_optimal` and
    `training_args`), else None."""
    path = Path(name_or_path) / "metadata.json"
    try:
        metadata = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return metadata if isinstance(metadata, dict) and "compute_optimal" in metadata and "training_args" in metadata \
        else None


def weight_shapes(folder: str | Path) -> dict[str, tuple]:
    """`{name: shape}` of the tensors in a model folder's `.safetensors` files, read from their headers."""
    shapes = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            shapes.update({key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()})
    return shapes


def optimizer_class(training_args) -> str | None:
    """The class name of the optimizer this run will build: MuonAdamW, torch's AdamW (`--optim adamw_torch*`), else
    None (a state file of another optimizer is not read)."""
    if training_args.use_muon:
        return "MuonAdamW"
    return "AdamW" if str(getattr(training_args.optim, "value", training_args.optim)).startswith("adamw_torch") \
        else None


def decide_from_base(model_args, training_args, given: frozenset[str]) -> tuple[dict[str, tuple], Path | None]:
    """The settings a run takes from its base (module docstring), and the optimizer state file to warm-start from.

    Returns:
        `({name: (value, source)}, path or None)`: `source` says where the value comes from, for the log.

    Raises:
        InputError: `--load_optimizer true` where it cannot act (LoRA, no state file, another optimizer's state,
            another model's shapes, DeepSpeed or FSDP); a base total batch the rows, length and processes do not
            divide; Muon on a base that Muon did not pretrain whose config gives no `hidden_size` for
            `for_fine_tuning`, without `--matrix_lr`.
    """
    settings: dict[str, tuple] = {}
    full = not model_args.use_peft
    base = pretraining_metadata(model_args.model_name_or_path) if full else None
    muon_base = base is not None and bool(base["training_args"].get("use_muon"))
    if full and "learning_rate" not in given and not (training_args.use_muon and muon_base):
        settings["learning_rate"] = (FULL_FINE_TUNING_LEARNING_RATE, "full fine-tuning's default (TRL's SFTConfig)")
    if full and training_args.use_muon and not muon_base:
        settings.update(fine_tuning_learning_rates(model_args, training_args, given, base is not None,
                                                   settings.get("learning_rate", (training_args.learning_rate,))[0]))
    if base is not None:
        pretrain_args, plan = base["training_args"], base["compute_optimal"] or {}
        source = "the base's metadata.json"
        for name in ("max_length", "per_device_train_batch_size"):
            if name not in given and pretrain_args.get(name) is not None:
                settings[name] = (pretrain_args[name], f"{source}, training_args.{name}")
        total = plan.get("total_batch_size")
        batch = ("per_device_train_batch_size", "max_length", "gradient_accumulation_steps")
        if total and not given & set(batch):  # the batch as a whole: rows, length and accumulation
            rows = settings.get("per_device_train_batch_size", (training_args.per_device_train_batch_size,))[0]
            length = settings.get("max_length", (training_args.max_length,))[0]
            per_step = rows * length * training_args.world_size
            if total % per_step:
                raise InputError(f"the base's total batch of {total} tokens is not a multiple of {rows} rows x "
                                 f"{length} tokens x {training_args.world_size} processes = {per_step}; pass "
                                 "--gradient_accumulation_steps, or a --per_device_train_batch_size that divides it")
            settings["gradient_accumulation_steps"] = (
                total // per_step, f"{source}, compute_optimal.total_batch_size {total} tokens / ({rows} rows x "
                f"{length} tokens x {training_args.world_size} processes)")
        if training_args.use_muon and muon_base:
            for name in LEARNING_RATES:
                if name not in given and pretrain_args.get(name) is not None:
                    settings[name] = (pretrain_args[name], f"{source}, training_args.{name}")
            if plan.get("lr_scale"):
                settings["batch_lr_scale"] = (plan["lr_scale"], f"{source}, compute_optimal.lr_scale")
    return settings, _optimizer_state(model_args, training_args)


def fine_tuning_learning_rates(model_args, training_args, given: frozenset[str], hfl3_base: bool,
                               learning_rate: float) -> dict[str, tuple]:
    """The group LRs not `given` of a Muon run on a base that Muon did not pretrain, derived from `learning_rate` by
    `GroupLearningRates.for_fine_tuning` (the base's `hidden_size` read from its config), as `decide_from_base`'s
    settings, and `group_lrs_from_learning_rate` (which keeps MuonAdamW from warning that the LR is unused).

    Raises:
        InputError: `matrix_lr` not given and the base's config gives no `hidden_size`.
    """
    why = ("the base was pretrained by recipes/pretrain.py without Muon" if hfl3_base else
           "the base was not pretrained with Muon by recipes/pretrain.py")
    hidden_size = None if "matrix_lr" in given else base_hidden_size(model_args, training_args)
    if "matrix_lr" not in given and hidden_size is None:
        raise InputError(f"--optim muon on {model_args.model_name_or_path}: {why}, so its group LRs are derived from "
                         "--learning_rate and its hidden_size (GroupLearningRates.for_fine_tuning), which its config "
                         "does not give; pass --matrix_lr (and --embedding_lr, --unembedding_lr, --scalar_lr)")
    derived = GroupLearningRates.for_fine_tuning(learning_rate, hidden_size or 0)
    rule = (f"--learning_rate {learning_rate:g} by GroupLearningRates.for_fine_tuning: matrix_lr = 0.2 x "
            f"sqrt(hidden_size {hidden_size}) x learning_rate, Muon's update at AdamW's RMS (Moonshot AI, arXiv "
            "2502.16982, section 2.2); the AdamW groups' = learning_rate")
    settings = {"group_lrs_from_learning_rate": (True, f"{why}: fine-tuning-scale group LRs from {rule}")}
    for name in LEARNING_RATES:
        value = getattr(derived, name)
        if name not in given and value is not None:
            settings[name] = (value, f"--learning_rate {learning_rate:g}, fine-tuning scale ({why})")
    return settings


def base_hidden_size(model_args, training_args) -> int | None:
    """The base's `hidden_size` (of its text config) from its config (a folder's `config.json`, a cached Hub
    model's, a GGUF file's), or None when it has none or cannot be read."""
    from transformers import AutoConfig

    options = {"revision": model_args.model_revision, "gguf_file": model_args.gguf_file,
               "trust_remote_code": training_args.trust_remote_code}
    try:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path,
                                            **{key: value for key, value in options.items() if value is not None})
    except Exception:  # noqa: BLE001 (whatever transformers raises for a config it cannot read: no hidden size)
        return None
    hidden_size = getattr(config.get_text_config(), "hidden_size", None)
    return hidden_size if isinstance(hidden_size, int) and hidden_size > 0 else None


def _optimizer_state(model_args, training_args) -> Path | None:
    wanted = training_args.load_optimizer
    if wanted and model_args.use_peft:
        raise InputError("--load_optimizer true: LoRA trains new adapter weights that the base's optimizer never "
                         "saw; drop --load_optimizer, or train every weight (--use_peft false)")
    if model_args.use_peft or wanted is False:
        return None
    folder = Path(model_args.model_name_or_path)
    state, problem = folder / OPTIMIZER_FILE, None
    expected = optimizer_class(training_args)
    if not state.is_file():
        problem = (f"--model_name_or_path {model_args.model_name_or_path} has no {OPTIMIZER_FILE} (recipes/pretrain.py "
                   "writes one with its final model)")
    elif training_args.deepspeed or training_args.fsdp:
        problem = "DeepSpeed and FSDP shard the optimizer; the state file holds whole parameters"
    elif expected is None:
        problem = f"--optim {training_args.optim} is neither muon nor adamw_torch, whose states the file can hold"
    else:
        try:
            problem = state_problem(read_header(state), weight_shapes(folder), expected)
        except (OSError, ValueError) as error:
            problem = f"{state.name} is unreadable ({str(error).splitlines()[0]})"
        if problem:
            problem = f"the base's {OPTIMIZER_FILE} does not fit this run: {problem}"
    if problem and wanted:
        raise InputError(f"--load_optimizer true: {problem}; pass --load_optimizer false to start the optimizer "
                         "fresh")
    if problem:
        if state.is_file():
            logger.info("optimizer: a fresh one (%s)", problem)
        return None
    return state
