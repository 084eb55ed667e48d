"""The pieces the Gluon Hopper dK/dV and dQ kernels share: the bits of their RECIPE constexpr (`recipe_bits`: the
recipe's backward switches), the wgmma accumulator layout, dS as the next GEMM's operand (quantize-dequantized in
blocks of 32, `triton_common.qdq_rows`' arithmetic, or rounded to bf16), the GEMM issue / wait / ring-release steps
and the LSE's conversion to log2 units."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.runtime.jit import constexpr_function

from ..runtime.recipe_flags import KernelRecipe

#: the bits of the backward kernels' RECIPE constexpr (`recipe_bits`): the recipe's backward switches
#: (`recipe_flags.KernelRecipe.bwd`); 0 is the default recipe, whose builds are the kernels' code without switches
P_BF16_BIT = gl.constexpr(1)
DS_BF16_BIT = gl.constexpr(2)
FLOOR_BIT = gl.constexpr(4)
V_RAW_BIT = gl.constexpr(8)


def recipe_bits(flags: KernelRecipe) -> int:
    """The RECIPE constexpr of a recipe's backward switches: P rounded to bf16 (p_quant "none"), dS rounded to bf16
    (ds_quant "bf16"), the OCP scale rule for dS's blocks (scale_rounding "floor"), V a bf16 tensor (v_operand
    "bf16"; the dK/dV kernel reads it as it is)."""
    sw = flags.bwd()
    return ((P_BF16_BIT.value if sw["P_BF16"] else 0) | (DS_BF16_BIT.value if sw["DS_BF16"] else 0)
            | (FLOOR_BIT.value if sw["FLOOR"] else 0) | (V_RAW_BIT.value if sw["V_RAW"] else 0))


LOG2E = 1.4426950408889634
LOG2E_K = gl.constexpr(LOG2E)
#: the consumer warpgroups' indices (their 64 rows of the CTA's tile)
WG0 = gl.constexpr(0)
WG1 = gl.constexpr(1)


# --------------------------------------------------------------------------- element helpers (triton_common's)
@constexpr_function
def _acc_layout(N, warps):
    """The wgmma accumulator layout of an [64, N] fp32 tile of one warpgroup (`warps` warps, m64 nN k16)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, N, 16])


@gluon.jit
def _scale_exponent(abits, FLOOR: gl.constexpr = False):
    """triton_common.scale_exponent_from_bits: bits of amax -> E8M0 biased exponent (int32), the round-up rule, or
    with FLOOR the OCP rule (amax's exponent field minus 8, clamped to [0, 254], NaN 255)."""
    expo = (abits >> 23) & 0xFF
    mant = abits & 0x7FFFFF
    if FLOOR:
        e = gl.minimum(gl.maximum(expo - 8, 0), 254)
        return gl.where((expo == 255) & (mant != 0), 255, e)
    e = gl.minimum(gl.maximum(expo - 8 + (mant > 0x600000).to(gl.int32), 0), 254)
    return gl.where(expo == 255, gl.where(mant != 0, 255, 254), e)


@gluon.jit
def _qdq_cols32(x, BM: gl.constexpr, FLOOR: gl.constexpr = False):
    """triton_common.qdq_rows on the [keys, queries] tile x (fp32, BM queries) with blocks of 32 along the queries
    (axis 1) -> bf16 tile: the int max of |bits| per block, the round-up scale rule, E4M3 (RNE) and back. The
    [R, BM / 32, 32] view is a register relabelling of the wgmma accumulator layout (a quad of threads holds a
    block's 32 columns of a row: two shuffles per max), and so is the conversion of the result to the next
    GEMM's A operand (no shared memory in the SASS of the loop). FLOOR: the OCP scale rule (elements past 448
    saturate, as the Triton kernels' conversion does)."""
    R: gl.constexpr = x.shape[0]
    x3 = gl.reshape(x, [R, BM // 32, 32])
    e = gl.expand_dims(_scale_exponent(gl.max(x3.to(gl.int32, bitcast=True) & 0x7FFFFFFF, axis=2), FLOOR), 2)
    inv = gl.where(e >= 254, 0x400000, (254 - e) << 23).to(gl.float32, bitcast=True)  # 2^(127 - e)
    q = (x3 * inv).to(gl.float8e4nv)
    pw = gl.where(e == 0, 0x400000, e << 23).to(gl.float32, bitcast=True)  # 2^(e - 127)
    return gl.reshape((q.to(gl.float32) * pw).to(gl.bfloat16), [R, BM])


@gluon.jit
def _ds_operand(ds, BM: gl.constexpr, RECIPE: gl.constexpr, layout: gl.constexpr):
    """dS [rows, BM] (fp32) as the next GEMM takes it, bf16 in `layout` (its A operand's): quantize-dequantized in
    blocks of 32 along axis 1 (`_qdq_cols32`, with RECIPE's scale rule), or with RECIPE's DS_BF16 bit rounded to
    bf16 (RNE)."""
    if (RECIPE & DS_BF16_BIT) != 0:
        return gl.convert_layout(ds.to(gl.bfloat16), layout)
    return gl.convert_layout(_qdq_cols32(ds, BM, (RECIPE & FLOOR_BIT) != 0), layout)


# --------------------------------------------------------------------------- GEMM steps
@gluon.jit
def issue_s_dp(a_s, b_s, a_dp, b_dp, s_zero):
    """S = a_s b_s and dP = a_dp b_dp issued as async wgmma (operands in shared memory, fresh fp32 accumulators
    like s_zero) -> (S, dP's token): S waited for, dP still in flight (`warpgroup_mma_wait` it)."""
    s_tok = warpgroup_mma(a_s, b_s, gl.zeros_like(s_zero), use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(a_dp, b_dp, gl.zeros_like(s_zero), use_acc=False, is_async=True)
    return warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, )), dp_tok


@gluon.jit
def release(empty, s):
    """A consumer warpgroup done with ring stage s (every GEMM reading it waited for): its "empty" arrival."""
    gl.thread_barrier()
    mbarrier.arrive(empty.index(s), count=1)


@gluon.jit
def gemm_release(acc, a, b, empty, s):
    """acc + a b (a from registers, b ring stage s's tile in shared memory) issued, waited for, then stage s
    released -> the new acc (the waited kernels' last GEMM of a step, and the deferred one after the last step)."""
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(warpgroup_mma(a, b, acc, is_async=True), ))
    release(empty, s)
    return acc


@gluon.jit
def deferred_tail(t, acc, a, ring, empty, ROWS: gl.constexpr, D: gl.constexpr, NS: gl.constexpr):
    """DEFER, after a consumer's last step (t steps taken): the last step's deferred GEMM, acc + a (its quantized
    dS, registers) times its stage of `ring` ([NS, .., ROWS, D] tiles), then that stage released -> acc."""
    if t > 0:
        sp = (t - 1) % NS
        acc = gemm_release(acc, a, ring.index(sp).reshape([ROWS, D]), empty, sp)
    return acc


@gluon.jit
def _log2_lse(lse):
    """LSE (natural log) -> log2 units for exp2, -inf (a row without keys) read as +inf (its P is 0)."""
    lse = lse * LOG2E_K
    return gl.where(lse == float("-inf"), float("inf"), lse)
