"""L3GPT configuration: nanochat's GPT in transformers' names, plus Large Lookup Layers (arXiv 2601.21461)."""

import copy
import math

from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

WINDOW_LETTERS = {"S": "sliding_attention", "L": "full_attention"}

# Fields added after L3GPT's first release (nanochat master's value embeddings, smear and backout), with the value that a
# config.json written before them stands for. `L3GPTConfig.from_dict` fills them in when a file lacks them.
LEGACY_FIELD_VALUES = {"value_embedding_layers": [], "use_smear_gate": False, "use_backout": False}


class L3GPTConfig(PreTrainedConfig):
    r"""
    Configuration of an [`L3GPTForCausalLM`]: nanochat's GPT (karpathy/nanochat, nanochat/gpt.py) with optional
    Large Lookup Layers (L3, "L³: Large Lookup Layers", Tseng & De Sa, arXiv 2601.21461).

    Size the model with [`L3GPTConfig.from_depth`] (nanochat's `--depth` dial) or set the fields directly.

    Transformer fields:
        vocab_size (`int`, defaults to 32768): rows of the input embedding and the output head.
        hidden_size (`int`, defaults to 768): width of the residual stream.
        intermediate_size (`int`, *optional*): width of the ReLU² MLP; `None` means `4 * hidden_size`.
        num_hidden_layers (`int`, defaults to 12): decoder layers.
        num_attention_heads (`int`, defaults to 6): query heads.
        num_key_value_heads (`int`, *optional*): key/value heads (grouped-query attention); `None` means
            `num_attention_heads`. Must divide `num_attention_heads`.
        head_dim (`int`, *optional*): width of one head; `None` means `hidden_size // num_attention_heads`.
        max_position_embeddings (`int`, defaults to 2048): longest sequence (tokens) the model is trained for.
        rope_parameters (`dict`, *optional*): rotary embedding parameters in transformers' format;
            default `{"rope_type": "default", "rope_theta": 10000.0}` (nanochat's base). Every `rope_type` of
            transformers' `ROPE_INIT_FUNCTIONS` applies (`"linear"`, `"dynamic"`, `"yarn"`, `"longrope"`, `"llama3"`,
            `"proportional"`), with the keys transformers requires for it; one dict for all layers, whole heads
            rotated (no `partial_rotary_factor`).
        rms_norm_eps (`float`, defaults to 1e-6): epsilon of the parameter-free RMSNorms.
        qk_norm_scale (`float`, defaults to 1.2): factor applied to queries and keys after their RMSNorm (nanochat).
        window_pattern (`str`, defaults to `"L"`): sliding-window pattern tiled over the layers, one letter per layer:
            `S` = sliding window of `sliding_window` tokens, `L` = full causal attention. The last layer is always `L`.
        sliding_window (`int`, *optional*): window (tokens) of `S` layers; `None` means a quarter of
            `max_position_embeddings` rounded up to a multiple of 128 (nanochat).
        layer_types (`list[str]`, *optional*): derived from `window_pattern` (`"sliding_attention"` /
            `"full_attention"` per layer); read by transformers' masks and caches. Do not set it by hand.
        final_logit_softcapping (`float`, *optional*, defaults to 15.0): logits become `c * tanh(logits / c)`
            (in float32). The field name is the one TRL's SFTTrainer reads. `None` disables the cap.
        attention_dropout (`float`, defaults to 0.0): dropout on attention probabilities.
        initializer_range (`float`, defaults to 0.001): std of the output head's normal init (nanochat).
        tie_word_embeddings (`bool`, defaults to `False`): nanochat unties input and output embeddings.
        use_cache (`bool`, defaults to `True`): return a cache (a `DynamicCache` unless one is passed) outside training.

    nanochat master fields (karpathy/nanochat 92d63d4; each measured in its dev/LOG.md; on by default as there, off
    when a `config.json` written before them is loaded, see [`L3GPTConfig.from_dict`]):
        value_embedding_layers (`list[int]`, *optional*): decoder layers whose attention adds a gated value embedding
            to its values (ResFormer-style value residual, arXiv 2410.17897; nanochat e85db6b after 9a88194, gate
            constants from 6ed7d1d): `v ← v + 3·σ(W_g · h[:, :g]) ⊙ E_i[t]`, with `E_i` a `(vocab_size, kv_dim)` table
            of layer i looked up by token id t (`kv_dim = num_key_value_heads * head_dim`), h the attention input
            (the normed residual), `W_g` a `(num_key_value_heads, g)` gate giving one factor per key/value head in
            (0, 3), g = `value_embedding_gate_channels`. Init: tables uniform with std 1/√C (as v_proj), `W_g`
            uniform in [0, 0.02]. `None` means nanochat's `has_ve`: every other layer, ending with the last
            (`i % 2 == (num_hidden_layers - 1) % 2`); `[]` turns value embeddings off. The tables are plain
            `nn.Embedding`s read one row per token (no L3-style pair memory rules needed), lookups that
            `flops_per_token` excludes, but large: at d12, 6 × 32768 × 768 = 151 M parameters, more than the dense
            model's matrices.
        value_embedding_gate_channels (`int`, defaults to 12): g above, the leading channels of h the gate reads.
        use_smear_gate (`bool`, defaults to `True`): "smear" (nanochat a825e63): after the embedding norm, each token
            mixes in the previous token's normed embedding, `x_t ← x_t + λ·σ(w · x_t[:s])·x_{t-1}` with `w` a
            `(1, s)` gate (`smear.gate`, init uniform in [0, 0.02]), λ a learned scalar (`smear.smear_lambda`,
            init 0, so a fresh model does not smear) and s = `smear_gate_channels`. Not applied at a position whose
            `position_ids` is 0 (sequence start, left padding, each packed document's first token), so packed
            documents stay independent as with hfl3's block-causal attention; nanochat, which packs without
            position ids, smears across document boundaries. The result is also the x0 of `x0_lambdas`. Cached
            decoding keeps the previous token's embedding in the cache (a convolution state after the attention
            layers, `hidden_size` values per sequence; dynamic and static caches alike).
        smear_gate_channels (`int`, defaults to 24): s above.
        use_backout (`bool`, defaults to `True`): "backout" (nanochat a825e63): before the final norm subtract
            `backout_lambda` (learned scalar, init 0.2) times the residual stream after layer
            `num_hidden_layers // 2` (after its L3 layer, if any): `h ← h − λ_b · h_mid`.

    Large Lookup Layer fields (paper §3; defaults off):
        l3_after_layers (`list[int]`, *optional*): decoder-layer indices after which an L3 layer is added to the
            residual stream. Empty or `None` means no L3 layer.
        l3_n_emb (`int`, *optional*): total rows of the L3 tables, shared out over the vocabulary by the allocation
            (`allocation.py`); `None` means `4 * vocab_size`. Must be ≥ `vocab_size` (every token owns ≥ 1 row).
        l3_k_max (`int`, defaults to 64): most rows any one token may own (paper's k; 512 at 800M scale).
        l3_d_up (`int`, *optional*): width of the L3 up-projection; `None` means `4 * hidden_size` (paper: 4096).
        l3_tie_kv (`bool`, defaults to `True`): use one table for keys and values (paper: no quality cost, half the
            memory). Table rows have width `hidden_size` in both cases.
        l3_mix_input (`str`, defaults to `"normed"`): the second input of `W_mix`: `"normed"` = Norm(h), the vector
            the lookup scores with; `"residual"` = h itself, as nanochat's L3 fork (PR #559, b7629ef) concatenates
            (its converted checkpoints need it).
    """

    model_type = "l3gpt"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32768
    hidden_size: int = 768
    intermediate_size: int | None = None
    num_hidden_layers: int = 12
    num_attention_heads: int = 6
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rope_parameters: dict | None = None
    rms_norm_eps: float = 1e-6
    qk_norm_scale: float = 1.2
    window_pattern: str = "L"
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = 15.0
    attention_dropout: float = 0.0
    initializer_range: float = 0.001
    tie_word_embeddings: bool = False
    use_cache: bool = True
    value_embedding_layers: list[int] | None = None
    value_embedding_gate_channels: int = 12
    use_smear_gate: bool = True
    smear_gate_channels: int = 24
    use_backout: bool = True
    l3_after_layers: list[int] | None = None
    l3_n_emb: int | None = None
    l3_k_max: int = 64
    l3_d_up: int | None = None
    l3_tie_kv: bool = True
    l3_mix_input: str = "normed"
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; change one of them or set head_dim"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        if self.value_embedding_layers is None:
            last = self.num_hidden_layers - 1
            self.value_embedding_layers = [i for i in range(self.num_hidden_layers) if i % 2 == last % 2]
        self.value_embedding_layers = sorted(set(self.value_embedding_layers))
        self.l3_after_layers = sorted(set(self.l3_after_layers or []))
        if self.l3_n_emb is None:
            self.l3_n_emb = 4 * self.vocab_size
        if self.l3_d_up is None:
            self.l3_d_up = 4 * self.hidden_size
        self.layer_types = layer_types_from_pattern(self.window_pattern, self.num_hidden_layers)
        if self.sliding_window is None:
            self.sliding_window = math.ceil(self.max_position_embeddings / 4 / 128) * 128
        self.validate_l3gpt()
        super().__post_init__(**kwargs)  # standardizes rope_parameters (and reads a legacy `rope_scaling`)
        self.validate_rope_parameters()

    def validate_l3gpt(self):
        """Raise `ValueError` naming the field of an inconsistent configuration."""
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        for field in ("value_embedding_layers", "l3_after_layers"):
            for index in getattr(self, field):
                if not 0 <= index < self.num_hidden_layers:
                    raise ValueError(
                        f"{field} contains {index}, outside 0..{self.num_hidden_layers - 1} "
                        f"(num_hidden_layers={self.num_hidden_layers})"
                    )
        for field, used in (("value_embedding_gate_channels", self.value_embedding_layers),
                            ("smear_gate_channels", self.use_smear_gate)):  # fmt: skip
            channels = getattr(self, field)
            if used and not 1 <= channels <= self.hidden_size:
                raise ValueError(f"{field}={channels} must be in 1..hidden_size={self.hidden_size}")
        if self.l3_mix_input not in ("normed", "residual"):
            raise ValueError(f"l3_mix_input={self.l3_mix_input!r} must be 'normed' or 'residual'")
        if self.l3_k_max < 1:
            raise ValueError(f"l3_k_max={self.l3_k_max} must be >= 1")
        if self.l3_after_layers:
            if self.l3_n_emb < self.vocab_size:
                raise ValueError(
                    f"l3_n_emb={self.l3_n_emb} < vocab_size={self.vocab_size}: every token needs at least one "
                    "L3 embedding"
                )
            if self.l3_n_emb > self.vocab_size * self.l3_k_max:
                raise ValueError(
                    f"l3_n_emb={self.l3_n_emb} > vocab_size * l3_k_max = {self.vocab_size * self.l3_k_max}: "
                    "raise l3_k_max or lower l3_n_emb"
                )
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1")

    def validate_rope_parameters(self):
        """Refuse RoPE settings the rotary embedding cannot apply: an unknown `rope_type` (transformers only warns),
        parameters per layer type, a `partial_rotary_factor` (nanochat rotates whole heads), and what transformers'
        own `validate_rope` refuses (e.g. `"dynamic"` without `"factor"`); `ValueError` naming `rope_parameters`."""
        parameters = self.rope_parameters
        if self.nested_rope_parameter_keys(parameters):
            raise ValueError(
                f"rope_parameters={parameters} gives parameters per layer type; L3GPT applies one rotary embedding to "
                "every layer: give one dict, e.g. {'rope_type': 'default', 'rope_theta': 10000.0}"
            )
        rope_type = parameters.get("rope_type", "default")
        if rope_type not in ("default", *ROPE_INIT_FUNCTIONS):
            raise ValueError(
                f"rope_parameters['rope_type']={rope_type!r} is not a RoPE type of transformers; use one of "
                f"{['default', *ROPE_INIT_FUNCTIONS]}"
            )
        if rope_type != "proportional" and parameters.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                f"rope_parameters['partial_rotary_factor']={parameters['partial_rotary_factor']}: L3GPT rotates whole "
                "heads (as nanochat); remove it or use rope_type 'proportional'"
            )
        try:
            self.validate_rope()
        except (KeyError, ValueError) as error:
            message = error.args[0] if error.args else error
            raise ValueError(f"rope_parameters={parameters}: {message}") from None

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs) -> "L3GPTConfig":
        """Build a config from a `config.json`'s dict (what `from_pretrained` and `AutoConfig` call).

        A field of `LEGACY_FIELD_VALUES` missing from `config_dict` takes the value that describes the architecture
        of files written before the field existed (nanochat master's features off), so an older checkpoint loads
        with its own architecture and gives its own outputs; new configs (`L3GPTConfig(...)`, `from_depth`) get
        the class defaults. Such a field passed as a keyword (`from_pretrained(path, use_smear_gate=True)`) goes
        through `__init__`, so derived fields are resolved and validated as for a new config.
        """
        config_dict = {
            **{key: copy.deepcopy(value) for key, value in LEGACY_FIELD_VALUES.items() if key not in config_dict},
            **config_dict,
            **{key: kwargs.pop(key) for key in LEGACY_FIELD_VALUES if key in kwargs},
        }
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_depth(
        cls,
        depth: int,
        vocab_size: int,
        aspect_ratio: int = 64,
        head_dim: int = 128,
        max_position_embeddings: int = 2048,
        window_pattern: str = "SSSL",
        pad_vocab_to_multiple_of: int = 64,
        **kwargs,
    ) -> "L3GPTConfig":
        """Size a model from one dial, as nanochat's `--depth` does.

        `hidden_size = depth * aspect_ratio` rounded up to a multiple of `head_dim`; `num_attention_heads =
        hidden_size / head_dim`; `num_hidden_layers = depth`; `vocab_size` padded up to a multiple of
        `pad_vocab_to_multiple_of` (nanochat pads to 64 for matmul efficiency; the extra rows are never targets).

        Args:
            depth: number of decoder layers (nanochat d12 ≈ 124M dense parameters at vocab 32768).
            vocab_size: the tokenizer's vocabulary size (before padding).
            aspect_ratio: hidden width per layer of depth.
            head_dim: width of one attention head.
            max_position_embeddings: training context (tokens).
            window_pattern: see the class docstring.
            **kwargs: any other config field (e.g. the `l3_*` fields, `num_key_value_heads`).

        Raises:
            ValueError: if `depth < 1` or a derived field is invalid.
        """
        if depth < 1:
            raise ValueError(f"depth={depth} must be >= 1")
        hidden_size = math.ceil(depth * aspect_ratio / head_dim) * head_dim
        padded_vocab = math.ceil(vocab_size / pad_vocab_to_multiple_of) * pad_vocab_to_multiple_of
        return cls(
            vocab_size=padded_vocab,
            hidden_size=hidden_size,
            num_hidden_layers=depth,
            num_attention_heads=hidden_size // head_dim,
            head_dim=head_dim,
            max_position_embeddings=max_position_embeddings,
            window_pattern=window_pattern,
            **kwargs,
        )


def layer_types_from_pattern(pattern: str, num_hidden_layers: int) -> list[str]:
    """Tile `pattern` (letters S/L) over the layers, forcing the last layer to full attention (nanochat).

    Raises:
        ValueError: on an empty pattern or a letter other than S and L.
    """
    if not pattern:
        raise ValueError("window_pattern must not be empty; use e.g. 'L' (all full) or 'SSSL'")
    unknown = sorted(set(pattern.upper()) - set(WINDOW_LETTERS))
    if unknown:
        raise ValueError(
            f"window_pattern={pattern!r} has unknown letter(s) {unknown}; use S (sliding window) and L (full)"
        )
    letters = [pattern.upper()[i % len(pattern)] for i in range(num_hidden_layers)]
    letters[-1] = "L"
    return [WINDOW_LETTERS[letter] for letter in letters]


def flops_per_token(config: L3GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token of an L3GPT: 6 × matmul parameters + 12·L·H·Q·T_attended (nanochat gpt.py
    `estimate_flops`, after the PaLM paper appendix B). Matmul parameters, as nanochat counts them (every weight of a
    `Linear`): attention and MLP projections, the value-embedding and smear gates, L3 up/mix projections and lm_head;
    token embeddings, value embeddings and the L3 tables are lookups and excluded, and so is elementwise work (the
    gated sums). T_attended is `min(sliding_window, seq_len)` on sliding layers."""
    width, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = config.head_dim
    per_layer = width * head_dim * (2 * heads + 2 * kv_heads) + 2 * width * config.intermediate_size
    l3 = len(config.l3_after_layers) * (width * config.l3_d_up + (config.l3_d_up + width) * width)
    gates = len(config.value_embedding_layers) * config.value_embedding_gate_channels * kv_heads
    gates += config.smear_gate_channels if config.use_smear_gate else 0
    matmul = config.num_hidden_layers * per_layer + l3 + gates + width * config.vocab_size
    attended = sum(
        min(config.sliding_window, seq_len) if kind == "sliding_attention" else seq_len for kind in config.layer_types
    )
    return 6 * matmul + 12 * heads * head_dim * attended


__all__ = ["L3GPTConfig", "flops_per_token"]
