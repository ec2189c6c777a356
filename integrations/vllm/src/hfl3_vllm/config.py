"""The `config.json` of an L3GPT folder as vLLM reads it, without hfl3 or its transformers pin.

The fields and their meanings are hfl3's `L3GPTConfig` (hfl3's `models/l3gpt/configuration_l3gpt.py`, whose docstring
documents each one); this class reads them with the same defaults and the same rule for files written before value
embeddings, smear and backout existed (those features off), derives the per-layer attention types and the short
window the same way, and refuses, with one line naming the field, what the plugin cannot serve.
"""

import math

from transformers import PretrainedConfig

WINDOW_LETTERS = {"S": "sliding_attention", "L": "full_attention"}

# Fields added after L3GPT's first release, with the value a config.json written before them stands for (hfl3's
# `LEGACY_FIELD_VALUES`): an older folder is served with its own architecture.
LEGACY_FIELD_VALUES = {"value_embedding_layers": [], "use_smear_gate": False, "use_backout": False}

# The smear's per-sequence state, listed after the decoder layers (hfl3's transformers cache keeps it as cache layer
# `num_hidden_layers` too). vLLM treats a model as one with state layers ("hybrid") only when `layer_types` names a
# layer that is not full attention (vllm/config/model.py, `ModelConfig.is_hybrid`); "conv" is the short-convolution
# layer type of transformers and vLLM (LFM2), which is what the smear's state is: a width-2 causal convolution state.
SMEAR_LAYER_TYPE = "conv"

# The vLLM model classes (`model.py`): vLLM keeps per-sequence state only for a class declared hybrid and refuses a
# hybrid class without state layers, so a model with the smear is served by its own class. `architectures` in
# hfl3's files is always ARCHITECTURE; this config names the class that fits.
ARCHITECTURE, SMEAR_ARCHITECTURE = "L3GPTForCausalLM", "L3GPTSmearForCausalLM"


class UnservableConfigError(ValueError):
    """A config field (or setting) the plugin cannot serve; the message is one line naming it."""


class L3GPTConfig(PretrainedConfig):
    """L3GPT's `config.json` for serving: hfl3's fields with hfl3's defaults (see the module docstring).

    Derived here as hfl3 derives them: `num_key_value_heads`, `head_dim`, `intermediate_size`, `sliding_window`
    (⌈max_position_embeddings/4/128⌉·128), `value_embedding_layers` (every other layer ending with the last),
    `l3_n_emb`, `l3_d_up`, and `decoder_layer_types` from `window_pattern` (the last layer always full attention).
    `layer_types` is `decoder_layer_types` plus `SMEAR_LAYER_TYPE` when the smear is on, and `architectures` names the
    vLLM class: `SMEAR_ARCHITECTURE` with the smear, else `ARCHITECTURE`.

    `l3_offload` (not in hfl3's files; pass it with `hf_overrides={"l3_offload": True}` or
    `--hf-overrides '{"l3_offload": true}'`): keep the L3 tables in CPU memory and copy only the routed rows to the
    device each step (arXiv 2601.21461, offloading), instead of holding the tables on the device.

    Raises:
        UnservableConfigError: for a field value the plugin cannot serve (the message names the field).
    """

    model_type = "l3gpt"

    def __init__(
        self,
        vocab_size=32768,
        hidden_size=768,
        intermediate_size=None,
        num_hidden_layers=12,
        num_attention_heads=6,
        num_key_value_heads=None,
        head_dim=None,
        max_position_embeddings=2048,
        rope_parameters=None,
        rms_norm_eps=1e-6,
        qk_norm_scale=1.2,
        window_pattern="L",
        sliding_window=None,
        final_logit_softcapping=15.0,
        tie_word_embeddings=False,
        value_embedding_layers=None,
        value_embedding_gate_channels=12,
        use_smear_gate=True,
        smear_gate_channels=24,
        use_backout=True,
        l3_after_layers=None,
        l3_n_emb=None,
        l3_k_max=64,
        l3_d_up=None,
        l3_tie_kv=True,
        l3_mix_input="normed",
        l3_offload=False,
        **kwargs,
    ):
        kwargs.pop("layer_types", None)  # derived from window_pattern, as hfl3 does
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.intermediate_size = intermediate_size or 4 * hidden_size
        self.max_position_embeddings = max_position_embeddings
        self.rope_parameters = rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}
        self.rms_norm_eps = rms_norm_eps
        self.qk_norm_scale = qk_norm_scale
        self.window_pattern = window_pattern
        self.sliding_window = sliding_window or math.ceil(max_position_embeddings / 4 / 128) * 128
        self.final_logit_softcapping = final_logit_softcapping
        if value_embedding_layers is None:
            value_embedding_layers = [i for i in range(num_hidden_layers) if i % 2 == (num_hidden_layers - 1) % 2]
        self.value_embedding_layers = sorted(set(value_embedding_layers))
        self.value_embedding_gate_channels = value_embedding_gate_channels
        self.use_smear_gate = use_smear_gate
        self.smear_gate_channels = smear_gate_channels
        self.use_backout = use_backout
        self.l3_after_layers = sorted(set(l3_after_layers or []))
        self.l3_n_emb = l3_n_emb or 4 * vocab_size
        self.l3_k_max = l3_k_max
        self.l3_d_up = l3_d_up or 4 * hidden_size
        self.l3_tie_kv = l3_tie_kv
        self.l3_mix_input = l3_mix_input
        self.l3_offload = bool(l3_offload)
        self.decoder_layer_types = decoder_layer_types(window_pattern, num_hidden_layers)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        # after transformers' validation, which expects one entry per decoder layer
        self.layer_types = self.decoder_layer_types + ([SMEAR_LAYER_TYPE] if use_smear_gate else [])
        self.architectures = [SMEAR_ARCHITECTURE if use_smear_gate else ARCHITECTURE]
        self.refuse_unservable()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs) -> "L3GPTConfig":
        """A config from a `config.json`'s dict; a field of `LEGACY_FIELD_VALUES` that the file lacks takes its legacy
        value (feature off), as in hfl3's `L3GPTConfig.from_dict`."""
        config_dict = {**{key: value for key, value in LEGACY_FIELD_VALUES.items() if key not in config_dict},
                       **config_dict}
        return super().from_dict(config_dict, **kwargs)

    def refuse_unservable(self) -> None:
        """Raise `UnservableConfigError` naming the first field the plugin cannot serve."""
        parameters = self.rope_parameters
        rope_type = parameters.get("rope_type", parameters.get("type", "default"))
        if rope_type != "default" or "rope_theta" not in parameters:
            raise UnservableConfigError(
                f"rope_parameters={parameters}: the vLLM plugin serves rope_type 'default' with a rope_theta only "
                "(the other RoPE types of hfl3 are not checked against transformers here)"
            )
        factor = parameters.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            raise UnservableConfigError(f"rope_parameters['partial_rotary_factor']={factor}: L3GPT rotates whole "
                                        "heads; remove it")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnservableConfigError(f"num_key_value_heads={self.num_key_value_heads} must divide "
                                        f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            raise UnservableConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        for field in ("value_embedding_layers", "l3_after_layers"):
            outside = [i for i in getattr(self, field) if not 0 <= i < self.num_hidden_layers]
            if outside:
                raise UnservableConfigError(f"{field} contains {outside[0]}, outside 0..{self.num_hidden_layers - 1}")
        for field, used in (("value_embedding_gate_channels", self.value_embedding_layers),
                            ("smear_gate_channels", self.use_smear_gate)):  # fmt: skip
            if used and not 1 <= getattr(self, field) <= self.hidden_size:
                raise UnservableConfigError(f"{field}={getattr(self, field)} must be in 1..hidden_size")
        if self.l3_mix_input not in ("normed", "residual"):
            raise UnservableConfigError(f"l3_mix_input={self.l3_mix_input!r} must be 'normed' or 'residual'")
        if self.sliding_window < 1:
            raise UnservableConfigError(f"sliding_window={self.sliding_window} must be >= 1")


def decoder_layer_types(pattern: str, num_hidden_layers: int) -> list[str]:
    """hfl3's `layer_types_from_pattern`: `pattern` (letters S/L) tiled over the layers, the last layer full.

    Raises:
        UnservableConfigError: on an empty pattern or another letter (field `window_pattern`).
    """
    letters = (pattern or "").upper()
    if not letters or set(letters) - set(WINDOW_LETTERS):
        raise UnservableConfigError(f"window_pattern={pattern!r} must be letters S (sliding window) and L (full)")
    tiled = [letters[i % len(letters)] for i in range(num_hidden_layers)]
    tiled[-1] = "L"
    return [WINDOW_LETTERS[letter] for letter in tiled]
