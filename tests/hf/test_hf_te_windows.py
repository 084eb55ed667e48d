"""The Hugging Face integration keeps transformers' masks' meaning under Transformer Engine's window semantics
(bidirectional sliding windows of padded and padding-free batches stay where HF puts them: the translation passes
the diagonal it reads off the mask), and warns once when packed documents meet a KV cache (transformers then
builds one causal mask over the row, so the documents attend to each other)."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mxattn.integrations import transformers as mx_hf  # noqa: E402
from hf_models import VOCAB, build, llama  # noqa: E402
from hf_models import _quiet, _registered  # noqa: E402,F401  (autouse fixtures: importing turns them on)
from transformers.masking_utils import sdpa_mask  # noqa: E402

D = 64


def _bidirectional_window_mask(lengths, q_len, kv_len, window):
    """HF's bidirectional sliding-window mask (|q - kv| <= window) over right-padded keys, as its builder makes it."""
    from transformers.masking_utils import sliding_window_bidirectional_mask_function
    pad = torch.arange(kv_len).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return sdpa_mask(batch_size=len(lengths), q_length=q_len, kv_length=kv_len, q_offset=0,
                     mask_function=sliding_window_bidirectional_mask_function(window), attention_mask=pad,
                     allow_is_causal_skip=False, local_size=window)


def _attended(fn, mask, batch, q_len, kv_len, **kw):
    """[B, Sq, Skv] keys each query row attended through the registered attention function (Q = 0, V one-hot per
    key: O[b, i, j] > 0 exactly where row i attended key j)."""
    module = torch.nn.Module()
    module.is_causal = kw.pop("causal", False)
    q = torch.zeros(batch, 1, q_len, D)
    k = torch.randn(batch, 1, kv_len, D)
    v = torch.eye(kv_len, D).view(1, 1, kv_len, D).repeat(batch, 1, 1, 1)
    out, _ = fn(module, q, k, v, mask, scaling=0.125, **kw)
    return out[:, :, 0, :kv_len] > 0


@pytest.mark.parametrize("lengths, window, padded", [((9, 5, 3), 2, 9), ((12, 7), 4, 12), ((12, 4), 6, 12),
                                                     ((12, 12), 3, 12), ((5, 4), 6, 12)])
def test_bidirectional_windows_of_padded_batches_keep_hfs_meaning(lengths, window, padded):
    """A bidirectional sliding window over a right-padded batch: each sequence has as many query rows as the
    batch (`padded`) but fewer keys, so the alignment matters; HF's mask is top-left, and the plan says so
    (bottom_right_diagonal=False) with a window TE takes (the last case's right side never bites: it gets a bound
    no row reaches, as TE has no (left, -1) for these masks). The attended keys equal HF's mask on every row."""
    fn = mx_hf.make_attention_function("reference")
    q_len = kv_len = padded
    mask = _bidirectional_window_mask(lengths, q_len, kv_len, window)
    plan = mx_hf.plan_attention_mask(mask, batch=len(lengths), q_len=q_len, kv_len=kv_len, is_causal=False,
                                     sliding_window=window)
    assert plan.attn_mask_type in ("no_mask", "padding")
    if plan.window_size is not None:
        assert min(plan.window_size) >= 0 and plan.bottom_right_diagonal is False
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)        # a window TE takes as it is: no window warning
        got = _attended(fn, mask, len(lengths), q_len, kv_len)
    assert torch.equal(got, mask[:, 0]), plan


def test_padding_free_bidirectional_windows_follow_flash_attentions_window():
    """A padding-free batch (cu_seq_lens kwargs) of a non-causal module with a sliding window: each document
    attends |i - j| <= sliding_window - 1 within itself, the window transformers hands flash attention."""
    fn = mx_hf.make_attention_function("reference")
    docs = (9, 5, 13)
    cu = torch.tensor([0, 9, 14, 27], dtype=torch.int32)
    got = _attended(fn, None, 1, 27, 27, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=13, max_length_k=13,
                    sliding_window=3)
    want = torch.zeros(27, 27, dtype=torch.bool)
    start = 0
    for n in docs:
        i = torch.arange(n)
        want[start:start + n, start:start + n] = (i.unsqueeze(1) - i.unsqueeze(0)).abs() <= 2
        start += n
    assert torch.equal(got[0], want)


def test_documents_with_bidirectional_windows_in_one_row():
    """Packed documents in one row with a bidirectional window inside each (a block-diagonal mask): each document
    is its own sequence of the packed call, its window aligned bottom-right over its own keys (as many as its
    queries: the same keys as top-left); the attended keys equal the mask."""
    fn = mx_hf.make_attention_function("reference")
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate((9, 5, 13))])
    i = torch.arange(27)
    mask = ((doc.unsqueeze(1) == doc.unsqueeze(0)) & ((i.unsqueeze(1) - i.unsqueeze(0)).abs() <= 2)).view(1, 1, 27, 27)
    plan = mx_hf.plan_attention_mask(mask, batch=1, q_len=27, kv_len=27, is_causal=False, sliding_window=3)
    assert plan.gather is not None and (plan.attn_mask_type, plan.window_size) == ("padding", (2, 2))
    assert torch.equal(_attended(fn, mask, 1, 27, 27, sliding_window=3), mask[:, 0])


def test_packed_documents_with_a_cache_warn_once():
    """Position ids restarting inside a row (DataCollatorWithFlattening without the flash kwargs) while the model
    runs with a KV cache (use_cache defaults to True): transformers builds one causal mask over the row, and the
    integration says once that the documents attend to each other and how to avoid it; use_cache=False (the
    documents are separated) and consecutive positions say nothing."""
    model = build(llama, attn="mxfp8")
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, VOCAB, (1, 14), generator=g)
    packed = torch.cat([torch.arange(9), torch.arange(5)]).unsqueeze(0)
    mx_hf._MIXING_WARNED.clear()

    def warned(**kw):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                model(input_ids=ids, **kw)
        return [str(w.message) for w in caught if "position_ids restart" in str(w.message)]

    assert warned(position_ids=packed, use_cache=False) == []
    assert warned(position_ids=torch.arange(14).unsqueeze(0)) == []
    notes = warned(position_ids=packed)
    assert len(notes) == 1 and "use_cache=False" in notes[0] and "attend to each other" in notes[0]
    assert warned(position_ids=packed) == []                         # once
    mx_hf._MIXING_WARNED.clear()
