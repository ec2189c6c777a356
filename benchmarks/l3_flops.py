"""FLOPs of the L3 lookups themselves, for the benchmarks that match or report compute (`l3_vs_dense.py` widens its
dense arm to the L3 model's FLOPs; `vs_nanochat.py` reports the L3 arm's MFU). Not part of hfl3: the recipe's MFU
counts matmuls and attention only (`configuration_l3gpt.flops_per_token`, nanochat's `estimate_flops`)."""


def l3_lookup_flops_per_token(config, routed_mean_rows: float) -> float:
    """Training FLOPs per token of the L3 lookups themselves (not in `flops_per_token`, which counts matmuls): per
    L3 layer 2·d̄·C (scores) + 2·d̄·C (weighted sum) forward, ×3 for forward + backward, with d̄ the mean rows routed
    per token (frequent tokens own more rows, so d̄ on real text exceeds `l3_n_emb / vocab_size`) and C =
    hidden_size."""
    return len(config.l3_after_layers) * 3 * 4 * routed_mean_rows * config.hidden_size
