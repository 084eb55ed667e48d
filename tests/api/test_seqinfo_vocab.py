"""SeqInfo's per-sequence vocabulary (what the backends and kernel launches read of it) against hand-computed
values, for a padded and a packed batch with empty sequences on either side."""

import torch

from mxattn.seqinfo import (SeqInfo, grid_rows, grid_sequences, kernel_cu_seqlens, kernel_flags, quantizer_args,
                            zero_padding)


def _cu(values):
    return torch.tensor(values, dtype=torch.int32)


# lengths q (3, 0, 2), kv (0, 4, 2): sequence 0 has no keys, sequence 1 no queries
CU_Q, CU_KV = [0, 3, 3, 5], [0, 0, 4, 6]


def _seq(packed):
    return SeqInfo(_cu(CU_Q), _cu(CU_KV), 3, 4, packed)


def _flat(mask):
    return mask.flatten().tolist()


def test_sides_and_kind():
    for packed, kind in ((False, "padded"), (True, "packed")):
        seq = _seq(packed)
        assert seq.kind == kind and seq.batch == 3
        assert seq.cu_seqlens("q") is seq.cu_seqlens_q and seq.cu_seqlens("kv") is seq.cu_seqlens_kv
        assert seq.max_seqlen("q") == 3 and seq.max_seqlen("kv") == 4
        assert (seq.segments("kv") is seq.cu_seqlens_kv) == packed and (seq.segments("q") is None) != packed
        args = quantizer_args(seq, "kv")
        assert args.keys() == {"cu_seqlens", "max_seqlen", "packed"}
        assert args["cu_seqlens"] is seq.cu_seqlens_kv and args["max_seqlen"] == 4 and args["packed"] is packed
    assert quantizer_args(None, "q") == {}


def test_padded_rows():
    seq = _seq(False)
    assert seq.valid_rows("q", 4).shape == (3, 1, 4, 1)
    assert _flat(seq.valid_rows("q", 4)) == [1, 1, 1, 0] + [0] * 4 + [1, 1, 0, 0]
    # rows with a result: real tokens whose other side is not empty
    assert _flat(seq.result_rows("q", 4)) == [0] * 4 + [0] * 4 + [1, 1, 0, 0]
    assert _flat(seq.result_rows("kv", 5)) == [0] * 5 + [0] * 5 + [1, 1, 0, 0, 0]
    t = torch.arange(3 * 2 * 4).view(3, 2, 4, 1)
    assert torch.equal(seq.rows_of(t, 2, CU_Q), t[2:3, :, :2])
    assert seq.rows_of(t, 1, CU_Q).shape == (1, 2, 0, 1)
    assert torch.equal(seq.rows_of(t, 1, CU_KV), t[1:2, :, :4])


def test_packed_rows():
    seq = _seq(True)
    assert seq.valid_rows("q", 6).shape == (1, 1, 6, 1)
    assert _flat(seq.valid_rows("q", 6)) == [1, 1, 1, 1, 1, 0]
    assert _flat(seq.result_rows("q", 6)) == [0, 0, 0, 1, 1, 0]
    assert _flat(seq.result_rows("kv", 7)) == [0, 0, 0, 0, 1, 1, 0]
    t = torch.arange(2 * 6).view(1, 2, 6, 1)
    assert torch.equal(seq.rows_of(t, 2, CU_Q), t[:, :, 3:5])
    assert seq.rows_of(t, 1, CU_Q).shape == (1, 2, 0, 1)
    assert torch.equal(seq.rows_of(t, 1, CU_KV), t[:, :, 0:4])


def test_kernel_launch_facts():
    stand_in = torch.zeros(1)
    for seq, rows_q, rows_kv, n_seq in ((None, 5, 7, 2), (_seq(False), 5, 7, 2), (_seq(True), 3, 4, 3)):
        assert grid_rows(seq, "q", 5) == rows_q and grid_rows(seq, "kv", 7) == rows_kv
        assert grid_sequences(seq, 2) == n_seq
    assert grid_rows(_seq(True), "kv", 2) == 2  # never more than the tensor's rows
    cu_q, cu_kv = kernel_cu_seqlens(None, stand_in)
    assert cu_q is stand_in and cu_kv is stand_in
    seq = _seq(True)
    cu_q, cu_kv = kernel_cu_seqlens(seq, stand_in)
    assert cu_q is seq.cu_seqlens_q and cu_kv is seq.cu_seqlens_kv
    assert kernel_flags(None, True) == dict(VARLEN=False, PACKED=False, BOTTOM_RIGHT=False)
    assert kernel_flags(_seq(False), True) == dict(VARLEN=True, PACKED=False, BOTTOM_RIGHT=True)
    assert kernel_flags(seq) == dict(VARLEN=True, PACKED=True)
    assert all(type(v) is bool for v in kernel_flags(seq, 1).values())


def test_zero_padding_padded_dense_and_packed():
    """`zero_padding`, the one padding rule of every backend: a padded batch's rows past each length of the side
    asked for become 0 (NaN and inf there too) in a new tensor; a dense batch and a packed one come back as they
    are, the pack's rows outside [cu[0], cu[-1]) included (no sequence owns them)."""
    seq = _seq(False)
    for which, n_rows in (("q", 4), ("kv", 5)):
        valid = seq.valid_rows(which, n_rows)
        x = torch.randn(3, 2, n_rows, 4).masked_fill(~valid, float("nan"))
        x[..., 0] = x[..., 0].nan_to_num(posinf=0.0, nan=float("inf"))
        y = zero_padding(x, seq, which)
        assert torch.equal(y, torch.where(valid, x, 0.0))
        assert x[~valid.expand_as(x)].isnan().any()  # x itself untouched
    x = torch.randn(3, 2, 4, 4)
    assert zero_padding(x, None, "q") is x
    # packed: cu_seqlens_q [2, 5, 5, 9] over 12 rows leaves rows 0, 1 and 9..11 outside every sequence
    packed = SeqInfo(_cu([2, 5, 5, 9]), _cu([0, 3, 3, 7]), 4, 4, True)
    x = torch.full((1, 2, 12, 4), float("nan"))
    assert zero_padding(x, packed, "q") is x and zero_padding(x, packed, "kv") is x
    assert zero_padding(x, _seq(True), "q") is x


def test_backends_zero_padding_with_one_rule():
    """The reference, cudnn and triton backends' modules zero padding with `seqinfo.zero_padding` (the cudnn
    backend's own copy used to zero a packed batch's rows outside [cu[0], cu[-1]), the reference's left them)."""
    from mxattn import seqinfo
    from mxattn.backends import recipe_operands, triton_backend
    from mxattn.backends.cudnn import backend as cudnn_backend
    for module in (recipe_operands, cudnn_backend, triton_backend):
        assert module.zero_padding is seqinfo.zero_padding, module.__name__
        assert not hasattr(module, "_zero_padding"), module.__name__
