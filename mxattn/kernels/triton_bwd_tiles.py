"""The backward's tile loads and stores (spec section 7), shared by its prep pass (`triton_bwd_prep`) and its
dK/dV and dQ kernels (`triton_attention_bwd`): an MXFP8 tile, row- or column-wise, dequantized exactly to bf16
(or, in the bf16-scratch data path, its bf16 dequantization loaded as it is), and a gradient tile stored.
"""

import triton
import triton.language as tl

from .triton_common import dequant_cols, dequant_rows, load_tile


@triton.jit
def _row_tile(ptrs, s_ptrs, row_ok, d_ok, kb_ok, MASK: tl.constexpr, EVEN_D: tl.constexpr, R: tl.constexpr,
              DP: tl.constexpr, RAW: tl.constexpr):
    """Row-wise MXFP8 tile [R, DP] at ptrs (unit stride along D) with its scales at s_ptrs ([R, DP/32]) -> bf16,
    rows where row_ok is false (under MASK) and columns past D (unless EVEN_D) as 0.
    RAW: ptrs already hold the bf16 dequantization; load it as is (s_ptrs unread)."""
    x = load_tile(ptrs, row_ok, d_ok, 0.0, MASK, EVEN_D)
    if not RAW:  # (no early return: Triton would still compile the FP8 branch for a bf16 tile)
        s = load_tile(s_ptrs, row_ok, kb_ok, 127, MASK, EVEN_D)
        x = dequant_rows(x, s, R, DP)
    return x


@triton.jit
def _col_tile(ptrs, s_ptrs, row_ok, blk_ok, d_ok, MASK: tl.constexpr, EVEN_D: tl.constexpr, R: tl.constexpr,
              DP: tl.constexpr, RAW: tl.constexpr):
    """Column-wise MXFP8 tile [R, DP] (its first row a multiple of 32) with its scales at s_ptrs ([R/32, DP],
    blk_ok the blocks that exist) -> bf16, as `_row_tile`."""
    x = load_tile(ptrs, row_ok, d_ok, 0.0, MASK, EVEN_D)
    if not RAW:
        s = load_tile(s_ptrs, blk_ok, d_ok, 127, MASK, EVEN_D)
        x = dequant_cols(x, s, R, DP)
    return x


@triton.jit
def _store_rows(X, bt, h, r0, sxb, sxh, sxs, rows, offs_d, n_out, D, x):
    """Gradient tile x (fp32) -> rows `rows` < n_out (relative to the sequence's first row r0) of X (unit stride
    along D), cast to X's dtype."""
    tl.store(X + bt * sxb + h * sxh + r0 * sxs + rows[:, None] * sxs + offs_d[None, :], x.to(X.dtype.element_ty),
             mask=(rows < n_out)[:, None] & (offs_d < D)[None, :])
