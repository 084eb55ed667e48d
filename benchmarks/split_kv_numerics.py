"""What splitting the KV range of a decode step does to the recipe's numbers (a CPU study for issue 21's kernel).

The recipe's forward is an online softmax over 128-key blocks in order: each block's P = exp(S - m) is rounded to
E4M3 (P * 256) against m, the running maximum of the rows so far. A flash-decoding kernel splits the keys across
programs and combines the partial results; this emulates three ways on the same MXFP8 Q, K, V (`ref` quantizes
them; fp32 arithmetic, like the kernels):
  sequential     the recipe (one pass, ascending blocks)
  split_local    each split starts its own running max at -inf (what a plain flash-decoding kernel does)
  split_prefix   each split starts from the maximum of S over every earlier split (a first pass over K gives it):
                 every block then sees the sequential pass's running max, so every rounded P is the recipe's,
                 and only the fp32 order of the final sum differs
and reports, for each split variant, its difference from `sequential` (relative RMS, max abs) and the share of
bf16 outputs equal to it, and every variant's relative RMS error against FP64 attention on the unquantized inputs.
Cases: one decode query per head (GQA 32:8, D 128), contexts 1k-32k, 4-64 splits; logits of unit variance
(randn inputs) and peaked ones (Q scaled by 4).
Usage: python benchmarks/split_kv_numerics.py [--quick]
"""
import math
import sys

import torch

from ref import mxfp8_ref as R

BLOCK = 128
P_SCALE = 256.0


def mx(x: torch.Tensor, axis: int) -> torch.Tensor:
    """The exact fp32 value of x's MXFP8 quantization along axis."""
    return R.dequantize(*R.quantize(x, axis=axis), axis=axis)


def _blocks(q, k, v, j, scale):
    s = (q @ k[..., j * BLOCK:(j + 1) * BLOCK, :].transpose(-1, -2)) * scale
    return s, v[..., j * BLOCK:(j + 1) * BLOCK, :]


def partial(q, k, v, blocks, scale, m0):
    """Online softmax over `blocks` (ascending) from running max m0 -> (acc, m, l): the recipe's step."""
    acc = torch.zeros(*q.shape[:-1], v.shape[-1])
    m = m0.clone()
    l_sum = torch.zeros(q.shape[:-1])
    for j in blocks:
        s, vb = _blocks(q, k, v, j, scale)
        m_new = torch.maximum(m, s.amax(-1))
        m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_use)
        p = torch.exp(s - m_use[..., None])
        l_sum = l_sum * alpha + p.sum(-1)
        pq = (p * P_SCALE).clamp(max=448.0).to(torch.float8_e4m3fn).float() / P_SCALE
        acc = acc * alpha[..., None] + pq @ vb
        m = m_new
    return acc, m, l_sum


def combine(parts):
    """O from partial (acc, m, l) of disjoint key ranges."""
    m = torch.stack([p[1] for p in parts]).amax(0)
    acc = sum(p[0] * torch.exp(p[1] - m)[..., None] for p in parts)
    l_sum = sum(p[2] * torch.exp(p[1] - m) for p in parts)
    return acc / l_sum[..., None]


def variants(q, k, v, scale, splits):
    n_blocks = -(-k.shape[-2] // BLOCK)
    per = -(-n_blocks // splits)
    ranges = [r for r in (range(s * per, min((s + 1) * per, n_blocks)) for s in range(splits)) if len(r)]
    ninf = torch.full(q.shape[:-1], float("-inf"))
    seq = combine([partial(q, k, v, range(n_blocks), scale, ninf)])
    local = combine([partial(q, k, v, r, scale, ninf) for r in ranges])
    # first pass: each split's row maximum of S; a split starts from the maximum over the earlier ones
    maxima = [torch.stack([_blocks(q, k, v, j, scale)[0].amax(-1) for j in r]).amax(0) for r in ranges]
    starts, running = [], ninf
    for mx_s in maxima:
        starts.append(running)
        running = torch.maximum(running, mx_s)
    prefix = combine([partial(q, k, v, r, scale, m0) for r, m0 in zip(ranges, starts)])
    return seq, local, prefix


def main():
    quick = "--quick" in sys.argv
    torch.manual_seed(0)
    hq, hkv, d, batch = 32, 8, 128, 2
    contexts = (1024, 4096) if quick else (1024, 4096, 16384, 32768)
    print("decode step, Hq 32 Hkv 8 D 128, batch 2; variant vs sequential: rel RMS / max abs / bf16-equal share; "
          "each vs FP64 attention: rel RMS")
    print(f"{'logits':7s} {'context':>7s} {'splits':>6s} | {'split_local vs seq':>30s} | {'split_prefix vs seq':>30s} "
          f"| FP64 err: seq, local, prefix")
    for peak in (1.0, 4.0):
        for context in contexts:
            q = torch.randn(batch, hkv, hq // hkv, d) * peak    # the GQA group's query heads as rows
            k = torch.randn(batch, hkv, context, d)
            v = torch.randn(batch, hkv, context, d)
            scale = 1.0 / math.sqrt(d)
            exact = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * scale, -1) @ v.double()
            qm, km, vm = mx(q, -1), mx(k, -1), mx(v, -2)    # Q, K row-wise, V column-wise (blocks along S)
            for splits in (4, 16, 64):
                seq, local, prefix = variants(qm, km, vm, scale, splits)

                def cmp(x):
                    diff = (x - seq).abs()
                    equal = (x.bfloat16() == seq.bfloat16()).float().mean().item()
                    return f"{(diff.norm() / seq.norm()).item():9.2e} {diff.max().item():9.2e} {equal:6.3f}"

                def err(x):
                    return f"{((x.double() - exact).norm() / exact.norm()).item():.3e}"
                print(f"{'x' + str(peak):7s} {context:7d} {splits:6d} | {cmp(local):>30s} | {cmp(prefix):>30s} | "
                      f"{err(seq)}, {err(local)}, {err(prefix)}", flush=True)


if __name__ == "__main__":
    main()
