"""hfl3: L3GPT (Large Lookup Layers), Muon and FP8 for the HuggingFace stack.

`import hfl3` registers the `l3gpt` model type with `AutoConfig`, `AutoModel` and `AutoModelForCausalLM`
(idempotent: importing twice, or alongside remote code, is harmless), and keeps two libraries' import-time messages
out of every launch: torchao's (kept, and logged when the AO FP8 backend is used: `hfl3.fp8.ao`) and one line of
bitsandbytes' (dropped: `BITSANDBYTES_KERNELS_HUB_MESSAGE`).
"""

import logging

BITSANDBYTES_KERNELS_HUB_MESSAGE = (
    "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip install "
    "kernels` and the kernels >= 0.11.1")
"""The one message `import hfl3` drops, from the `bitsandbytes.backends.cpu.ops` logger (bitsandbytes 0.50.2,
`backends/cpu/ops.py`). On a CPU with AVX512-BF16, importing bitsandbytes tries to fetch its fused 4-bit inference
kernel from the Hub (`kernels.get_kernel("kernels-community/quantization-bitsandbytes")`) and logs this when that
fails, as it always does for hfl3, which runs offline without the `kernels` package. bitsandbytes is imported at every
recipe start, QLoRA or not (transformers' Trainer imports peft, whose `peft/helpers.py` imports bitsandbytes), and
hfl3's 4-bit layers never use that kernel (`hfl3.trainers.sft.base_model.load_base_model`), so the line only misleads.
Matched on the whole template: the logger's other records, and this one if bitsandbytes rewords it, still show."""


class _DropBitsandbytesKernelsHubMessage(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != BITSANDBYTES_KERNELS_HUB_MESSAGE


def _drop_bitsandbytes_kernels_hub_message() -> None:
    # a filter on the logger itself: the record is dropped before any handler, `recipe_log`'s included, sees it
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if not any(isinstance(item, _DropBitsandbytesKernelsHubMessage) for item in logger.filters):
        logger.addFilter(_DropBitsandbytesKernelsHubMessage())


_drop_bitsandbytes_kernels_hub_message()  # before anything imports bitsandbytes, which logs the message at import

from .fp8.ao import torchao_import_messages_kept

# transformers imports torchao (when installed) with its model code; its import-time warnings are kept for the AO
# FP8 backend instead of printed at every launch (hfl3/fp8/ao.py)
with torchao_import_messages_kept():
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from .models.l3gpt import L3GPTConfig, L3GPTForCausalLM, L3GPTModel

__version__ = "0.1.0"


def _register() -> None:
    # Saved folders carry `auto_map` and the modeling files, so they load with trust_remote_code=True without hfl3.
    L3GPTConfig.register_for_auto_class()
    L3GPTModel.register_for_auto_class("AutoModel")
    L3GPTForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    for auto, cls in ((AutoConfig, L3GPTConfig), (AutoModel, L3GPTModel), (AutoModelForCausalLM, L3GPTForCausalLM)):
        try:
            if auto is AutoConfig:
                auto.register(L3GPTConfig.model_type, cls, exist_ok=True)
            else:
                auto.register(L3GPTConfig, cls, exist_ok=True)
        except ValueError:
            pass  # already registered by an earlier import of this module under another name


_register()

__all__ = ["L3GPTConfig", "L3GPTForCausalLM", "L3GPTModel", "__version__"]
