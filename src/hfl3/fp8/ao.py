"""FP8 through accelerate's torchao (AO) backend (`fp8_config: {backend: AO}`, `accelerate_configs/fp8_ao.yaml`),
the alternative to hfl3's own `Float8Linear`: `check_ao_backend` validates such a launch before the Trainer builds its
Accelerator, and `ao_recipe_kwargs` gives accelerate the same layer selection as `convert_to_float8_training`.

hfl3 never imports torchao itself except in `ao_recipe_kwargs`. transformers 5.23 does, whenever torchao is installed,
as soon as `transformers.modeling_utils` loads (`quantizers/quantizer_torchao.py`, `integrations/torchao.py`), so
`import hfl3` runs torchao's import: on a machine without CUDA torchao 0.18 warns that its CUDA kernels
(`_C_mxfp8*.so`, `_C_cutlass_90a*.so`) do not load, and torch 2.13 that torchao's enum registrations with
`torch.utils._pytree` are deprecated. `import hfl3` keeps these messages (`torchao_import_messages_kept`) and
`check_ao_backend` / `ao_recipe_kwargs` log them when the AO backend is actually used.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator

from torch import nn

from .linear import Float8Linear, _check_recipe, select_float8_layers

# The loggers torchao's import writes to: its own, and torch's pytree registry (enum registrations)
TORCHAO_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")
_kept_messages: list[logging.LogRecord] = []


class _KeepHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _kept_messages.append(record)


@contextlib.contextmanager
def torchao_import_messages_kept() -> Iterator[None]:
    """Inside the block, what the `TORCHAO_IMPORT_LOGGERS` log is kept instead of printed (a no-op when torchao is
    already imported or not installed); `log_torchao_import_messages` logs it later."""
    if "torchao" in sys.modules or importlib.util.find_spec("torchao") is None:
        yield
        return
    handler, loggers = _KeepHandler(), [logging.getLogger(name) for name in TORCHAO_IMPORT_LOGGERS]
    propagate = [logger.propagate for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, flag in zip(loggers, propagate):
            logger.removeHandler(handler)
            logger.propagate = flag


def log_torchao_import_messages() -> None:
    """Log (once) the messages kept by `torchao_import_messages_kept`, through their own loggers."""
    while _kept_messages:
        record = _kept_messages.pop(0)
        logging.getLogger(record.name).handle(record)


def check_ao_backend(training_args, model: nn.Module | None = None) -> dict | None:
    """Validate an `accelerate launch` that asks for FP8 through accelerate's torchao (AO) backend.

    Reads what `accelerate launch --config_file accelerate_configs/fp8_ao.yaml` exports
    (`ACCELERATE_MIXED_PRECISION`, `ACCELERATE_FP8_BACKEND`, `ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER`,
    `ACCELERATE_FP8_PAD_INNER_DIM`) and `training_args.mixed_precision` (transformers' `TrainingArguments`).
    Call it before building the Trainer: each failure below would otherwise surface later inside accelerate 1.15
    (or not at all).

    Returns:
        `None` when no AO FP8 is requested; else a dict for the run log: `backend`, `recipe` ("tensorwise", the
        only one accelerate's yaml can select), `enable_fsdp_float8_all_gather`, `pad_inner_dim`.

    Raises:
        ValueError: backend given as lower-case `ao` (`--fp8_backend ao`, which accelerate 1.15 rejects);
            `ACCELERATE_FP8_BACKEND=AO` without mixed_precision fp8; `training_args.bf16`/`fp16` overriding fp8;
            float8 all-gather on (save_pretrained fails); `model` already converted by `convert_to_float8_training`.
        ImportError: torchao missing.
    """
    env = os.environ
    backend = env.get("ACCELERATE_FP8_BACKEND", "NO")
    launched_fp8 = env.get("ACCELERATE_MIXED_PRECISION", "no").lower() == "fp8"
    if backend.upper() == "AO" and backend != "AO":
        raise ValueError(
            f"ACCELERATE_FP8_BACKEND={backend!r} (from `accelerate launch --fp8_backend ao`): accelerate 1.15 only "
            "accepts upper-case 'AO'; launch with --config_file accelerate_configs/fp8_ao.yaml instead"
        )
    if backend == "AO" and not launched_fp8:
        raise ValueError(
            "ACCELERATE_FP8_BACKEND=AO but mixed_precision is not fp8: accelerate 1.15 would still call torchao "
            "and fail with \"'NoneType' object has no attribute 'config'\"; set mixed_precision: fp8 in the "
            "accelerate config (accelerate_configs/fp8_ao.yaml does)"
        )
    torchao_found = importlib.util.find_spec("torchao") is not None
    if not launched_fp8 or backend not in ("AO", "NO") or (backend == "NO" and not torchao_found):
        return None  # no FP8, or accelerate's TE / MS-AMP backends: not ours to check
    if not torchao_found:
        raise ImportError("accelerate's AO backend needs torchao: pip install 'hfl3[fp8]'")
    if training_args.mixed_precision != "fp8":
        raise ValueError(
            f"accelerate was launched with mixed_precision fp8 but TrainingArguments resolved mixed_precision="
            f"{training_args.mixed_precision!r} (bf16={training_args.bf16}, fp16={training_args.fp16} override it): "
            "pass --bf16 false --fp16 false; accelerate's AO backend autocasts to bf16 itself"
        )
    all_gather = env.get("ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", "true").lower() in ("1", "true", "yes", "on")
    if all_gather:
        raise ValueError(
            "enable_fsdp_float8_all_gather is on (accelerate's default): torchao then wraps the weights in a tensor "
            "subclass that save_pretrained cannot serialise; set fp8_config: {enable_fsdp_float8_all_gather: false} "
            "as accelerate_configs/fp8_ao.yaml does"
        )
    if model is not None and any(isinstance(m, Float8Linear) for m in model.modules()):
        raise ValueError(
            "the model was converted by hfl3.fp8.convert_to_float8_training (--fp8) and accelerate's AO backend is "
            "on too; pick one FP8 path"
        )
    log_torchao_import_messages()
    return {
        "backend": "AO",
        "recipe": "tensorwise",
        "enable_fsdp_float8_all_gather": False,
        "pad_inner_dim": env.get("ACCELERATE_FP8_PAD_INNER_DIM", "true").lower() in ("1", "true", "yes", "on"),
    }


def ao_recipe_kwargs(model: nn.Module, recipe: str = "tensorwise"):
    """accelerate `AORecipeKwargs` that convert exactly the layers `select_float8_layers(model)` picks.

    accelerate's own default filter keeps only the first and last `nn.Linear` (for an L3GPT with smear: the smear
    gate and `lm_head`, so layer 0's `q_proj`/`k_proj`/`v_proj` and layers smaller than 128 become FP8); pass this in `Accelerator(kwargs_handlers=[...])` (with the HF Trainer:
    append it to `kwargs_handlers` in an override of `Trainer._build_accelerator_args`) to apply hfl3's rules to the
    torchao backend as well. float8 all-gather stays off (see `check_ao_backend`). Note that torchao's "rowwise"
    recipe casts gradients to e4m3 with power-of-two scales, where hfl3's rowwise uses e5m2.

    Args:
        model: the model that will be given to `accelerator.prepare` (names are matched against it).
        recipe: torchao recipe name, `"tensorwise"` or `"rowwise"`.

    Raises:
        ImportError: torchao missing.
        ValueError: on an unknown recipe.
    """
    from accelerate.utils import AORecipeKwargs
    from torchao.float8 import Float8LinearConfig

    log_torchao_import_messages()
    _check_recipe(recipe)
    selected = set(select_float8_layers(model)[0])
    config = Float8LinearConfig.from_recipe_name(recipe)  # float8 all-gather off in both recipes
    return AORecipeKwargs(config=config, module_filter_func=lambda module, name: name in selected)
