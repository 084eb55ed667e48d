"""Triton writes of new tokens into the paged MXFP8 KV cache (`mxattn.MXFP8KVCache.append_batch` on CUDA): one
launch per call in place of a few dozen small torch kernels.

A program takes one block of 32 positions of one sequence, for one KV head (grid: sequences x blocks touched x
KV heads). For the positions of its block that this call adds it

* quantizes K row-wise (blocks of 32 along D, `quantize_rows`) and stores bytes and scales in the block's page;
* gathers V's rows of the block (the sequence's open rows from its tail, then the new tokens) and, when the block
  is full, quantizes it column-wise (`quantize_cols`) into the page's V bytes and its scale row ("sealing");
  when it is the sequence's new open block, stores the new rows in the tail (the cache's dtype) instead.

The bytes are those of `mxattn.quantize_mxfp8` (the same scale rule through the shared device helpers), so the
cache holds what the torch path of `append_batch` writes, byte for byte (tests/kvcache/test_kvcache_gpu.py).

The tail is read by the program of a sequence's first touched block and written by the program of its last; when
they differ and the first reads open rows, the write could overtake the read, so those tails are written by a
second launch (TAIL_PASS) after the first. A decode step (one token per sequence) never needs it.
"""

import torch
import triton
import triton.language as tl

from .triton_common import MX_BLOCK, quantize_cols, quantize_rows
from ..runtime.triton_launch import launch
from .triton_quantize import padded_head_dim


@triton.jit
def _paged_append_kernel(
        META, K, V, PT, KD, KS, VD, VS, VT, SEQ_LENS,
        sk_t, sk_h, sv_t, sv_h, spt, skd_p, skd_h, skd_n, sks_p, sks_h, sks_n,
        svd_p, svd_h, svd_n, svs_p, svs_h, svs_n, svt_s, svt_h, svt_n,
        n_seq, D, PAGE,
        DP: tl.constexpr, TAIL_PASS: tl.constexpr):
    """META int32 [3 * n_seq + 1]: cu (n_seq + 1 offsets into K/V's tokens), slots (n_seq), each sequence's
    length before the call (n_seq). K/V [T, H, D] (unit stride along D); PT the page table; KD/VD E4M3 pages,
    KS/VS their E8M0 scales as uint8; VT the open tails [max_sequences, H, 32, D]; SEQ_LENS int32."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    h = tl.program_id(2)
    t0 = tl.load(META + i)
    n = tl.load(META + i + 1) - t0
    slot = tl.load(META + n_seq + 1 + i).to(tl.int64)
    start = tl.load(META + 2 * n_seq + 1 + i)
    end = start + n
    first_block = start // MX_BLOCK
    last_block = (end - 1) // MX_BLOCK
    b = first_block + j
    open_rows = end % MX_BLOCK                       # rows of the new open block (0: none)
    # the open block's tail rows are written here unless that could overtake the first block's read of the tail
    deferred = (last_block != first_block) & (start % MX_BLOCK != 0)
    if TAIL_PASS:
        run = (n > 0) & (j == 0) & deferred & (open_rows != 0)
        b = last_block
    else:
        run = (n > 0) & (b <= last_block)
    if run:
        r = tl.arange(0, MX_BLOCK)
        pos = b * MX_BLOCK + r
        is_new = (pos >= start) & (pos < end)
        tok = (t0 + pos - start).to(tl.int64)
        offs_d = tl.arange(0, DP)
        d_ok = offs_d < D
        new_ok = is_new[:, None] & d_ok[None, :]
        v_new = tl.load(V + tok[:, None] * sv_t + h * sv_h + offs_d[None, :], mask=new_ok, other=0.0)
        tail = VT + slot * svt_s + h * svt_h + r[:, None] * svt_n + offs_d[None, :]
        is_open = (open_rows != 0) & (b == last_block)
        if TAIL_PASS:
            tl.store(tail, v_new, mask=new_ok)
        else:
            page = tl.load(PT + slot * spt + (b * MX_BLOCK) // PAGE).to(tl.int64)
            row = (b * MX_BLOCK) % PAGE + r
            k = tl.load(K + tok[:, None] * sk_t + h * sk_h + offs_d[None, :], mask=new_ok, other=0.0)
            kq, ke = quantize_rows(k.to(tl.float32), MX_BLOCK, DP)
            tl.store(KD + page * skd_p + h * skd_h + row[:, None] * skd_n + offs_d[None, :], kq, mask=new_ok)
            offs_kb = tl.arange(0, DP // MX_BLOCK)
            tl.store(KS + page * sks_p + h * sks_h + row[:, None] * sks_n + offs_kb[None, :], ke.to(tl.uint8),
                     mask=is_new[:, None] & (offs_kb * MX_BLOCK < D)[None, :])
            if is_open:
                if (deferred == 0) | (b == first_block):
                    tl.store(tail, v_new, mask=new_ok)
            else:  # a full block: seal it
                old_ok = (pos < start)[:, None] & d_ok[None, :]
                v_old = tl.load(tail, mask=old_ok, other=0.0)
                rows = tl.where(old_ok, v_old, v_new).to(tl.float32)
                vq, ve = quantize_cols(rows, MX_BLOCK, DP)
                tl.store(VD + page * svd_p + h * svd_h + row[:, None] * svd_n + offs_d[None, :], vq,
                         mask=(r < MX_BLOCK)[:, None] & d_ok[None, :])
                tl.store(VS + page * svs_p + h * svs_h + ((b * MX_BLOCK) % PAGE // MX_BLOCK) * svs_n
                         + offs_d[None, :], ve.to(tl.uint8), mask=d_ok[None, :])
        if (j == 0) & (h == 0) & (TAIL_PASS == 0):
            tl.store(SEQ_LENS + slot, end)


def paged_append(cache, k: torch.Tensor, v: torch.Tensor, meta: torch.Tensor, n_seq: int, blocks: int,
                 deferred_tails: bool) -> None:
    """Write tokens into `cache` (an `MXFP8KVCache` on CUDA whose page table already maps every position written):
    k, v [T, kv_heads, head_dim] in the cache's dtype with unit stride along D; meta int32 [3 * n_seq + 1] on
    the device (cu, slots, lengths before the call; see the kernel); blocks: the most blocks of 32 positions any
    sequence's new tokens touch; deferred_tails: some sequence's new open block differs from its first touched
    block, which already held open rows (a second launch writes those tails). Updates `cache.seq_lens`."""
    if n_seq == 0 or blocks == 0:
        return
    kd, ks, vd, vs = cache.k_data, cache.k_scale.view(torch.uint8), cache.v_data, cache.v_scale.view(torch.uint8)
    vt, pt = cache.v_tail, cache.page_table
    args = (meta, k, v, pt, kd, ks, vd, vs, vt, cache.seq_lens,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), pt.stride(0),
            kd.stride(0), kd.stride(1), kd.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
            vd.stride(0), vd.stride(1), vd.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
            vt.stride(0), vt.stride(1), vt.stride(2),
            n_seq, cache.head_dim, cache.page_size)
    dp = padded_head_dim(cache.head_dim)
    warps = 4 if dp <= 128 else 8
    launch(_paged_append_kernel, (n_seq, blocks, cache.kv_heads), *args, DP=dp, TAIL_PASS=False, num_warps=warps)
    if deferred_tails:
        launch(_paged_append_kernel, (n_seq, 1, cache.kv_heads), *args, DP=dp, TAIL_PASS=True, num_warps=warps)


__all__ = ["paged_append"]
