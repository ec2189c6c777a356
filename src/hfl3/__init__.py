"""hfl3: L3GPT (Large Lookup Layers), Muon and FP8 for the HuggingFace stack.

`import hfl3` registers the `l3gpt` model type with `AutoConfig`, `AutoModel` and `AutoModelForCausalLM`
(idempotent: importing twice, or alongside remote code, is harmless).
"""

import logging

from .fp8.ao import torchao_import_messages_kept


class _KeptRecords(logging.Filter):
    """Keeps a logger's records instead of printing them (`records`), for whoever they concern to log."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


# bitsandbytes, which peft imports, says at import on a CPU with AVX512-BF16 that the `kernels` package for its fused
# 4-bit CPU kernel is missing: one line ahead of every recipe's output, about QLoRA on a CPU alone. Kept; logged where
# a model is loaded in 4 bits on a CPU (`hfl3.trainers.base_model.load_base_model`)
BITSANDBYTES_CPU_MESSAGES = _KeptRecords()
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(BITSANDBYTES_CPU_MESSAGES)

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
