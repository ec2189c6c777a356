"""The base model of LoRA SFT, loaded as TRL's `trl sft` loads it, quantized by bitsandbytes for QLoRA: the checks
of the quantization arguments (`check_quantization_arguments`, before any work), the load (`load_base_model`), what a
quantized base records (`quantization_metadata`), the merge of an adapter into it (`merge_adapter`), and the SFT flags
that act on some models only, checked against the model's config (`check_model_flags`).

What TRL 1.16 does, and so hfl3: `trl/scripts/sft.py` builds `from_pretrained`'s keyword arguments from `--dtype`,
`--attn_implementation`, `--model_revision` and `--trust_remote_code`, then updates them with `--model_init_kwargs`
(so `model_init_kwargs` wins where both name a value); `SFTTrainer` loads through `create_model_from_path` with
`get_quantization_config(model_args)` (4-bit: compute dtype = `--dtype`; 8-bit: LLM.int8). `SFTTrainer` does not call
PEFT's `prepare_model_for_kbit_training` (only TRL's experimental CPO/ORPO trainers do): with a `peft_config` it wraps
the model, casts the trainable adapter weights of a k-bit model to bfloat16 (QLoRA paper, §3) and, with activation
checkpointing, enables input gradients. hfl3 prepares nothing more, so nothing is done twice, and the unquantized
weights (embeddings, norms, `lm_head`) stay in the load dtype where `prepare_model_for_kbit_training` would upcast them
to float32. `get_kbit_device_map`, which older TRL releases used, is gone from TRL 1.16: `create_model_from_path`
places the model (`device_map` None on CPU/MPS, else "auto"), `SFTTrainer` forces None in a launch of several
processes, and bitsandbytes then puts the model on the process's own device.

Where hfl3 differs from TRL, each on purpose:
- the 4-bit compute dtype is the dtype the weights load in (`model_init_kwargs["dtype"]` over `--dtype`, as the load
  itself), where TRL takes `--dtype` alone; TRL's comment says it means "consistency with model weights", which
  breaks when only `model_init_kwargs` names the dtype;
- `device_map` is None in every launch of several processes (TRL: DDP and DeepSpeed only; with FSDP its "auto" would
  load every process's copy across all the GPUs);
- an L3GPT keeps its smear gate and value-embedding gates in high precision besides `lm_head`
  (`L3GPT_HIGH_PRECISION_MODULES`);
- the 4-bit layers stay off bitsandbytes' CPU inference kernel (below).

bitsandbytes 0.50.2 on a CPU with AVX512-BF16 (`Linear4bit.support_avx512bf16_for_cpu`, set from `has_avx512bf16()`
when the layer is built) repacks a `Linear4bit`'s weight in place at its first forward in eval mode without gradients
(`_convert_weight_packed_for_cpu`: another nibble order, the block scales transposed and cast to bfloat16) and from
then on computes the layer with its fused inference kernel (`gemv_4bit`, activations in bfloat16), in training too.
That kernel has no backward: after the Trainer's step-0 evaluation no gradient crossed a 4-bit layer, and the adapters
on a Qwen3's q, v and up projections (each reaching the loss through `o_proj` or `down_proj`) got zero gradients. The
layer's `state_dict()` undoes the repacking in place (`_convert_weight_packed_for_cpu_inverse`) but leaves non-nested
scales transposed, so a merge after an evaluation (PEFT's `get_peft_model_state_dict` calls it) scrambled every layer
whose rows span several 64-weight blocks. `load_base_model` therefore turns the repacking off on every `Linear4bit`:
training, evaluation and generation take bitsandbytes' dequantize-and-matmul path in the compute dtype, as on any
other CPU; `merge_adapter` undoes the repacking of a base repacked elsewhere itself (`_undo_cpu_repacking`)
(dev/LOG.md 2026-11-28).
"""

from __future__ import annotations

import copy

import torch
from peft import PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig, GgufConfig, PreTrainedModel
from transformers.utils import is_bitsandbytes_available
from transformers.utils.import_utils import BITSANDBYTES_MIN_VERSION
from trl import get_quantization_config
from trl.trainer.utils import create_model_from_path

QLORA_INSTALL = "pip install 'hfl3[qlora]'"
L3GPT_HIGH_PRECISION_MODULES = ("lm_head", "smear.gate", "value_embedding_gate")
"""`llm_int8_skip_modules` of an L3GPT (transformers matches each as a name suffix). The smear gate (24 → 1) and the
value-embedding gates (12 → heads) read a slice of a token's channels and give one or two scalars per token: in
bitsandbytes' 64-weight blocks a whole gate row shares one scale, and quantizing them saves nothing measurable.
`lm_head` is what transformers keeps by default (`get_keys_to_not_convert`: the output embedding), which an explicit
skip list replaces. The L3 tables and value embeddings are `nn.Embedding`s, never quantized."""
QUANT_STORAGE_DTYPES = ("float16", "float32", "int8", "uint8", "float64", "bfloat16")  # BitsAndBytesConfig accepts
LOAD_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}  # TRL's names


def model_init_kwargs(model_args, training_args) -> dict:
    """`from_pretrained`'s keyword arguments as `trl/scripts/sft.py` builds them: `revision`, `trust_remote_code`,
    `attn_implementation` and `dtype` from the arguments, then `training_args.model_init_kwargs` over them (it wins:
    `--dtype float32 --model_init_kwargs '{"dtype": "bfloat16"}'` loads bfloat16)."""
    kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                  attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    return kwargs | dict(training_args.model_init_kwargs or {})


def load_dtype(model_args, training_args) -> torch.dtype | str | None:
    """The dtype the weights load in: `model_init_kwargs["dtype"]` when given, else `--dtype` (TRL's default
    "float32"); a `torch.dtype` for a dtype's name, "auto" or None as given."""
    dtype = model_init_kwargs(model_args, training_args).get("dtype", "float32")
    return LOAD_DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype


def check_quantization_arguments(model_args, training_args) -> int | None:
    """Refuse, before any work, the quantization arguments that would fail late or train something else than asked.
    Returns the bits the base will be quantized to (4 or 8), or None.

    Args:
        model_args: a `trl.ModelConfig` (`load_in_4bit`, `load_in_8bit`, `bnb_4bit_quant_type`,
            `use_bnb_nested_quant`, `bnb_4bit_quant_storage`, `use_peft`, `dtype`, and `gguf_file` where it has one).
        training_args: an `SFTConfig` (`model_init_kwargs`).

    Raises:
        ValueError: one line naming the argument and the fix: 4-bit and 8-bit together; a `bnb_*` option without
            `--load_in_4bit`; bitsandbytes missing (older than transformers' minimum); `--use_peft false` (a quantized
            base cannot be fully fine-tuned: transformers refuses it after the data are prepared); with `--gguf_file`
            (transformers refuses to quantize a GGUF file); `quantization_config` also in `--model_init_kwargs`
            (TRL refuses both); 4-bit with dtype "auto" (`BitsAndBytesConfig` needs a named compute dtype); a
            `--bnb_4bit_quant_storage` or `--bnb_4bit_quant_type` bitsandbytes does not have.
    """
    four, eight = model_args.load_in_4bit, model_args.load_in_8bit
    if four and eight:
        raise ValueError("--load_in_4bit and --load_in_8bit: choose one (4-bit NF4 is QLoRA's)")
    if not four:
        given = [f"--{name} {value}" for name, value, default in (
            ("bnb_4bit_quant_type", model_args.bnb_4bit_quant_type, "nf4"),
            ("use_bnb_nested_quant", model_args.use_bnb_nested_quant, False),
            ("bnb_4bit_quant_storage", model_args.bnb_4bit_quant_storage, None)) if value != default]
        if given:
            raise ValueError(f"{' and '.join(given)}: 4-bit options without --load_in_4bit, which would ignore them; "
                             "add --load_in_4bit true or drop them")
    if not (four or eight):
        return None
    flag = "--load_in_4bit" if four else "--load_in_8bit"
    if not is_bitsandbytes_available():
        raise ValueError(f"{flag} needs bitsandbytes >= {BITSANDBYTES_MIN_VERSION}, which is not installed: "
                         f"{QLORA_INSTALL}")
    if not model_args.use_peft:
        raise ValueError(f"{flag} with --use_peft false: a quantized base cannot be fully fine-tuned; train LoRA "
                         "adapters on it (--use_peft true) or drop the flag")
    if getattr(model_args, "gguf_file", None):
        raise ValueError(f"{flag} with --gguf_file {model_args.gguf_file}: a GGUF file is already quantized and "
                         "loads dequantized; drop one of the two")
    if "quantization_config" in (training_args.model_init_kwargs or {}):
        raise ValueError(f"{flag} and a quantization_config in --model_init_kwargs: give the quantization in one "
                         "place (the flags)")
    if four:
        dtype = load_dtype(model_args, training_args)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"--load_in_4bit with dtype {dtype!r}: the 4-bit compute dtype is the load dtype and "
                             "must be named; pass --dtype bfloat16 (or float16, float32)")
        if model_args.bnb_4bit_quant_type not in ("nf4", "fp4"):
            raise ValueError(f"--bnb_4bit_quant_type {model_args.bnb_4bit_quant_type}: expected nf4 or fp4")
        storage = model_args.bnb_4bit_quant_storage
        if storage is not None and storage not in QUANT_STORAGE_DTYPES:
            raise ValueError(f"--bnb_4bit_quant_storage {storage}: expected one of {', '.join(QUANT_STORAGE_DTYPES)}")
    return 4 if four else 8


def quantization_config(model_args, training_args) -> BitsAndBytesConfig | None:
    """TRL's `get_quantization_config(model_args)` with the 4-bit compute dtype set to the load dtype
    (`load_dtype`) and, for an L3GPT, `llm_int8_skip_modules = L3GPT_HIGH_PRECISION_MODULES` (the model type is read
    from the config of `model_name_or_path`); None without `--load_in_4bit` / `--load_in_8bit`. The arguments as
    `check_quantization_arguments` accepted them."""
    if not (model_args.load_in_4bit or model_args.load_in_8bit):
        return None
    loaded_as = copy.copy(model_args)  # TRL reads the compute dtype from `dtype`
    loaded_as.dtype = load_dtype(model_args, training_args)
    config = get_quantization_config(loaded_as)
    kwargs = model_init_kwargs(model_args, training_args)
    model_type = AutoConfig.from_pretrained(model_args.model_name_or_path, revision=kwargs.get("revision"),
                                            trust_remote_code=kwargs.get("trust_remote_code", False)).model_type
    if model_type == "l3gpt":
        config.llm_int8_skip_modules = list(L3GPT_HIGH_PRECISION_MODULES)
    return config


def load_base_model(model_args, training_args) -> PreTrainedModel:
    """The base model for LoRA SFT, as TRL's `trl sft` loads it (module docstring): `model_name_or_path` through
    `trl.trainer.utils.create_model_from_path` with `model_init_kwargs(...)`; a `gguf_file` dequantized to dense
    weights (`GgufConfig(dequantize=True)`: the Trainer refuses to train a GGUF quantizer); `--load_in_4bit` /
    `--load_in_8bit` quantized by bitsandbytes (`quantization_config`), on the device this process trains on. Give it
    the arguments as `check_quantization_arguments` accepted them; the adapters are added by `SFTTrainer`.

    Args:
        model_args: a `trl.ModelConfig` (with `gguf_file` where the recipe has it).
        training_args: an `SFTConfig`; its `distributed_state` is set up here if it was not yet (accelerate's state,
            `--use_cpu` respected), as the Trainer would.

    Returns:
        The `PreTrainedModel`; a quantized one has `is_loaded_in_4bit` / `is_loaded_in_8bit` set and
        `bitsandbytes.nn.Linear4bit` / `Linear8bitLt` layers, the 4-bit ones kept off bitsandbytes' CPU repacking
        (module docstring).
    """
    kwargs = model_init_kwargs(model_args, training_args)
    if getattr(model_args, "gguf_file", None):
        kwargs |= dict(gguf_file=model_args.gguf_file, quantization_config=GgufConfig(dequantize=True))
    elif (quantization := quantization_config(model_args, training_args)) is not None:
        kwargs["quantization_config"] = quantization
    state = training_args.distributed_state
    if state.num_processes > 1:  # each process loads its own copy; bitsandbytes places it on the process's device
        kwargs["device_map"] = None
    model = create_model_from_path(model_args.model_name_or_path, architecture=AutoModelForCausalLM, **kwargs)
    for layer in _linear_4bit_layers(model):
        layer.support_avx512bf16_for_cpu = False  # no CPU repacking (module docstring)
    return model


def _linear_4bit_layers(model) -> list:
    """The `bitsandbytes.nn.Linear4bit` layers of a model quantized to 4 bits (none for any other model)."""
    config = bitsandbytes_config(model)
    if config is None or not config.load_in_4bit:
        return []
    import bitsandbytes as bnb  # installed: the model was quantized with it

    return [module for module in model.modules() if isinstance(module, bnb.nn.Linear4bit)]


def _undo_cpu_repacking(model) -> None:
    """Put the weights that bitsandbytes repacked for its CPU kernel (module docstring) back in its own layout: the
    nibbles by bitsandbytes' inverse, the block scales (`absmax`, `(in_features / blocksize, out_features)` in bfloat16
    once repacked) back to `(out_features * in_features / blocksize,)`, as float32 and not nested. The scales stay
    rounded to bfloat16, as the repacked layer computed with them."""
    repacked = [layer.weight for layer in _linear_4bit_layers(model)
                if getattr(layer.weight.quant_state, "packing_format_for_cpu", False)]
    if not repacked:
        return  # releases before the repacking (bitsandbytes PR #1804) have no inverse either
    from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

    for weight in repacked:
        absmax = weight.quant_state.absmax.T.reshape(-1).float()
        weight.data, state = _convert_weight_packed_for_cpu_inverse(weight.data, weight.quant_state)
        state.absmax, state.nested = absmax, False


def bitsandbytes_config(model) -> BitsAndBytesConfig | None:
    """The `BitsAndBytesConfig` a model (or a `PeftModel`'s base) was quantized with; None if it was not."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    config = getattr(getattr(base, "hf_quantizer", None), "quantization_config", None)
    return config if isinstance(config, BitsAndBytesConfig) else None


def quantization_metadata(model) -> dict | None:
    """What metadata.json (`base_model.quantization`) and the model card say of a base quantized by bitsandbytes;
    None for an unquantized base (a dequantized GGUF file included).

    Args:
        model: the model `load_base_model` returned (or a `PeftModel` of it: its adapter layers are not counted).

    Returns:
        A JSON-safe dict: `method` ("bitsandbytes"), `bits` (4 or 8), `quant_type` ("nf4", "fp4" or "llm_int8"),
        `compute_dtype` (4-bit; None for LLM.int8, whose matmuls run in int8 with float16 outliers),
        `nested_quantization` (4-bit: the scales quantized too; None for 8-bit), `storage_dtype` (the packed weights'
        dtype), `dtype` (of the weights left unquantized), `quantized_linear_modules` (count),
        `unquantized_linear_modules` (names of the `nn.Linear`s kept in `dtype`; embeddings and norms are never
        quantized), `memory_footprint_bytes` (`get_memory_footprint()`) and `bitsandbytes_config`: the keyword
        arguments of `BitsAndBytesConfig` that quantize the same base the same way (what differs from its defaults).
    """
    config = bitsandbytes_config(model)
    if config is None:
        return None
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    import bitsandbytes as bnb  # installed: the model was quantized with it

    linear = {name: module for name, module in base.named_modules() if isinstance(module, torch.nn.Linear)
              and not any(part.startswith("lora_") for part in name.split("."))}
    quantized = [name for name, module in linear.items() if isinstance(module, (bnb.nn.Linear4bit,
                                                                                bnb.nn.Linear8bitLt))]
    four = config.load_in_4bit
    return {
        "method": "bitsandbytes",
        "bits": 4 if four else 8,
        "quant_type": config.bnb_4bit_quant_type if four else "llm_int8",
        "compute_dtype": str(config.bnb_4bit_compute_dtype).removeprefix("torch.") if four else None,
        "nested_quantization": config.bnb_4bit_use_double_quant if four else None,
        "storage_dtype": str(config.bnb_4bit_quant_storage).removeprefix("torch.") if four else "int8",
        "dtype": str(base.config.dtype).removeprefix("torch."),
        "quantized_linear_modules": len(quantized),
        "unquantized_linear_modules": sorted(set(linear) - set(quantized)),
        "memory_footprint_bytes": int(base.get_memory_footprint()),
        "bitsandbytes_config": {"load_in_4bit" if four else "load_in_8bit": True} | {
            key: value for key, value in config.to_diff_dict().items()
            if not key.startswith(("_", "load_in_")) and key != "quant_method"},
    }


def merge_adapter(model: PeftModel) -> PreTrainedModel:
    """The base with the active LoRA adapter merged in, as a plain `PreTrainedModel` (in place, like PEFT's
    `merge_and_unload`: the `PeftModel` is used up).

    An unquantized base: PEFT's `merge_and_unload`. A base quantized by bitsandbytes: PEFT's merge would requantize
    each merged weight (4-bit: `Params4bit(W + ΔW)`, rounded to NF4 again, and the adapter's update mostly lost), so
    instead the adapter's weights are kept, the adapter unloaded, the base dequantized (transformers'
    `dequantize`: NF4/int8 weights × their scales, to the 4-bit compute dtype, or to the load dtype for 8-bit; its
    quantization config removed), the adapter put back on the dense base and merged there. The merged model then
    computes what the adapter model computed (the same dequantized weights plus the same update) up to the dtype's
    round-off; for 8-bit, LLM.int8's rounding of the activations is gone from it. 4-bit weights that bitsandbytes
    repacked for its CPU kernel (a base not loaded by `load_base_model`, run in eval mode on a CPU with AVX512-BF16;
    module docstring) are put back in its layout first.

    Raises:
        ValueError: more than one active adapter.
    """
    base = model.get_base_model()
    config = bitsandbytes_config(base)
    if config is None:
        return model.merge_and_unload()
    if len(model.active_adapters) != 1:
        raise ValueError(f"merge_adapter: active adapters {model.active_adapters}; activate the one to merge "
                         "(model.set_adapter(name))")
    adapter_name = model.active_adapters[0]
    peft_config = model.peft_config[adapter_name]
    _undo_cpu_repacking(model)  # first: `state_dict()` runs bitsandbytes' own inverse, which garbles the scales
    adapter_weights = get_peft_model_state_dict(model, adapter_name=adapter_name)
    dtype = config.bnb_4bit_compute_dtype if config.load_in_4bit else base.config.dtype
    base = model.unload()
    base.dequantize(dtype=dtype)
    for name in ("is_loaded_in_4bit", "is_loaded_in_8bit"):  # transformers' dequantize leaves them set
        vars(base).pop(name, None)
    dense = get_peft_model(base, peft_config, adapter_name=adapter_name)
    set_peft_model_state_dict(dense, adapter_weights, adapter_name=adapter_name)
    return dense.merge_and_unload()


def check_model_flags(model_args, training_args) -> None:
    """The SFT flags that act only on some models, checked against the model's config (read, no weight), while the
    arguments are checked: `--router_aux_loss_coef` (TRL weighs a Mixture-of-Experts model's router loss; the config
    must declare `output_router_logits`), and `--lora_target_modules` on a copy of the model built on the meta
    device: a list of names as PEFT matches them (a name, or the end of a dotted name), one value with
    regular-expression syntax as TRL and PEFT take it (matched against whole module names), each module matched of a
    kind LoRA adapts (`torch.nn.Linear`, `Embedding`, `Conv1d/2d/3d`, transformers' `Conv1D`); `all-linear` is
    PEFT's own.

    Raises:
        ValueError: one line naming the flag, its value, the model and what it could be instead.
    """
    from peft.tuners.tuners_utils import check_target_module_exists
    from transformers.integrations import deepspeed as hf_deepspeed
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config
    from transformers.pytorch_utils import Conv1D
    from trl import get_peft_config

    targets, model = model_args.lora_target_modules, model_args.model_name_or_path
    lora = model_args.use_peft and targets not in (None, "all-linear")
    if not (lora or training_args.router_aux_loss_coef):
        return
    trust = training_args.trust_remote_code
    options = {"trust_remote_code": trust, "revision": model_args.model_revision, "gguf_file": model_args.gguf_file}
    # Under ZeRO-3 the DeepSpeed config that accelerate or the arguments set (transformers keeps it behind a weak
    # reference; no public getter returns the object) makes `from_config` partition the model (zero.Init), which a
    # meta-device copy cannot be: the copy is built without it, and the config is set back
    reference = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    zero_config = reference() if reference is not None else None
    if zero_config is not None:
        unset_hf_deepspeed_config()
    try:
        config = AutoConfig.from_pretrained(model, **{k: v for k, v in options.items() if v is not None})
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config, trust_remote_code=trust) if lora else None
    except Exception as error:  # noqa: BLE001 (what transformers raises for a config it cannot build)
        raise ValueError(f"--model_name_or_path {model}: transformers cannot build the model from its config "
                         f"({str(error).splitlines()[0]}); fix its config.json") from None
    finally:
        if zero_config is not None:
            set_hf_deepspeed_config(zero_config)
    if training_args.router_aux_loss_coef and not hasattr(config.get_text_config(), "output_router_logits"):
        raise ValueError(f"--router_aux_loss_coef {training_args.router_aux_loss_coef:g}: {model} is not a "
                         "Mixture-of-Experts model (its config has no output_router_logits), so there is no router "
                         "loss to weigh; leave --router_aux_loss_coef out")
    if not lora:
        return
    peft_config = get_peft_config(model_args)
    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, Conv1D)
    matched = [(name, module) for name, module in meta.named_modules()
               if check_target_module_exists(peft_config, name)]
    shown = targets if isinstance(targets, str) else " ".join(targets)
    how = "a regular expression matched against whole module names (one value, as TRL takes it)" if isinstance(
        targets, str) else "module names, each matching a name or the end of a dotted name"
    if not matched:
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in meta.named_modules()
                         if isinstance(module, torch.nn.Linear)})
        raise ValueError(f"--lora_target_modules {shown}: {how}; matches no module of {model}, whose linear layers "
                         f"are named {', '.join(linear[:12])}; or pass all-linear")
    for name, module in matched:
        if not isinstance(module, kinds):
            raise ValueError(f"--lora_target_modules {shown}: {how}; matches {name}, a {type(module).__name__}, "
                             "which LoRA cannot adapt (it adapts Linear, Embedding and Conv layers)")
