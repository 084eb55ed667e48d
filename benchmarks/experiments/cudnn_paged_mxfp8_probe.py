"""Probe (issue 21, cuDNN part): does cuDNN's validation accept an MXFP8 SDPA forward graph that reads K and V
from a paged cache (`paged_attention_k_table` / `paged_attention_v_table`, as its BF16/FP16 SDPA does)?
Deviceless: the graph is built for SM 10.0 and checked by the Python frontend's `validate()`, then lowered to the
C++ frontend and checked by cuDNN's own `validate()`, without a GPU. Prints, per case, both verdicts. (Session 13
ran only the first and read it as cuDNN's acceptance; cuDNN 9.28's C++ validation refuses every paged case.)

The graph: Q [B, Hq, s_q, D] FP8 with row-wise F8_128x4 scales as in mxattn's dense graph; K and V as page pools
[num_pages, Hkv, page_size, D] FP8 with their scales as pools too (K row-wise [num_pages, Hkv, page_size, D/32
padded], V column-wise [num_pages, Hkv, page_size/32 padded, D padded]); block tables int32 [B, 1, max_pages, 1];
per-sequence lengths (padding mask) and the logical maximum KV length. The scale layouts are mxattn's dense ones
(`mxattn.backends.cudnn.config`), so "accepted" means the same recipe on pages.
Usage: python benchmarks/experiments/cudnn_paged_mxfp8_probe.py"""
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import cudnn  # noqa: E402

from mxattn.backends.cudnn.config import col_scale_dims, col_scale_stride, row_major, row_scale_dims  # noqa: E402

E4M3, E8M0, INT32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FP8_E8M0, cudnn.data_type.INT32
F8_128x4 = cudnn.tensor_reordering.F8_128x4


def probe(batch, hq, hkv, d, s_q, page, pages_per_seq, causal, paged_scales=True):
    num_pages = batch * pages_per_seq
    graph = cudnn.pygraph(name="probe", io_data_type=E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=cudnn.Handle(None), sm_version=100)

    def t(name, dims, stride, dtype, scale=False):
        return graph.tensor(name=name, dim=list(dims), stride=list(stride), data_type=dtype,
                            reordering_type=F8_128x4 if scale else None)
    q_dims = (batch, hq, s_q, d)
    q = t("q", q_dims, (s_q * hq * d, d, hq * d, 1), E4M3)  # bshd
    pool = (num_pages, hkv, page, d)
    k = t("k", pool, row_major(pool), E4M3)
    v = t("v", pool, row_major(pool), E4M3)
    sf_q_dims = row_scale_dims(*q_dims)
    sf_k_dims = row_scale_dims(*pool) if paged_scales else row_scale_dims(batch, hkv, page * pages_per_seq, d)
    sf_v_dims = col_scale_dims(*pool) if paged_scales else col_scale_dims(batch, hkv, page * pages_per_seq, d)
    sf_q = t("sf_q", sf_q_dims, row_major(sf_q_dims), E8M0, True)
    sf_k = t("sf_k", sf_k_dims, row_major(sf_k_dims), E8M0, True)
    sf_v = t("sf_v", sf_v_dims, col_scale_stride(sf_v_dims), E8M0, True)
    table_dims = (batch, 1, pages_per_seq, 1)
    table_k = t("table_k", table_dims, row_major(table_dims), INT32)
    table_v = t("table_v", table_dims, row_major(table_dims), INT32)
    lens = (batch, 1, 1, 1)
    seq_q = t("seq_q", lens, (1, 1, 1, 1), INT32)
    seq_kv = t("seq_kv", lens, (1, 1, 1, 1), INT32)
    kw = dict(diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT, diagonal_band_right_bound=0) if causal \
        else {}
    o, stats, amax = graph.sdpa_mxfp8(q=q, k=k, v=v, descale_q=sf_q, descale_k=sf_k, descale_v=sf_v,
                                      attn_scale=d ** -0.5, generate_stats=True, use_padding_mask=True,
                                      seq_len_q=seq_q, seq_len_kv=seq_kv, paged_attention_k_table=table_k,
                                      paged_attention_v_table=table_v,
                                      paged_attention_max_seq_len_kv=page * pages_per_seq, name="sdpa_mxfp8",
                                      **kw)
    o.set_output(True).set_dim(list(q_dims)).set_stride([s_q * hq * d, d, hq * d, 1]).set_data_type(
        cudnn.data_type.BFLOAT16)
    stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    amax.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    try:
        graph.validate()
        graph.build_operation_graph()
    except Exception as exc:  # noqa: BLE001 -- the Python frontend's verdict
        return f"Python frontend: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    try:  # cuDNN's own (C++) validation of the lowered graph, deviceless
        graph._lower_to_cpp().validate()
    except Exception as exc:  # noqa: BLE001 -- cuDNN's verdict
        return f"Python frontend accepts; cuDNN's C++ validation: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return "accepted by both"


def main():
    print(f"cuDNN {cudnn.backend_version()}, frontend {cudnn.__version__}; deviceless, SM 10.0")
    cases = [
        ("decode, page 128, D128, GQA 4:1, causal", dict(batch=4, hq=32, hkv=8, d=128, s_q=1, page=128,
                                                         pages_per_seq=8, causal=True)),
        ("decode, page 256, D128, no mask", dict(batch=4, hq=32, hkv=8, d=128, s_q=1, page=256, pages_per_seq=4,
                                                  causal=False)),
        ("chunk of 64, page 128, D64, causal", dict(batch=2, hq=8, hkv=8, d=64, s_q=64, page=128, pages_per_seq=4,
                                                     causal=True)),
        ("decode, page 64 (under one scale tile), D128", dict(batch=4, hq=32, hkv=8, d=128, s_q=1, page=64,
                                                              pages_per_seq=8, causal=True)),
        ("decode, dense scales beside paged K/V", dict(batch=4, hq=32, hkv=8, d=128, s_q=1, page=128,
                                                      pages_per_seq=8, causal=True, paged_scales=False)),
    ]
    for label, kw in cases:
        print(f"{label:48s} {probe(**kw)}", flush=True)


if __name__ == "__main__":
    main()
