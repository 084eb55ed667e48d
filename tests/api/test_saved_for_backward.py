"""`AttentionBackend.saved_for_backward`: the copies a forward keeps, remade without the attention, must be the
forward's own bytes (context parallelism drops the forward's copies and remakes them for the backward), and a
backward on them must give the forward's gradients."""

import itertools

import pytest
import torch

from mxattn.backends.base import AttentionBackend, AttentionParams
from mxattn.backends.reference import ReferenceBackend
from mxattn.mask import MaskSpec
from mxattn.recipe import Recipe
from mxattn.seqinfo import SeqInfo

RECIPES = {"default": Recipe(), "v_bf16": Recipe(v_operand="bf16"), "lazy16": Recipe(p_quant="lazy16")}


def _batch(layout, device, d=64, hq=4, hkv=2, seed=0):
    """(q, k, v, do, seq) of a dense, padded or packed batch, bf16 [B, H, S, D] views (packed: [1, H, T, D]);
    padding rows hold large values, which the copies must not read."""
    g = torch.Generator().manual_seed(seed)
    lengths = [70, 33, 128]

    def x(h, rows, batch):
        t = (torch.randn(batch, rows, h, d, generator=g) * 3).to(torch.bfloat16).to(device)
        return t.permute(0, 2, 1, 3)  # a bshd tensor's [B, H, S, D] view, as the API hands it over

    if layout == "packed":
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
        seq = SeqInfo(cu, cu, max(lengths), max(lengths), True)
        rows, batch = sum(lengths), 1
    elif layout == "padded":
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
        seq = SeqInfo(cu, cu, max(lengths), max(lengths), False)
        rows, batch = 128, len(lengths)
    else:
        seq, rows, batch = None, 160, 2
    q, k, v, do = x(hq, rows, batch), x(hkv, rows, batch), x(hkv, rows, batch), x(hq, rows, batch)
    if layout == "padded":
        for b, n in enumerate(lengths):
            for t in (q, k, v, do):
                t[b, :, n:] = 1e4
    return q, k, v, do, seq


def _params(seq, recipe, **kw):
    return AttentionParams(softmax_scale=0.125, mask=MaskSpec(causal=True), seq=seq, recipe=recipe, **kw)


def _same_bytes(a, b) -> bool:
    ta, tb = a.tensors(), b.tensors()
    return len(ta) == len(tb) and all(x.dtype == y.dtype and x.shape == y.shape and
                                      torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                                                  y.view(torch.uint8) if y.element_size() == 1 else y)
                                      for x, y in zip(ta, tb))


def _check_backend(backend, layout, recipe_name, device):
    q, k, v, do, seq = _batch(layout, device)
    params = _params(seq, RECIPES[recipe_name])
    o, stats, kept = backend.forward(q, k, v, params)
    remade = backend.saved_for_backward(q, k, v, params)
    assert type(remade) is type(kept)
    assert _same_bytes(remade, kept)
    want = backend.backward(kept, o, stats, do, params)
    got = backend.backward(remade, o, stats, do, params)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
@pytest.mark.parametrize("layout", ["dense", "padded", "packed"])
def test_the_reference_backends_remade_copies_are_the_forwards(layout, recipe_name):
    _check_backend(ReferenceBackend(), layout, recipe_name, "cpu")


def test_the_base_class_remakes_them_through_the_forward():
    q, k, v, _, seq = _batch("padded", "cpu")
    params = _params(seq, Recipe(), needs_backward=False)  # (the copies are asked for all the same)
    backend = ReferenceBackend()
    remade = AttentionBackend.saved_for_backward(backend, q, k, v, params)
    assert _same_bytes(remade, backend.forward(q, k, v, _params(seq, Recipe()))[2])


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", ["default", "v_bf16"])
@pytest.mark.parametrize("layout", ["dense", "padded", "packed"])
def test_the_triton_backends_remade_copies_are_the_forwards(layout, recipe_name):
    from mxattn.backends.triton_backend import TritonBackend
    ok, reason = TritonBackend.availability(torch.device("cuda"))
    if not ok:
        pytest.skip(reason)
    _check_backend(TritonBackend(), layout, recipe_name, "cuda")
