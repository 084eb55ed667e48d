"""The Hugging Face integration on padding-free batches (cu_seq_lens kwargs, or packed documents with position ids
restarting per document: each document computed alone) and on gpt-oss's attention sinks (learnable sinks)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import mxattn  # noqa: E402
from mxattn.integrations import transformers as mx_hf  # noqa: E402
from hf_models import NAME, VOCAB, _attention_call, batch, build, gpt_oss, llama, rel_rms  # noqa: E402
from hf_models import _quiet, _registered  # noqa: E402,F401  (autouse fixtures: importing turns them on)


def test_padding_free_batch_equals_each_document_alone():
    """DataCollatorWithFlattening's batch (one row, position ids restarting per document, cu_seq_lens_q/k and
    max_length_q/k kwargs): no document attends to another; each document's logits match its own run."""
    model = build(llama, attn=NAME)
    g = torch.Generator().manual_seed(11)
    docs = [torch.randint(3, VOCAB, (n,), generator=g) for n in (9, 5, 13)]
    ids = torch.cat(docs).unsqueeze(0)
    pos = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    cu = torch.tensor([0, 9, 14, 27], dtype=torch.int32)
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=13,
                       max_length_k=13).logits[0]
        for d, start in zip(docs, cu[:-1].tolist()):
            alone = model(input_ids=d.unsqueeze(0)).logits[0]
            assert rel_rms(logits[start:start + len(d)], alone) < 1e-5
    with pytest.raises(mx_hf.UnsupportedMaskError, match="one row"):
        fn = mx_hf.make_attention_function("reference")
        q = torch.randn(2, 4, 8, 32)
        fn(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=torch.tensor([0, 8], dtype=torch.int32))


def test_packed_documents_from_position_ids_train_as_separate_documents():
    """transformers' padding-free batch without the flash kwargs (position ids restarting per document, no
    cache: training) builds a block-diagonal causal mask; each document is computed alone (logits and the
    embedding gradients of one document are not touched by the others)."""
    model = build(llama, attn=NAME)
    g = torch.Generator().manual_seed(11)
    docs = [torch.randint(3, VOCAB, (n,), generator=g) for n in (9, 5, 13)]
    ids = torch.cat(docs).unsqueeze(0)
    pos = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    start = 0
    for d in docs:
        alone = model(input_ids=d.unsqueeze(0), use_cache=False).logits[0]
        assert rel_rms(logits[start:start + len(d)], alone) < 1e-5
        start += len(d)
    # a block-diagonal mask with a sliding window inside each document, attention level, bit for bit
    doc_id = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])
    qi, kj = torch.arange(27).unsqueeze(1), torch.arange(27).unsqueeze(0)
    mask = ((doc_id.unsqueeze(1) == doc_id.unsqueeze(0)) & (kj <= qi) & (kj > qi - 4)).view(1, 1, 27, 27)
    fn, (q, k, v, _) = _attention_call(mask, 27, 27, window=4)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, mask)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).bfloat16()
    grads = torch.autograd.grad(out, (q, k, v), do)
    start = 0
    for d in docs:
        n = len(d)
        parts = [t[:, :, start:start + n].detach().requires_grad_() for t in (q, k, v)]
        alone = mxattn.mxfp8_attention(*(t.transpose(1, 2) for t in parts), attn_mask_type="causal",
                                       window_size=(3, 0), softmax_scale=0.2, backend="reference")
        assert torch.equal(out[:, start:start + n], alone)
        for g_all, g_alone in zip(grads, torch.autograd.grad(alone, parts, do[:, start:start + n])):
            assert torch.equal(g_all[:, :, start:start + n], g_alone)
        start += n


def test_gpt_oss_sinks_run_as_learnable_sinks():
    """gpt-oss hands its per-head sink logits as s_aux: each attention call equals mxattn's learnable-sink call
    bit for bit, the model stays close to eager attention, and the sinks get gradients."""
    torch.manual_seed(0)
    cfg, cls = gpt_oss()
    cfg._attn_implementation = "eager"
    eager_model = cls(cfg).eval()
    with torch.no_grad():
        for layer in eager_model.model.layers:
            layer.self_attn.sinks.normal_()
    model = cls(cfg).eval()
    model.load_state_dict(eager_model.state_dict())
    model.set_attn_implementation(NAME)
    ids, am = batch(lengths=(12, 12))
    with torch.no_grad():
        expected = eager_model(input_ids=ids).logits
        got = model(input_ids=ids).logits
    assert rel_rms(got, expected) < 5e-2
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    for layer in model.model.layers:                  # sliding-window and full layers
        grad = layer.self_attn.sinks.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    fn = mx_hf.make_attention_function("reference")
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 4, 12, 32, generator=g), torch.randn(2, 2, 12, 32, generator=g), \
        torch.randn(2, 2, 12, 32, generator=g)
    sinks = torch.randn(4, generator=g, dtype=torch.bfloat16).requires_grad_()
    module = torch.nn.Module()
    module.is_causal = True
    out = fn(module, q, k, v, None, scaling=0.2, s_aux=sinks)[0]
    direct = mxattn.mxfp8_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=0.2,
                                    attn_mask_type="causal", softmax_type="learnable",
                                    softmax_offset=sinks.detach().float(), backend="reference")
    assert torch.equal(out, direct)
    out.float().square().sum().backward()
    assert sinks.grad is not None and torch.isfinite(sinks.grad).all() and sinks.grad.abs().sum() > 0
