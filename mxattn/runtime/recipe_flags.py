"""A `Recipe` as the Triton kernels' constexpr switches: each variant is a specialisation of the same kernels, and
the default recipe's switches compile to the code the kernels had before variants existed.

=============================  =======================================================================
switch                         recipe field
=============================  =======================================================================
``P_MODE``, ``LOG2_PS``        ``p_quant``: fixed256 (E4M3(P * 2^8)), lazy16 (E4M3(P * 2^4) with a lazy
                               running max, forward only: the backward rounds P as fixed256), none
                               (P rounded to bf16; forward and backward)
``V_RAW``                      ``v_operand="bf16"``: V read as a bf16 tensor, never quantized
``DS_BF16``                    ``ds_quant="bf16"``: dS rounded to bf16 for dQ and dK (backward)
``FLOOR``                      ``scale_rounding="floor"``: the OCP E8M0 rule wherever a kernel quantizes
=============================  =======================================================================

``scaling="per_tensor"`` has no kernel form (one scale per tensor needs a pass over the whole tensor before any
tile is quantized; dS's over the whole [B, H, Sq, Skv] product): `unsupported_reason` says so.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from ..recipe import Recipe

#: P_MODE values (triton_common's P_FIXED256, P_LAZY16, P_BF16)
_P_MODES = {"fixed256": 0, "lazy16": 1, "none": 2}
#: the P_MODE values by name (`KernelRecipe.p_mode`)
P_MODE_FIXED256, P_MODE_LAZY16, P_MODE_BF16 = _P_MODES["fixed256"], _P_MODES["lazy16"], _P_MODES["none"]
#: log2 of P's power-of-two scale in the forward, by p_quant (the bf16 rounding keeps 2^8: exact in bf16)
_LOG2_PS = {"fixed256": 8.0, "lazy16": 4.0, "none": 8.0}


class KernelRecipe(NamedTuple):
    """The kernels' switches of one recipe (module docstring)."""

    p_mode: int = 0
    log2_ps: float = 8.0
    v_raw: bool = False
    ds_bf16: bool = False
    floor: bool = False

    def fwd(self) -> dict:
        """Constexprs of the forward kernel."""
        return dict(P_MODE=self.p_mode, LOG2_PS=self.log2_ps, V_RAW=self.v_raw, FLOOR=self.floor)

    def bwd(self) -> dict:
        """Constexprs of the dK/dV and dQ kernels (the backward rounds P as fixed256 unless p_quant is none)."""
        return dict(P_BF16=self.p_mode == _P_MODES["none"], DS_BF16=self.ds_bf16, V_RAW=self.v_raw,
                    FLOOR=self.floor)


DEFAULT_FLAGS = KernelRecipe()


def unsupported_reason(recipe: Recipe) -> Optional[str]:
    """None when the kernels run `recipe`, else why not (one sentence)."""
    if recipe.scaling == "per_tensor":
        return ("scaling='per_tensor' has no Triton kernel (one scale per tensor needs a pass over the whole "
                "tensor, and over the whole dS product in the backward, before any tile is quantized)")
    return None


def kernel_recipe(recipe: Optional[Recipe]) -> KernelRecipe:
    """The switches of `recipe` (None: the default's); a ValueError where the kernels have none."""
    if recipe is None or recipe.is_default:
        return DEFAULT_FLAGS
    reason = unsupported_reason(recipe)
    if reason is not None:
        raise ValueError(f"recipe: {reason}")
    return KernelRecipe(_P_MODES[recipe.p_quant], _LOG2_PS[recipe.p_quant], recipe.v_operand == "bf16",
                        recipe.ds_quant == "bf16", recipe.scale_rounding == "floor")


__all__ = ["KernelRecipe", "DEFAULT_FLAGS", "kernel_recipe", "unsupported_reason", "P_MODE_FIXED256", "P_MODE_LAZY16",
           "P_MODE_BF16"]
