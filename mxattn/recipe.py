"""`Recipe`: which numerics an MXFP8 attention call uses (the default is the cuDNN recipe, bit for bit).

A recipe is a frozen, hashable set of choices, each a string field validated on construction (a ValueError or
TypeError naming the field):

=================  ===========================  ==========================================================
field              values (default first)       meaning
=================  ===========================  ==========================================================
``p_quant``        ``"fixed256"``               P = E4M3(P * 256) / 256 in the forward and the backward
                                                (spec sections 6, 7; the cuDNN kernel's recipe)
                   ``"lazy16"``                 forward: E4M3(P * 16) / 16 with a lazy rescale of the running
                                                max (only when a block max exceeds it by more than 4 * ln 2,
                                                so P reaches up to 2^4); backward as ``"fixed256"`` (the cuDNN
                                                frontend's own pure-torch test reference)
                   ``"none"``                   P rounded to bf16 (no FP8), forward and backward
``v_operand``      ``"fp8"``                    V quantized like the other operands (column-wise along S in
                                                the forward, row-wise along D for dP = dO V^T)
                   ``"bf16"``                   V rounded to bf16 and never quantized: P V and dO V^T take it as
                                                it is, so (causal) no output row depends on later tokens
                                                through a block scale shared along S
``ds_quant``       ``"fp8"``                    dS quantized twice (along s_kv for dQ, along s_q for dK)
                   ``"bf16"``                   dS rounded to bf16 for both products
``scale_rounding`` ``"ceil"``                   E8M0 exponent of amax / 448 rounded up (spec section 2)
                   ``"floor"``                  the OCP rule: exponent of amax minus 8 (may saturate the
                                                block max; an opt-in for studies)
``scaling``        ``"mxfp8"``                  one E8M0 scale per block of 32 values (Q, K, V, dO, dS)
                   ``"per_tensor"``             one FP32 scale per tensor (Transformer Engine's current
                                                scaling, the pre-MX baseline): scale = 448 / amax (1 when amax
                                                is 0 or infinite, the FP32 maximum when 448 / amax overflows),
                                                data = E4M3(x * scale), value = data * (1 / scale); elements
                                                stay E4M3. Dense batches only (a scale over a whole padded or
                                                packed batch would couple its sequences)
=================  ===========================  ==========================================================

Fields combine freely except ``scaling="per_tensor"`` with ``scale_rounding="floor"`` (per-tensor scales are
FP32, not powers of two: there is nothing to round). ``Recipe.encode()`` is the recipe as one string, which is
how it crosses the custom ops' boundary (`mxattn.ops`), and ``Recipe.decode`` inverts it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Optional, Tuple

#: allowed values of each field, the default first
CHOICES = {
    "p_quant": ("fixed256", "lazy16", "none"),
    "v_operand": ("fp8", "bf16"),
    "ds_quant": ("fp8", "bf16"),
    "scale_rounding": ("ceil", "floor"),
    "scaling": ("mxfp8", "per_tensor"),
}
_SEPARATOR = ","


@dataclass(frozen=True)
class Recipe:
    """The numerics of an MXFP8 attention call (module docstring); ``Recipe()`` is the default cuDNN recipe.

    Frozen and hashable; every field is a string checked on construction."""

    p_quant: str = "fixed256"
    v_operand: str = "fp8"
    ds_quant: str = "fp8"
    scale_rounding: str = "ceil"
    scaling: str = "mxfp8"

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            allowed = CHOICES[f.name]
            if not isinstance(value, str):
                raise TypeError(f"Recipe.{f.name} must be a str, one of {allowed}, got {type(value).__name__}")
            if value not in allowed:
                raise ValueError(f"Recipe.{f.name} must be one of {allowed}, got {value!r}")
        if self.scaling == "per_tensor" and self.scale_rounding != "ceil":
            raise ValueError(f"Recipe.scale_rounding={self.scale_rounding!r} applies to MXFP8 block scales; "
                             "scaling='per_tensor' uses FP32 scales (leave scale_rounding='ceil')")

    @property
    def is_default(self) -> bool:
        """True for the default (cuDNN) recipe."""
        return self == DEFAULT_RECIPE

    def differences(self) -> str:
        """The fields that differ from the default, as ``name='value'`` pairs ("default" when none do)."""
        diff = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                if getattr(self, f.name) != getattr(DEFAULT_RECIPE, f.name)]
        return ", ".join(diff) if diff else "default"

    def encode(self) -> str:
        """The fields' values in declaration order joined by commas (what the custom ops carry)."""
        return _SEPARATOR.join(getattr(self, f.name) for f in fields(self))

    @staticmethod
    def decode(key: str) -> "Recipe":
        """The inverse of `encode` (cached: the ops decode it on every call)."""
        return _decode(key)


@functools.lru_cache(maxsize=64)
def _decode(key: str) -> Recipe:
    if not isinstance(key, str):
        raise TypeError(f"recipe key must be a str, got {type(key).__name__}")
    parts = key.split(_SEPARATOR)
    names = [f.name for f in fields(Recipe)]
    if len(parts) != len(names):
        raise ValueError(f"recipe key {key!r} must have {len(names)} comma-separated fields ({', '.join(names)})")
    return Recipe(**dict(zip(names, parts)))


DEFAULT_RECIPE = Recipe()
#: the default recipe's encoding (the custom ops' default argument)
DEFAULT_RECIPE_KEY = DEFAULT_RECIPE.encode()


def resolve_recipe(recipe: Optional[Recipe], arg: str = "recipe") -> Recipe:
    """None -> the default recipe; a Recipe as it is; anything else raises a TypeError naming `arg`."""
    if recipe is None:
        return DEFAULT_RECIPE
    if not isinstance(recipe, Recipe):
        raise TypeError(f"{arg} must be an mxattn.Recipe or None, got {type(recipe).__name__}")
    return recipe


def recipe_key(recipe: Optional[Recipe], arg: str = "recipe") -> str:
    """The `Recipe.encode` string of `recipe` (None -> the default's), a TypeError naming `arg` for anything
    else. With None no Recipe object is touched, so the default path traces under torch.compile as a constant
    string (dynamo versions differ in which objects they can wrap)."""
    if recipe is None:
        return DEFAULT_RECIPE_KEY
    return resolve_recipe(recipe, arg).encode()


def check_recipe_varlen(key: str, varlen: Optional[str], arg: str = "recipe") -> None:
    """Raise a ValueError naming `arg` when the recipe encoded as `key` has no meaning for a padded or packed
    batch (varlen "padded" / "packed"; None for a dense one)."""
    if varlen is not None and key != DEFAULT_RECIPE_KEY and Recipe.decode(key).scaling == "per_tensor":
        raise ValueError(f"{arg}: scaling='per_tensor' is a dense-batch baseline; a {varlen} batch would share "
                         "one scale across its sequences (use a dense batch, or scaling='mxfp8')")


def all_variants() -> Tuple[Recipe, ...]:
    """The default and each single-field variant (one field changed from the default), in CHOICES order."""
    out = [DEFAULT_RECIPE]
    for name, values in CHOICES.items():
        for value in values[1:]:
            out.append(Recipe(**{name: value}))
    return tuple(out)


__all__ = ["CHOICES", "DEFAULT_RECIPE", "DEFAULT_RECIPE_KEY", "Recipe", "all_variants", "check_recipe_varlen",
           "recipe_key", "resolve_recipe"]
