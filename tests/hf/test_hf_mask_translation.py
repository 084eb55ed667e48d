"""The translation of Hugging Face attention masks into mxattn's arguments (`plan_attention_mask`): HF's own
mask builder's masks give the plan whose band equals them; masks mxattn cannot express are refused."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import mxattn  # noqa: E402
from mxattn.integrations import transformers as mx_hf  # noqa: E402
from hf_models import _hf_mask  # noqa: E402
from hf_models import _quiet, _registered  # noqa: E402,F401  (autouse fixtures: importing turns them on)


@pytest.mark.parametrize("case", [
    # (lengths, q_len, kv_len, window, causal, q_offset, expected word, expected window)
    ((9, 5, 9), 9, 9, None, True, 0, "padding_causal", None),
    ((9, 5, 9), 9, 9, 4, True, 0, "padding_causal", (3, 0)),
    ((9, 9), 9, 9, 4, True, 0, "causal", (3, 0)),
    ((9, 5, 2), 9, 9, None, False, 0, "padding", None),
    ((6, 4), 8, 8, None, True, 0, "padding_causal", None),             # padded to a multiple of 8
    ((6, 4), 8, 8, 3, True, 0, "padding_causal", (2, 0)),
    ((6, 4), 5, 8, None, False, 0, "padding", None),                   # cross-attention over padded keys
    ((12, 12), 1, 12, None, True, 11, "causal_bottom_right", None),     # decode: = every key
    ((12, 12), 1, 12, 5, True, 11, "causal_bottom_right", (4, 0)),
    ((12, 12), 4, 12, None, True, 8, "causal_bottom_right", None),
    ((12, 12), 4, 12, 3, True, 8, "causal_bottom_right", (2, 0)),
    ((6, 4), 6, 16, None, True, 0, "padding_causal", None),             # prefill into a static cache
    ((10, 10), 2, 16, None, True, 8, "padding_causal_bottom_right", None),  # static cache decode
])
def test_plan_reproduces_hf_masks(case):
    lengths, q_len, kv_len, window, causal, q_offset, word, win = case
    mask = _hf_mask(lengths, q_len, kv_len, window, causal, q_offset)
    flags = dict(is_causal=causal, sliding_window=window)               # the module's, as the models pass them
    plan = mx_hf.plan_attention_mask(mask, batch=len(lengths), q_len=q_len, kv_len=kv_len, **flags)
    assert (plan.attn_mask_type, plan.window_size) == (word, win)
    # rebuild the band from mxattn's MaskSpec + lengths and compare with HF's mask (independent of the plan code)
    band, padding = mxattn.mask.resolve_mask(plan.attn_mask_type, plan.window_size, plan.bottom_right_diagonal)
    kv_lens = (plan.cu_seqlens_kv.diff().tolist() if padding else [kv_len] * len(lengths))
    for b, n in enumerate(kv_lens):
        keep = torch.zeros(q_len, kv_len, dtype=torch.bool)
        if n:
            keep[:, :n] = band.keep(q_len, n)
        assert torch.equal(keep, mask[b, 0]), (case, b)
    # an additive version of the same mask gives the same plan
    additive = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    plan2 = mx_hf.plan_attention_mask(additive, batch=len(lengths), q_len=q_len, kv_len=kv_len, **flags)
    assert (plan2.attn_mask_type, plan2.window_size) == (word, win)


def test_plan_refuses_what_it_cannot_express():
    hole = _hf_mask((9, 9), 9, 9).clone()
    hole[1, :, :, 3] = False                                            # a hole in row 1's keys
    with pytest.raises(mx_hf.UnsupportedMaskError, match="not one contiguous range.*causal or sliding-window band"):
        mx_hf.plan_attention_mask(hole, batch=2, q_len=9, kv_len=9)
    strict = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril(-1)         # strictly causal: not a band mxattn has
    strict[..., 0, 0] = True
    with pytest.raises(mx_hf.UnsupportedMaskError):
        mx_hf.plan_attention_mask(strict, batch=1, q_len=6, kv_len=6)
    with pytest.raises(mx_hf.UnsupportedMaskError, match="4-D"):
        mx_hf.plan_attention_mask(torch.ones(2, 9, dtype=torch.bool), batch=2, q_len=9, kv_len=9)
    # packed sequences (block-diagonal causal) whose second document sees one key of the first
    packed = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    packed[..., :5, :5] = torch.ones(5, 5, dtype=torch.bool).tril()
    packed[..., 5:, 5:] = torch.ones(3, 3, dtype=torch.bool).tril()
    plan = mx_hf.plan_attention_mask(packed, batch=1, q_len=8, kv_len=8)     # expressible: two documents
    assert plan.cu_seqlens_q.tolist() == plan.cu_seqlens_kv.tolist() == [0, 5, 8]
    packed[..., 6, 4] = True
    with pytest.raises(mx_hf.UnsupportedMaskError):
        mx_hf.plan_attention_mask(packed, batch=1, q_len=8, kv_len=8)


def test_dense_calls_hand_transformers_tensors_over_as_they_are(monkeypatch):
    """Eagerly, a dense call passes transformers' [B, H, S, D] query, key and value to `mxfp8_attention` as they
    are (qkv_format "bhsd": no transposes, no view nodes in autograd's graph) and returns O as [B, S, H, D]; under
    torch.compile it passes bshd views, the order in which the ops promise O and the gradients dense. Both give
    the same O and gradients."""
    seen = []
    real = mx_hf.mxfp8_attention

    def spy(q, k, v, **kw):
        seen.append((q, k, v, kw["qkv_format"]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(mx_hf, "mxfp8_attention", spy)
    fn = mx_hf.make_attention_function(backend="reference")

    class Module(torch.nn.Module):
        is_causal = True

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 40, 3, 4, 32, generator=g).bfloat16()   # a fused projection, [B, S, 3, H, D]
    do = torch.randn(2, 40, 4, 32, generator=g).bfloat16()
    grads, outs = [], []
    for compiled in (False, True):
        xi = x.clone().requires_grad_()
        q, k, v = (t.transpose(1, 2) for t in xi.unbind(2))    # transformers' [B, H, S, D] views
        call = (lambda *a: fn(Module(), *a, None, scaling=0.2)[0])
        if compiled:
            call = torch.compile(call, fullgraph=True, backend="eager")
        out = call(q, k, v)
        out.backward(do)
        outs.append(out.detach())
        grads.append(xi.grad)
        assert out.shape == (2, 40, 4, 32)
    assert seen[0][3] == "bhsd" and seen[0][0] is not None
    eager_q = seen[0][0]
    assert eager_q.shape == (2, 4, 40, 32) and eager_q.stride() == x[:, :, 0].transpose(1, 2).stride()
    assert [s[3] for s in seen[1:]] and all(s[3] == "bshd" for s in seen[1:])
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
