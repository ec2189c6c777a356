"""FP8 training: hfl3's `Float8Linear` (`hfl3.fp8.linear`: dynamic tensorwise/rowwise scaling, layer selection,
`convert_to_float8_training`, `float8_disabled`) and the checks for accelerate's torchao backend (`hfl3.fp8.ao`).

Importing this package does not import torchao; only `ao_recipe_kwargs` does, when that backend is used.
"""

from .ao import ao_recipe_kwargs, check_ao_backend
from .linear import (
    AMAX_EPS,
    DIM_MULTIPLE,
    E4M3,
    E5M2,
    FORMAT_MAX,
    MIN_DIM,
    RECIPES,
    Float8Linear,
    convert_to_float8_training,
    dequantize,
    first_and_last_projections,
    float8_disabled,
    quantize,
    scaled_matmul,
    select_float8_layers,
)

__all__ = [
    "AMAX_EPS",
    "DIM_MULTIPLE",
    "E4M3",
    "E5M2",
    "FORMAT_MAX",
    "MIN_DIM",
    "RECIPES",
    "Float8Linear",
    "ao_recipe_kwargs",
    "check_ao_backend",
    "convert_to_float8_training",
    "dequantize",
    "first_and_last_projections",
    "float8_disabled",
    "quantize",
    "scaled_matmul",
    "select_float8_layers",
]
