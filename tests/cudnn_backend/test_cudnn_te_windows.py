"""CPU checks that the cuDNN graphs get Transformer Engine's windows: for every mask type, window and
bottom_right_diagonal, the band `mxfp8_attention` encodes reaches the graph's diagonal_alignment and
diagonal_band_left_bound / right_bound as TE's rules say (`tests/te_oracle.py`: left_bound = left + 1,
right_bound = right, the alignment TE resolves), or the call meets one of cuDNN's own refusals (`known_refusal`)
and `auto` moves on. Graphs are validated deviceless (SM 10.0), as in test_cudnn_graphs.py."""

import warnings

import pytest
import torch

cudnn = pytest.importorskip("cudnn")

from mxattn.attention import encode_call  # noqa: E402
from mxattn.backends.cudnn import graphs as cudnn_graphs  # noqa: E402
from mxattn.backends.cudnn.refusals import known_refusal, problem_config  # noqa: E402
from mxattn.layouts import to_bhsd  # noqa: E402
from te_oracle import TYPES, WINDOWS, te_bottom_right, te_window  # noqa: E402

needs_mxfp8_cudnn = pytest.mark.skipif(cudnn.backend_version() < 92100,
                                       reason=f"cuDNN {cudnn.backend_version()} < 9.21 cannot validate MXFP8 graphs")


def _problem(mask_type, window, diagonal, s_q, s_kv, varlen):
    """The Problem `mxfp8_attention` hands the backends for a [2, S, 2, 128] call (varlen: padded with lengths of
    their own on each side, so each sequence's alignment counts)."""
    q, k = torch.zeros(2, s_q, 2, 128), torch.zeros(2, s_kv, 2, 128)
    lengths = {}
    if varlen:
        lengths = dict(cu_seqlens_q=torch.tensor([0, s_q, 2 * s_q - 64], dtype=torch.int32),
                       cu_seqlens_kv=torch.tensor([0, s_kv - 64, 2 * s_kv - 64], dtype=torch.int32))
    args, _ = encode_call(to_bhsd(q, "bshd"), to_bhsd(k, "bshd"), to_bhsd(k, "bshd"), qkv_format="bshd",
                          attn_mask_type=mask_type, window_size=window, bottom_right_diagonal=diagonal,
                          softmax_scale=None, backend="cudnn", out_dtype=torch.bfloat16, max_seqlen_q=None,
                          max_seqlen_kv=None, softmax_type="vanilla", softmax_offset=None, recipe=None,
                          cu_seqlens_q=lengths.get("cu_seqlens_q"), cu_seqlens_kv=lengths.get("cu_seqlens_kv"))
    return args.problem("vanilla", needs_backward=True)


@needs_mxfp8_cudnn
@pytest.mark.parametrize("mask_type", TYPES)
def test_graphs_carry_te_windows(mask_type):
    """Every window (left, right in -1, 0, 1, 16, and None) and bottom_right_diagonal of `mask_type`, with
    S_q < S_kv, S_q == S_kv and S_q > S_kv (dense), or padded with per-sequence lengths: the forward and backward
    graphs' band is TE's (a band without bounds, and a no_mask window whose every sequence has S_q == S_kv, go
    top-left: the same keys), or cuDNN refuses the band with its reason."""
    built = refused = 0
    varlens = (True,) if mask_type.startswith("padding") else (False,)
    for s_q, s_kv in ((256, 384), (256, 256), (384, 256)):
        for varlen in varlens:
            for window in WINDOWS:
                rule = te_window(mask_type, window)
                if rule is None:
                    continue
                (left, right), _ = rule
                for diagonal in (None, True, False):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", UserWarning)     # (TE's window warnings)
                        problem = _problem(mask_type, window, diagonal, s_q, s_kv, varlen)
                    bottom_right = te_bottom_right(mask_type, diagonal) and (left, right) != (-1, -1)
                    if "causal" not in mask_type and s_q == s_kv and not varlen:
                        bottom_right = False                              # the same band top-left
                    band = problem.mask
                    what = (mask_type, window, diagonal, s_q, s_kv, varlen)
                    assert band.diagonal_alignment == ("bottom_right" if bottom_right else "top_left"), what
                    assert band.left_bound == (None if left == -1 else left + 1), what
                    assert band.right_bound == (None if right == -1 else right), what
                    reason = known_refusal(problem)
                    if reason is not None:
                        assert "cuDNN" in reason and ("s_q" in reason or "multiples of 64" in reason), what
                        refused += 1
                        continue
                    for kind in ("forward", "backward"):
                        build = cudnn_graphs.build_forward_graph if kind == "forward" else \
                            cudnn_graphs.build_backward_graph
                        node = cudnn_graphs.graph_json(build(problem_config(problem, kind)))["nodes"][0]
                        assert node["diagonal_alignment"] == band.diagonal_alignment.upper(), (kind, what)
                        assert (node["left_bound"], node["right_bound"]) == (band.left_bound, band.right_bound)
                    built += 1
    assert built > 0
    if mask_type == "no_mask":       # S_q > S_kv bottom-right windows: cuDNN's own rule refuses them
        assert refused > 0
