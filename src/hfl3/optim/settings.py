"""MuonAdamW's settings, each declared once here with its default, its meaning and where the default comes from.

- `GroupLearningRates`: the learning rate of every parameter group that `param_groups_by_kind` forms, the one rule
  that scales them (`learning_rates`), and the one rule that derives fine-tuning-scale LRs from an AdamW learning
  rate for a base Muon did not pretrain (`for_fine_tuning`). `PretrainConfig` inherits its fields, so they are also the pretraining
  recipe's `--matrix_lr`, `--embedding_lr`, ... options, and `create_muon_optimizer` takes them as keywords.
- `MuonSettings`: the keys of a `kind="muon"` group of `MuonAdamW` besides `lr` and `weight_decay`. `MuonAdamW`
  fills a group's missing keys from it (`MUON_DEFAULTS`) and hands it to the update: `hfl3.optim.update.muon_update`
  and `muon_direction`, and the sharded step of `hfl3.optim.sharded`.
- `ADAMW_DEFAULTS`: the keys of a `kind="adamw"` group.

"nanochat" is karpathy/nanochat master at 92d63d4 (`scripts/base_train.py`, `nanochat/gpt.py` `setup_optimizer`,
`nanochat/optim.py`) unless a commit is named; where hfl3 differs from it, docs/design.md ("nanochat and L3GPT")
lists the difference.
"""

from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

import torch

from .muon_scaling import MUON_EQ_MODES

# Polar Express coefficients, arXiv 2505.16932 (Amsel, Persson, Musco, Gower), computed for num_iters=5,
# safety_factor=2e-2, cushion=2; the values nanochat (nanochat/optim.py) and modded-nanogpt use.
POLAR_EXPRESS_COEFFICIENTS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# The input is divided by 1.01·‖X‖_F so that every singular value starts below 1 (the paper's safety margin).
POLAR_EXPRESS_NORM_SAFETY = 1.01

ORTHOGONALIZE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


@dataclass
class GroupLearningRates:
    """The learning rate of each `MuonAdamW` parameter group, as nanochat sets them (`setup_optimizer`, tuned on its
    d12 at a total batch of 2^19 tokens).

    `learning_rates` turns them into each group's LR: the field's value, times `s = (hidden_size / 768) ** -0.5` for
    the embedding-like AdamW groups (nanochat: "tuned for 768 dim model"), times `b`, the compute-optimal dial's
    total-batch scale √(B / 2^19) (`hfl3.trainers.pretraining.compute_optimal`; 1 for a run sized by hand), for every group but
    `smear`, which nanochat fixes outside both scales. The fields are absolute LRs: `TrainingArguments.learning_rate`
    is not used by Muon (but to derive fine-tuning LRs, `for_fine_tuning`), and the Trainer's LR schedule multiplies
    every group's LR.
    """

    LR_REFERENCE_HIDDEN_SIZE: ClassVar[int] = 768  # nanochat setup_optimizer: `(model_dim / 768) ** -0.5`
    # nanochat setup_optimizer: resid_lambdas "accumulate in the residual stream", 100x lower LR than the scalars
    RESIDUAL_SCALAR_LR_FACTOR: ClassVar[float] = 0.01
    VALUE_EMBEDDING_LR_FACTOR: ClassVar[float] = 0.5  # nanochat 6ed7d1d: value embeddings at half the embedding LR
    # AdamW's update RMS relative to its LR, which Muon's update is matched to (Moonshot AI, "Muon is Scalable for LLM
    # Training", arXiv 2502.16982, section 2.2: "0.2 · sqrt(max(A, B))" lets Muon run at AdamW's LR and weight decay)
    ADAMW_UPDATE_RMS: ClassVar[float] = 0.2

    matrix_lr: float = field(default=0.02, metadata={
        "help": "--optim muon: LR of the Muon group (2-D weights of every nn.Linear but the output head; nanochat "
                "--matrix-lr)"})
    embedding_lr: float = field(default=0.3, metadata={
        "help": "--optim muon: token embedding LR, × (hidden_size/768)^-0.5 (nanochat --embedding-lr)"})
    unembedding_lr: float = field(default=0.004, metadata={
        "help": "--optim muon: output head (lm_head) LR, × (hidden_size/768)^-0.5 (nanochat setup_optimizer's "
                "default; its base_train passes 0.008)"})
    scalar_lr: float = field(default=0.5, metadata={
        "help": "--optim muon: LR of the 0-/1-D parameters (x0_lambdas, gains, biases; resid_lambdas get 1/100 of "
                "it) (nanochat --scalar-lr)"})
    l3_table_lr: float | None = field(default=None, metadata={
        "help": "--optim muon: L3 table LR, × (hidden_size/768)^-0.5 (None: embedding_lr; the tables are embedding "
                "rows gathered by token id)"})
    value_embedding_lr: float | None = field(default=None, metadata={
        "help": "--optim muon: value-embedding LR, × (hidden_size/768)^-0.5 (None: embedding_lr / 2, nanochat "
                "6ed7d1d)"})
    smear_lr: float = field(default=0.2, metadata={
        "help": "--optim muon: LR of the smear gate, smear_lambda and backout_lambda, never scaled (nanochat "
                "a825e63)"})

    def learning_rates(self, hidden_size: int | None = None, batch_lr_scale: float = 1.0) -> dict[str, float]:
        """The LR of each group name of `param_groups_by_kind`.

        Args:
            hidden_size: for the scale `s` (None: `s` = 1).
            batch_lr_scale: `b`.

        Returns:
            `{group name: lr}` for `matrix`, `embedding`, `l3_table`, `value_embedding`, `unembedding`, `scalar`,
            `residual_scalar`, `smear`.
        """
        embedding = (hidden_size / self.LR_REFERENCE_HIDDEN_SIZE) ** -0.5 if hidden_size else 1.0
        embedding *= batch_lr_scale
        l3_table_lr = self.embedding_lr if self.l3_table_lr is None else self.l3_table_lr
        value_embedding_lr = (self.embedding_lr * self.VALUE_EMBEDDING_LR_FACTOR if self.value_embedding_lr is None
                              else self.value_embedding_lr)
        return {
            "matrix": self.matrix_lr * batch_lr_scale,
            "embedding": self.embedding_lr * embedding,
            "l3_table": l3_table_lr * embedding,
            "value_embedding": value_embedding_lr * embedding,
            "unembedding": self.unembedding_lr * embedding,
            "scalar": self.scalar_lr * batch_lr_scale,
            "residual_scalar": self.scalar_lr * self.RESIDUAL_SCALAR_LR_FACTOR * batch_lr_scale,
            "smear": self.smear_lr,
        }

    @classmethod
    def for_fine_tuning(cls, learning_rate: float, hidden_size: int, **given) -> "GroupLearningRates":
        """Fine-tuning-scale group LRs for a base that Muon did not pretrain, derived from one AdamW learning rate:
        the one rule (docs/design.md, decision 20). nanochat's group LRs (the defaults) are pretraining LRs that its
        chat SFT inherits from a base Muon trained at them; on any other base they wreck the model (SmolLM2-135M:
        eval loss 4.15 → 8.01 in 20 steps).

        - `matrix_lr = ADAMW_UPDATE_RMS · √hidden_size · learning_rate` (0.2 · √576 · 2e-5 = 9.6e-5 at SmolLM2's
          width): Muon's update then has the root-mean-square size of an AdamW update at `learning_rate`, as Moonshot
          AI matched them (arXiv 2502.16982, section 2.2). The orthogonalised update `O` of a (rows, cols) matrix
          has RMS 1/√max(rows, cols) (Muon+ sets ‖O‖_F = √min(rows, cols)) and MuonAdamW steps
          `lr · √max(1, rows/cols) · O`, so the update's RMS is `0.2 · learning_rate` on every matrix with rows ≥
          cols = hidden_size (attention, MLP up) and half that on an MLP down projection (cols = 4 · hidden_size).
        - `embedding_lr`, `unembedding_lr`, `scalar_lr`, `smear_lr` = `learning_rate`: the AdamW groups train as an
          AdamW fine-tuning of every weight would train them (`learning_rates` applies its usual factors: the
          hidden-size scale, 1/100 for residual scalars, 1/2 for value embeddings); `l3_table_lr` and
          `value_embedding_lr` follow `embedding_lr` (None).

        Args:
            learning_rate: the AdamW learning rate (`--learning_rate`), > 0.
            hidden_size: the base's `hidden_size`.
            given: fields set by the user, kept as given.

        Raises:
            TypeError: for a key of `given` that is no field.
        """
        matrix_lr = cls.ADAMW_UPDATE_RMS * hidden_size ** 0.5 * learning_rate
        derived = {"matrix_lr": matrix_lr, "embedding_lr": learning_rate, "unembedding_lr": learning_rate,
                   "scalar_lr": learning_rate, "smear_lr": learning_rate, "l3_table_lr": None,
                   "value_embedding_lr": None}
        return cls(**{**derived, **given})

    @classmethod
    def of(cls, values=None, **changes) -> "GroupLearningRates":
        """The LR fields of `values` (any object with them, e.g. a `PretrainConfig`; None: the defaults) with
        `changes` applied.

        Raises:
            TypeError: for a key of `changes` that is no field.
        """
        given = {} if values is None else {item.name: getattr(values, item.name) for item in fields(cls)}
        return cls(**{**given, **changes})


@dataclass(frozen=True)
class MuonSettings:
    """How a Muon group updates its matrices (the formulas of `hfl3.optim.muon`'s docstring), besides its `lr` and
    `weight_decay`: the keys of a `kind="muon"` group of `MuonAdamW`, and the one argument of `muon_update`,
    `muon_direction` and the sharded step that carries them. Frozen and made of constants, so `torch.compile` bakes it
    into the update's graph (an equal instance is not a recompile).

    Raises:
        ValueError: for an `orthogonalize_dtype` or `muon_eq` outside the values listed.
    """

    momentum: float = field(default=0.95, metadata={
        "help": "momentum after the warm-up (an earlier nanochat base_train's get_muon_momentum; master warms up "
                "to 0.97 over 400 steps)"})
    momentum_warmup_start: float = field(default=0.85, metadata={"help": "momentum at step 0 (nanochat)"})
    momentum_warmup_steps: int = field(default=300, metadata={
        "help": "optimizer steps of the linear momentum warm-up (the earlier nanochat's)"})
    nesterov: bool = field(default=True, metadata={"help": "Nesterov momentum (Keller Jordan's Muon, nanochat)"})
    ns_coefficients: tuple[tuple[float, float, float], ...] = field(default=POLAR_EXPRESS_COEFFICIENTS, metadata={
        "help": "one (a, b, c) per orthogonalisation step: Polar Express, 5 steps (arXiv 2505.16932, nanochat)"})
    ns_norm_safety: float = field(default=POLAR_EXPRESS_NORM_SAFETY, metadata={
        "help": "the update is divided by this × its Frobenius norm first (Polar Express, nanochat)"})
    eps: float = field(default=1e-7, metadata={"help": "lower clamp of that norm (torch.optim.Muon's eps)"})
    orthogonalize_dtype: str = field(default="auto", metadata={
        "help": "dtype of Polar Express: auto (bfloat16 on accelerators as nanochat, float32 on CPU where bf16 "
                "matmuls ran 50-100x slower: dev/LOG.md), bfloat16, float32 or float64"})
    beta2: float | None = field(default=0.95, metadata={
        "help": "NorMuon's second-moment decay (arXiv 2510.05491); None turns NorMuon off (hfl3's value since its "
                "first Muon; nanochat 92d63d4 passes 0.9)"})
    cautious_weight_decay: bool = field(default=True, metadata={
        "help": "decay only where the update and the weight agree in sign (arXiv 2510.12402, nanochat)"})
    muon_eq: str | None = field(default="row", metadata={
        "help": "MuonEq before orthogonalising: row, column or None (arXiv 2603.28254; nanochat 4e014d3: row)"})
    muon_plus: bool = field(default=True, metadata={
        "help": "Muon+ renormalisation after orthogonalising (arXiv 2602.21545; nanochat 4e014d3)"})

    def __post_init__(self):
        if self.orthogonalize_dtype not in (*ORTHOGONALIZE_DTYPES, "auto"):
            raise ValueError(f"MuonAdamW: orthogonalize_dtype={self.orthogonalize_dtype!r}; expected 'auto' or one "
                             f"of {sorted(ORTHOGONALIZE_DTYPES)}")
        if self.muon_eq not in (*MUON_EQ_MODES, None):
            raise ValueError(f"MuonAdamW: muon_eq={self.muon_eq!r}; expected one of {MUON_EQ_MODES} or None")
        # tuples, also when given as lists: the settings are constants of the compiled update's graph
        object.__setattr__(self, "ns_coefficients", tuple(tuple(step) for step in self.ns_coefficients))

    @classmethod
    def from_group(cls, group: dict) -> "MuonSettings":
        """The settings of a `MuonAdamW` param group (a dict holding every key of `MUON_DEFAULTS`)."""
        return cls(**{item.name: group[item.name] for item in fields(cls)})

    def orthogonalize_dtype_on(self, device: torch.device) -> torch.dtype:
        """`orthogonalize_dtype` as a `torch.dtype` for matrices on `device` ("auto": float32 on CPU, else bf16)."""
        if self.orthogonalize_dtype == "auto":
            return torch.float32 if device.type == "cpu" else torch.bfloat16
        return ORTHOGONALIZE_DTYPES[self.orthogonalize_dtype]


# A Muon group's keys and their defaults; `lr` and `weight_decay` are the Trainer's (scheduled, TrainingArguments).
MUON_DEFAULTS = {"lr": GroupLearningRates.matrix_lr, **asdict(MuonSettings()), "weight_decay": 0.0}
# An AdamW group's: torch.optim.AdamW's lr, nanochat's betas and eps (its scalar groups), no weight decay.
ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.8, 0.95), "eps": 1e-10, "weight_decay": 0.0}
