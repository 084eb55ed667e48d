"""The op boundary's codec (`mxattn.op_args`): the custom ops' schemas and the named argument tuples agree
field for field, and encoding a call's mask, lengths, sink and recipe then decoding them gives them back."""

import pytest
import torch

from mxattn import ops
from mxattn.backends.base import Problem
from mxattn.mask import MaskSpec
from mxattn.op_args import SINK_INDEX, BwdArgs, FwdArgs, PackedBwdArgs
from mxattn.recipe import DEFAULT_RECIPE_KEY, Recipe
from mxattn.seqinfo import SeqInfo


def _schema_names(op):
    return [a.name for a in op._schema.arguments]


def test_named_arguments_follow_the_op_schemas():
    assert _schema_names(ops.attention_fwd) == list(FwdArgs._fields)
    assert _schema_names(ops.attention_bwd) == list(BwdArgs._fields)
    assert _schema_names(ops.attention_fwd_packed) == list(FwdArgs._fields)
    assert _schema_names(ops.attention_bwd_packed) == list(PackedBwdArgs._fields)
    assert FwdArgs._fields[SINK_INDEX] == "sink"


MASKS = [MaskSpec(), MaskSpec(causal=True), MaskSpec(causal=True, diagonal_alignment="bottom_right", left_bound=9),
         MaskSpec(left_bound=65, right_bound=16)]


@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("kind", [None, "padded", "packed"])
def test_encode_then_decode_gives_the_call_back(mask, kind):
    q = torch.zeros(1 if kind == "packed" else 2, 4, 96, 64)
    k = torch.zeros(q.shape[0], 2, 80, 64)
    seq = None
    if kind is not None:
        cu_q, cu_kv = torch.tensor([0, 40, 96], dtype=torch.int32), torch.tensor([0, 30, 80], dtype=torch.int32)
        seq = SeqInfo(cu_q, cu_kv, 56, 50, kind == "packed")
    sink = torch.randn(4)
    recipe = Recipe(p_quant="none").encode()
    args = FwdArgs.encode(q, k, k, softmax_scale=0.25, mask=mask, out_dtype=torch.float16, qkv_format="sbhd",
                          backend="reference", seq=seq, sink=sink, recipe=recipe)
    assert args.mask() == mask
    got = args.seq()
    if seq is None:
        assert got is None and (args.max_seqlen_q, args.max_seqlen_kv, args.packed) == (0, 0, False)
    else:
        assert got.cu_seqlens_q is seq.cu_seqlens_q and got.cu_seqlens_kv is seq.cu_seqlens_kv
        assert (got.max_seqlen_q, got.max_seqlen_kv, got.packed) == (56, 50, kind == "packed")
    params = args.params(needs_backward=False, sink_requires_grad=True)
    assert (params.softmax_scale, params.mask, params.out_dtype, params.sink) == (0.25, mask, torch.float16, sink)
    assert params.recipe == Recipe(p_quant="none") and not params.needs_backward and params.sink_requires_grad
    problem = args.problem("learnable", needs_backward=True)
    assert isinstance(problem, Problem)
    # two sequences either way: two batch rows, or two packed into one row
    assert (problem.batch, problem.heads_q, problem.heads_kv, problem.head_dim) == (2, 4, 2, 64)
    packed = kind == "packed"
    assert (problem.seqlen_q, problem.seqlen_kv) == ((56, 50) if packed else (96, 80))
    assert problem.varlen == kind and problem.mask == mask and problem.softmax_type == "learnable"
    assert problem.recipe == recipe and problem.out_dtype == torch.float16 and problem.needs_backward
    # the backward op's arguments carry the forward's options, lengths and sink by name
    b = args.backward_args(q, q, q[..., :1], [], list(k.shape), True)
    assert b.mask() == mask and b.sink is sink and b.sink_requires_grad and b.recipe == recipe
    assert (b.seq() is None) if seq is None else (b.seq().cu_seqlens_kv is seq.cu_seqlens_kv)


def test_template_without_tensors_and_filled_again():
    q = torch.zeros(1, 2, 8, 32)
    args = FwdArgs.encode(None, None, None, softmax_scale=1.0, mask=MaskSpec(), out_dtype=torch.bfloat16,
                          qkv_format="bhsd", backend="reference", seq=None, sink=None)
    assert args.recipe == DEFAULT_RECIPE_KEY
    full = args.with_tensors(q, q, q, None)
    assert full.q is q and full.without_tensors() == args
