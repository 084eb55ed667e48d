"""Hugging Face transformers integration (`mxattn.integrations.transformers`): tiny models built locally on CPU.

Every model runs with attn_implementation="mxfp8" against "eager" on the same weights; each attention call is
also checked bit for bit against an `mxfp8_attention` call made here on the same q/k/v, and at MXFP8 level
against torch SDPA with HF's own mask.
"""

import os
import subprocess
import sys
import warnings

import pytest
from repo_paths import ROOT
import torch

transformers = pytest.importorskip("transformers")

import mxattn  # noqa: E402
from mxattn.integrations import hf_masks  # noqa: E402
from mxattn.integrations import transformers as mx_hf  # noqa: E402
from transformers import (  # noqa: E402
    AttentionInterface, AutoModelForCausalLM, BertConfig, BertModel, DynamicCache, LlamaConfig, LlamaForCausalLM,
    MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
)
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

NAME = "mxfp8"
CAPTURE = "mxfp8_capture"
VOCAB = 96
LENGTHS = (20, 13, 6)          # right-padded batch: the longest is unpadded, one is shorter than the window
CALLS = []                     # what the capturing attention function saw


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # "backend='auto' chose 'reference' on cpu"
        yield


@pytest.fixture(scope="module", autouse=True)
def _registered():
    mx_hf.register(NAME, backend="reference")
    calls = CALLS
    inner = mx_hf.make_attention_function("reference")

    def capture(module, query, key, value, attention_mask, *args, **kwargs):
        out, weights = inner(module, query, key, value, attention_mask, *args, **kwargs)
        calls.append(dict(module=module, q=query.detach().clone(), k=key.detach().clone(),
                          v=value.detach().clone(), mask=attention_mask, out=out.detach().clone(),
                          scaling=kwargs.get("scaling"), sliding_window=kwargs.get("sliding_window")))
        return out, weights

    AttentionInterface.register(CAPTURE, capture)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)
    yield
    mx_hf.unregister(NAME)
    mx_hf.unregister(CAPTURE)


def _calls():
    CALLS.clear()
    return CALLS


def rel_rms(a, b):
    return (a.double() - b.double()).pow(2).mean().sqrt().item() / b.double().pow(2).mean().sqrt().item()


def batch(lengths=LENGTHS, seed=0, pad_id=0):
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), s), generator=g)
    am = (torch.arange(s).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    return ids.masked_fill(am == 0, pad_id), am


def llama(**kw):
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw)
    return cfg, LlamaForCausalLM


def qwen2_mixed():
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                      use_sliding_window=True, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"])
    return cfg, Qwen2ForCausalLM


def mistral_sliding():
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, sliding_window=8)
    return cfg, MistralForCausalLM


def bert():
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=64, attention_probs_dropout_prob=0.0,
                     hidden_dropout_prob=0.0)
    return cfg, BertModel


def build(factory, attn="eager", seed=0):
    cfg, cls = factory()
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return cls(cfg).eval()


def main_output(out):
    return out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state


MODELS = {"bert": bert, "llama_gqa": llama, "qwen2_sliding_full": qwen2_mixed, "mistral_sliding": mistral_sliding}


# --------------------------------------------------------------------------- whole models


@pytest.mark.parametrize("arch", list(MODELS))
def test_model_matches_eager_on_valid_tokens(arch):
    model = build(MODELS[arch])
    ids, am = batch()
    valid = am.bool()
    with torch.no_grad():
        ref = main_output(model(input_ids=ids, attention_mask=am))
        model.set_attn_implementation(NAME)
        assert model.config._attn_implementation == NAME
        out = main_output(model(input_ids=ids, attention_mask=am))
    assert out.dtype == ref.dtype == torch.float32
    err = rel_rms(out[valid], ref[valid])
    print(f"{arch}: rel-RMS vs eager on valid tokens {err:.3e}")
    assert 0 < err < 0.1
    if out.shape[-1] == VOCAB:
        agree = (out[valid].argmax(-1) == ref[valid].argmax(-1)).float().mean().item()
        assert agree > 0.9


@pytest.mark.parametrize("arch", list(MODELS))
def test_each_layer_exact_vs_own_mxattn_call_and_close_to_sdpa(arch):
    """Per attention call: bit-identical to mxfp8_attention with the mask words this test derives from the
    lengths itself; MXFP8-close to torch SDPA with HF's own mask on rows of real tokens."""
    model = build(MODELS[arch], attn=CAPTURE)
    ids, am = batch()
    lengths = am.sum(1)
    calls = _calls()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=am)
    assert len(calls) == 2
    cu_kv = torch.zeros(len(LENGTHS) + 1, dtype=torch.int32)
    cu_kv[1:] = lengths.cumsum(0)
    s = ids.shape[1]
    cu_q = torch.arange(len(LENGTHS) + 1, dtype=torch.int32) * s
    causal = arch != "bert"
    words = []
    for c in calls:
        window = None
        if c["sliding_window"] is not None and c["sliding_window"] < s:
            window = (c["sliding_window"] - 1, 0)
        word = "padding_causal" if causal else "padding"
        words.append((word, window))
        mine = mxattn.mxfp8_attention(c["q"].transpose(1, 2), c["k"].transpose(1, 2), c["v"].transpose(1, 2),
                                      qkv_format="bshd", attn_mask_type=word, window_size=window,
                                      softmax_scale=c["scaling"], backend="reference", cu_seqlens_q=cu_q,
                                      cu_seqlens_kv=cu_kv)
        assert torch.equal(c["out"], mine), (arch, word, window)
        # MXFP8 level against SDPA on HF's mask (GQA expanded), rows of real tokens
        mask = c["mask"]
        rep = c["q"].shape[1] // c["k"].shape[1]
        ref = torch.nn.functional.scaled_dot_product_attention(
            c["q"], c["k"].repeat_interleave(rep, 1), c["v"].repeat_interleave(rep, 1), attn_mask=mask,
            scale=c["scaling"]).transpose(1, 2)
        err = rel_rms(c["out"][am.bool()], ref[am.bool()])
        print(f"{arch} layer {len(words) - 1} ({word}, window {window}): attention output rel-RMS vs SDPA "
              f"{err:.3e}")
        assert err < 0.08, (arch, err)
    if arch == "qwen2_sliding_full":
        assert [w for _, w in words] == [(7, 0), None]
    if arch == "mistral_sliding":
        assert [w for _, w in words] == [(7, 0), (7, 0)]


def test_padding_tokens_do_not_change_valid_outputs_bitwise():
    for factory in (llama, bert):
        model = build(factory, attn=NAME)
        ids, am = batch(pad_id=0)
        ids2, _ = batch(pad_id=7)
        ids2[am == 0] = torch.randint(3, VOCAB, ((am == 0).sum().item(),))
        with torch.no_grad():
            a = main_output(model(input_ids=ids, attention_mask=am))
            b = main_output(model(input_ids=ids2, attention_mask=am))
        valid = am.bool()
        assert not torch.equal(a, b)                     # the padding rows did change
        assert torch.equal(a[valid], b[valid])


def test_unpadded_batch_uses_no_mask_tensor():
    """Without padding HF's mask builder returns None; the plan is plain causal / no_mask."""
    model = build(qwen2_mixed, attn=CAPTURE)
    ids, am = batch(lengths=(20, 20))
    calls = _calls()
    with torch.no_grad():
        out = main_output(model(input_ids=ids, attention_mask=am))
        model.set_attn_implementation("eager")
        ref = main_output(model(input_ids=ids, attention_mask=am))
    assert calls[1]["mask"] is None                     # full-attention layer: SDPA-style is_causal
    assert calls[0]["mask"] is not None                 # sliding layer: the window bites at 20 > 8
    assert rel_rms(out, ref) < 0.1


def test_backward_runs_with_finite_grads():
    model = build(llama, attn=NAME).train()
    ids, am = batch(lengths=(16, 11))
    labels = ids.masked_fill(am == 0, -100)
    loss = model(input_ids=ids, attention_mask=am, labels=labels).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum().item() for g in grads) > 0
    # close to eager's gradients at MXFP8 level
    ref = build(llama, attn="eager").train()
    ref.model.layers[0].self_attn.q_proj.weight.grad = None
    ref(input_ids=ids, attention_mask=am, labels=labels).loss.backward()
    w, w_ref = model.model.layers[0].self_attn.q_proj.weight.grad, ref.model.layers[0].self_attn.q_proj.weight.grad
    assert rel_rms(w, w_ref) < 0.2


def test_decode_with_kv_cache_bottom_right():
    """Prefill, then a 3-token chunk and a 1-token step against a DynamicCache: bottom-right alignment."""
    logits = {}
    for attn in ("eager", NAME):
        model = build(llama, attn=attn)
        ids, _ = batch(lengths=(14, 14), seed=3)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            out = [model(input_ids=ids[:, :10], past_key_values=cache, use_cache=True).logits]
            out.append(model(input_ids=ids[:, 10:13], past_key_values=cache, use_cache=True).logits)
            out.append(model(input_ids=ids[:, 13:14], past_key_values=cache, use_cache=True).logits)
        logits[attn] = torch.cat(out, dim=1)
    assert rel_rms(logits[NAME], logits["eager"]) < 0.1
    plan = mx_hf.plan_attention_mask(torch.ones(2, 1, 3, 13, dtype=torch.bool).tril(10), batch=2, q_len=3,
                                     kv_len=13)
    assert plan.attn_mask_type == "causal_bottom_right" and plan.cu_seqlens_kv is None


def test_sliding_window_decode_and_generate():
    """Mistral (window 8): prefill 12, a 3-token chunk (bottom-right window over the sliding cache), 1 token."""
    logits = {}
    for attn in ("eager", CAPTURE):
        model = build(mistral_sliding, attn=attn)
        ids, _ = batch(lengths=(16, 16), seed=5)
        cache = DynamicCache(config=model.config)
        calls = _calls()
        with torch.no_grad():
            out = [model(input_ids=ids[:, :12], past_key_values=cache, use_cache=True).logits]
            out.append(model(input_ids=ids[:, 12:15], past_key_values=cache, use_cache=True).logits)
            out.append(model(input_ids=ids[:, 15:16], past_key_values=cache, use_cache=True).logits)
        logits[attn] = torch.cat(out, dim=1)
    chunk = calls[2]                                       # first layer, 3-token chunk
    assert chunk["q"].shape[2] == 3 and chunk["k"].shape[2] > 3
    plan = mx_hf.plan_attention_mask(chunk["mask"], batch=2, q_len=3, kv_len=chunk["k"].shape[2],
                                     sliding_window=chunk["sliding_window"])
    assert (plan.attn_mask_type, plan.window_size) == ("causal_bottom_right", (7, 0))
    assert rel_rms(logits[CAPTURE], logits["eager"]) < 0.1
    with torch.no_grad():
        gen = build(mistral_sliding, attn=NAME).generate(input_ids=ids[:, :12], max_new_tokens=3, do_sample=False)
    assert gen.shape == (2, 15)


def test_from_pretrained_with_registered_name(tmp_path):
    model = build(llama, attn="eager")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=NAME)
    assert loaded.config._attn_implementation == NAME
    ids, am = batch()
    with torch.no_grad():
        model.set_attn_implementation(NAME)
        assert torch.equal(loaded(input_ids=ids, attention_mask=am).logits,
                           model(input_ids=ids, attention_mask=am).logits)


# --------------------------------------------------------------------------- refused masks and features


def _left_padded_mask(pads, q_len, kv_len, q_offset=0, window=None):
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    keep = torch.arange(kv_len).unsqueeze(0) >= torch.tensor(pads).unsqueeze(1)
    fn = sliding_window_causal_mask_function(window) if window else causal_mask_function
    return sdpa_mask(batch_size=len(pads), q_length=q_len, kv_length=kv_len, q_offset=q_offset, mask_function=fn,
                     attention_mask=keep, allow_is_causal_skip=False, local_size=window)


@pytest.mark.parametrize("pads,q_len,kv_len,window", [
    ((0, 3, 6), 10, 10, None), ((0, 3, 6), 10, 10, 4), ((0, 3, 6), 1, 13, None), ((0, 3, 6), 3, 13, None),
    ((3, 3), 1, 13, None),              # the same pad everywhere: padding, not a window over the padded keys
    ((5, 5), 1, 13, 10),                # ... nor a window wider than the module's
])
def test_left_padding_equals_each_sequence_alone_bit_for_bit(pads, q_len, kv_len, window):
    """Left padding (prefill, a decode step, a chunk of 3 tokens; sliding window): each sequence's output and
    gradients equal its own unpadded mxattn call bit for bit (MXFP8 blocks start at its first real token: the
    padding keys hold values 2^16 times larger, which would flush the real ones to subnormals in a shared
    block); query rows without keys (padding) give 0 and no gradient."""
    mask = _left_padded_mask(pads, q_len, kv_len, q_offset=kv_len - q_len, window=window)
    fn, (q, k, v, _) = _attention_call(mask, q_len, kv_len, window=window)
    loud = (torch.arange(kv_len).unsqueeze(0) < torch.tensor(pads).unsqueeze(1)).view(len(pads), 1, kv_len, 1)
    k, v = (torch.where(loud, t * 2.0 ** 16, t) for t in (k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, mask)
    g = torch.Generator().manual_seed(5)
    do = torch.randn(out.shape, generator=g).bfloat16()
    grads = torch.autograd.grad(out, (q, k, v), do)
    for b, pad in enumerate(pads):
        q_pad = max(0, pad - (kv_len - q_len))                           # query rows that are padding
        qb, kb, vb = (t[b:b + 1].detach().requires_grad_() for t in (q[:, :, q_pad:], k[:, :, pad:], v[:, :, pad:]))
        alone = mxattn.mxfp8_attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
                                       attn_mask_type="causal_bottom_right", softmax_scale=0.2, backend="reference",
                                       window_size=None if window is None else (window - 1, 0))
        assert torch.equal(out[b, q_pad:], alone[0]), b
        assert not out[b, :q_pad].any()
        g_alone = torch.autograd.grad(alone, (qb, kb, vb), do[b:b + 1, q_pad:])
        assert torch.equal(grads[0][b, :, q_pad:], g_alone[0][0]) and not grads[0][b, :, :q_pad].any()
        assert torch.equal(grads[1][b, :, pad:], g_alone[1][0]) and not grads[1][b, :, :pad].any()
        assert torch.equal(grads[2][b, :, pad:], g_alone[2][0])


def test_generate_with_left_padding_matches_each_prompt_alone():
    """Batched greedy generation with left padding (HF's recommended side): each prompt's new tokens equal
    those it gets generated alone, and its first-step logits match to float rounding."""
    model = build(llama, attn=NAME)
    lengths = (11, 6, 8)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]
    s = max(lengths)
    ids = torch.stack([torch.cat([torch.zeros(s - len(p), dtype=torch.long), p]) for p in prompts])
    am = torch.stack([torch.cat([torch.zeros(s - len(p), dtype=torch.long), torch.ones(len(p), dtype=torch.long)])
                      for p in prompts])
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=am, **kw)[:, s:]
        for b, p in enumerate(prompts):
            alone = model.generate(p.unsqueeze(0), attention_mask=torch.ones(1, len(p), dtype=torch.long), **kw)
            assert torch.equal(batched[b], alone[0, len(p):]), b
        logits = model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0)).logits
        for b, p in enumerate(prompts):
            alone = model(input_ids=p.unsqueeze(0)).logits[0]
            assert rel_rms(logits[b, s - len(p):], alone) < 1e-5, b


def test_generate_with_left_padding_and_a_static_cache():
    """The static cache (keys past the written positions masked) with left padding: each prompt's tokens equal
    its own generation with the same cache kind."""
    model = build(llama, attn=NAME)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in (9, 5)]
    s = 9
    ids = torch.stack([torch.cat([torch.zeros(s - len(p), dtype=torch.long), p]) for p in prompts])
    am = (ids != 0).long()
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=am, **kw)[:, s:]
        for b, p in enumerate(prompts):
            assert torch.equal(batched[b], model.generate(p.unsqueeze(0), **kw)[0, len(p):]), b


def test_left_padded_encoder_matches_right_padded():
    """A bidirectional encoder (BERT) with left padding gives each sequence's right-padded result."""
    model = build(bert, attn=NAME)
    ids, am = batch(lengths=(12, 7, 9))
    right = model(input_ids=ids, attention_mask=am).last_hidden_state
    lengths = am.sum(1)
    shift = lambda t: torch.stack([torch.roll(t[b], int(t.shape[1] - n)) for b, n in enumerate(lengths)])  # noqa
    # BERT's absolute positions move with the padding, so compare against the right-padded run with the same
    # position ids as the left-padded one
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    left = model(input_ids=shift(ids), attention_mask=shift(am), position_ids=shift(pos)).last_hidden_state
    for b, n in enumerate(lengths):
        assert rel_rms(left[b, ids.shape[1] - n:], right[b, :n]) < 1e-5, b


def test_right_padded_decode_steps_equal_each_sequence_alone():
    """After a right-padded prefill the new tokens sit behind the padding gap (transformers' cache layout): each
    sequence's keys are its prompt and its new tokens, gathered into one packed sequence, so a decode step
    gives each sequence its own logits. (`generate` itself reads the next token of a right-padded row off a
    padding position, transformers' known limit for decoders whatever the attention; pad on the left there.)"""
    model = build(llama, attn=NAME)
    lengths = (10, 7, 4)
    ids, am = batch(lengths=lengths)
    nxt = torch.tensor([[5], [6], [7]])
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, attention_mask=am, past_key_values=cache, use_cache=True)
        step = model(input_ids=nxt, attention_mask=torch.cat([am, torch.ones_like(nxt)], dim=1),
                     position_ids=torch.tensor(lengths).unsqueeze(1), past_key_values=cache, use_cache=True).logits
        for b, n in enumerate(lengths):
            alone = model(input_ids=torch.cat([ids[b, :n], nxt[b]]).unsqueeze(0)).logits[0, -1]
            assert rel_rms(step[b, -1], alone) < 1e-5, b
    # the attention call of such a step, bit for bit against each sequence's own call
    s, t = 10, 3                                              # padded prompt length, tokens generated so far
    keep = torch.zeros(3, 1, 1, s + t, dtype=torch.bool)
    for b, n in enumerate(lengths):
        keep[b, ..., :n] = True
        keep[b, ..., s:] = True
    fn, (q, k, v, _) = _attention_call(keep, 1, s + t)
    out = fn(q, k, v, keep)
    for b, n in enumerate(lengths):
        cols = torch.cat([torch.arange(n), torch.arange(s, s + t)])
        alone = mxattn.mxfp8_attention(q[b:b + 1].transpose(1, 2), k[b:b + 1, :, cols].transpose(1, 2),
                                       v[b:b + 1, :, cols].transpose(1, 2), attn_mask_type="causal_bottom_right",
                                       softmax_scale=0.2, backend="reference")
        assert torch.equal(out[b:b + 1], alone), b


def test_arbitrary_masks_raise():
    model = build(bert, attn=NAME)
    ids, _ = batch(lengths=(10, 10))
    g = torch.Generator().manual_seed(1)
    custom = torch.rand(2, 1, 10, 10, generator=g) > 0.5
    custom[..., 0] = True
    with pytest.raises(mx_hf.UnsupportedMaskError, match="not one contiguous range"):
        model(input_ids=ids, attention_mask=custom)
    bias = torch.zeros(2, 1, 10, 10)
    bias[..., 3] = -0.5                                        # an additive bias, not a mask
    with pytest.raises(mx_hf.UnsupportedMaskError, match="additive bias"):
        model(input_ids=ids, attention_mask=bias)
    per_head = torch.ones(2, 2, 10, 10, dtype=torch.bool)
    per_head[:, 1, :, 5:] = False
    with pytest.raises(mx_hf.UnsupportedMaskError, match="differs between heads"):
        model(input_ids=ids, attention_mask=per_head)


def test_dropout_in_training_raises():
    cfg, cls = bert()
    cfg.attention_probs_dropout_prob = 0.1
    cfg._attn_implementation = NAME
    model = cls(cfg).train()
    ids, am = batch(lengths=(8, 8))
    with pytest.raises(NotImplementedError, match="dropout"):
        model(input_ids=ids, attention_mask=am)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=am)               # dropout is off in eval: runs


def test_attention_without_mask_interface_raises():
    AttentionInterface.register("mxfp8_nomask", mx_hf.make_attention_function("reference"))
    try:
        model = build(llama, attn="mxfp8_nomask")
        ids, am = batch()
        with pytest.raises(RuntimeError, match="AttentionMaskInterface"):
            model(input_ids=ids, attention_mask=am)
    finally:
        mx_hf.unregister("mxfp8_nomask")


# --------------------------------------------------------------------------- the mask translation itself


def _hf_mask(lengths, q_len, kv_len, window=None, causal=True, q_offset=0):
    """HF's own boolean mask builder (what the models call)."""
    from transformers.masking_utils import (bidirectional_mask_function, causal_mask_function,
                                            sliding_window_causal_mask_function)
    fn = (sliding_window_causal_mask_function(window) if window else causal_mask_function) if causal \
        else bidirectional_mask_function
    pad = torch.arange(max(q_offset + q_len, kv_len)).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return sdpa_mask(batch_size=len(lengths), q_length=q_len, kv_length=kv_len, q_offset=q_offset,
                     mask_function=fn, attention_mask=pad, allow_is_causal_skip=False, local_size=window)


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
    band, padding = mxattn.mask.resolve_mask(plan.attn_mask_type, plan.window_size)
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


@pytest.mark.slow
def test_models_bench_hf_rows_smoke_run(tmp_path):
    """benchmarks/models_bench.py --hf-extras-only on the CPU (tiny Llama, reference backend): the issue's
    rows (left-padded batched generation vs SDPA, padding-free vs padded training) are measured and written."""
    import json
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "benchmarks/models_bench.py", "--device", "cpu", "--backend", "reference",
                          "--hf-extras-only", "--new-tokens", "3", "--out-dir", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads((tmp_path / "models.json").read_text())
    gen = out["left_padded_generate"]
    assert len(set(gen["prompts"])) > 1 and gen["tok_s_sdpa"] > 0 and gen["tok_s_mxfp8"] > 0
    assert [r["attn"] for r in out["padding_free"]] == ["sdpa", NAME]
    assert all(r["padded"] > 0 and r["padding_free"] > 0 for r in out["padding_free"])
    assert "Batched generation with left padding" in (tmp_path / "models.md").read_text()


def test_register_validates_and_import_stays_optional():
    with pytest.raises(ValueError, match="name"):
        mx_hf.register("my_sdpa")
    with pytest.raises(ValueError, match="backend"):
        mx_hf.register("mx2", backend="fast")
    code = "import sys, mxattn, mxattn.integrations; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.slow
def test_sample_runs():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "samples/hf_swap.py", "--layers", "1", "--seq", "24"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "rel-RMS" in res.stdout and "top-1" in res.stdout


# --------------------------------------------------------------------------- torch.compile


def _attention_call(mask, q_len, kv_len, causal=True, window=None, seed=0):
    """(function, args): the registered attention function on random q, k, v and an HF-built mask."""
    g = torch.Generator().manual_seed(seed)
    b = mask.shape[0]
    q = torch.randn(b, 4, q_len, 32, generator=g).bfloat16()
    k, v = (torch.randn(b, 2, kv_len, 32, generator=g).bfloat16() for _ in range(2))
    module = torch.nn.Module()
    module.is_causal = causal
    fn = mx_hf.make_attention_function("reference")
    return (lambda q, k, v, mask: fn(module, q, k, v, mask, scaling=0.2, sliding_window=window)[0]), (q, k, v, mask)


@pytest.mark.parametrize("case", [
    # (lengths, q_len, kv_len, window, causal, q_offset)
    ((9, 5, 9), 9, 9, None, True, 0),          # right-padded causal batch (training)
    ((9, 9), 9, 9, 4, True, 0),                # sliding window, unpadded
    ((9, 5, 2), 9, 9, None, False, 0),         # encoder with padding
    ((12, 12), 1, 12, None, True, 11),         # decode step
    ((12, 12), 4, 12, 3, True, 8),             # chunked prefill with a window
])
def test_compiled_attention_function_fullgraph_matches_eager(case):
    """The attention function traced with fullgraph=True (no graph break) on HF's own masks gives the eager
    function's bytes; the mask is translated on the device."""
    lengths, q_len, kv_len, window, causal, q_offset = case
    mask = _hf_mask(lengths, q_len, kv_len, window, causal, q_offset)
    fn, args = _attention_call(mask, q_len, kv_len, causal, window)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*args), fn(*args))
    additive = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    assert torch.equal(compiled(*args[:3], additive), fn(*args))


def _keys_2d(kind: str, batch: int, kv_len: int, prompt: int) -> torch.Tensor:
    """The 2-D padding mask of a batch (True = real token) over kv_len cache positions: `kind` "left:p0,p1,..."
    (left pads of prompts `prompt` long, the rest generated tokens) or "right:n0,n1,..." (prompts of n_b real
    tokens right-padded to `prompt`, then generated tokens: HF's cache layout)."""
    side, values = kind.split(":")
    j = torch.arange(kv_len).unsqueeze(0)
    n = torch.tensor([int(x) for x in values.split(",")]).unsqueeze(1)
    assert n.shape[0] == batch
    return j >= n if side == "left" else (j < n) | (j >= prompt)


#: per-sequence masks under torch.compile: (padding, prompt length, q_len, kv_len, q_offset, window); kv_len >
#: q_offset + q_len is a static cache (the keys past the written ones are masked)
TRACED_SEQUENCE_CASES = {
    "left_prefill": ("left:0,3,6", 10, 10, 10, 0, None),
    "left_prefill_window": ("left:0,3,6", 10, 10, 10, 0, 4),
    "left_decode": ("left:0,3,6", 10, 1, 13, 12, None),
    "left_decode_same_pads": ("left:3,3", 10, 1, 13, 12, None),      # eagerly: not read as a window
    "left_decode_window": ("left:0,3,6", 10, 1, 13, 12, 8),
    "left_chunk": ("left:0,3,6", 10, 3, 13, 10, None),
    "left_static_prefill": ("left:0,3,6", 10, 10, 16, 0, None),
    "left_static_decode": ("left:0,3,6", 10, 1, 16, 12, None),
    "right_decode": ("right:10,7,4", 10, 1, 13, 12, None),            # prompt, gap, generated tokens
    "right_chunk": ("right:10,7,4", 10, 2, 13, 11, None),
}


@pytest.mark.parametrize("name", list(TRACED_SEQUENCE_CASES))
def test_compiled_per_sequence_masks_equal_eager_and_each_sequence_alone(name):
    """Left padding (prefill, decode, chunk, static cache, window) and the decode steps after right padding,
    traced with fullgraph=True: output and gradients equal the eager function's bit for bit, and each
    sequence equals its own unpadded call (its MXFP8 blocks start at its first key: the padding keys hold
    values 2^16 times larger, which would flush the real ones to subnormals if a block held both)."""
    padding, prompt, q_len, kv_len, q_offset, window = TRACED_SEQUENCE_CASES[name]
    batch = len(padding.split(":")[1].split(","))
    keys = _keys_2d(padding, batch, kv_len, prompt)
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    mask = sdpa_mask(batch_size=batch, q_length=q_len, kv_length=kv_len, q_offset=q_offset,
                     mask_function=sliding_window_causal_mask_function(window) if window else causal_mask_function,
                     attention_mask=keys, allow_is_causal_skip=False, local_size=window)
    fn, (q, k, v, _) = _attention_call(mask, q_len, kv_len, window=window)
    loud = (~keys).view(batch, 1, kv_len, 1)
    k, v = (torch.where(loud, t * 2.0 ** 16, t) for t in (k, v))
    do = torch.randn(batch, q_len, 4, 32, generator=torch.Generator().manual_seed(9)).bfloat16()

    def run(f):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = f(*leaves, mask)
        return (out,) + torch.autograd.grad(out, leaves, do)

    torch._dynamo.reset()
    eager, traced = run(fn), run(torch.compile(fn, fullgraph=True, backend="aot_eager"))
    for a, b in zip(traced, eager):
        assert torch.equal(a, b), name
    out = eager[0]
    for b in range(batch):
        rows = mask[b, 0].any(dim=1).nonzero().flatten()
        cols = mask[b, 0].any(dim=0).nonzero().flatten()
        alone = mxattn.mxfp8_attention(q[b:b + 1, :, rows].transpose(1, 2), k[b:b + 1, :, cols].transpose(1, 2),
                                       v[b:b + 1, :, cols].transpose(1, 2), attn_mask_type="causal_bottom_right",
                                       window_size=None if window is None else (window - 1, 0), softmax_scale=0.2,
                                       backend="reference")
        assert torch.equal(out[b, rows], alone[0]), (name, b)
        assert not out[b].index_fill(0, rows, 0).any(), (name, b)           # rows without keys: 0


def test_compiled_attention_function_still_refuses_what_it_cannot_express():
    """Under torch.compile the expressibility check runs on the device and stops the call with its reason:
    several documents in one row, a hole in a row's keys, an additive bias, a right-padded prompt prefilled
    into a static cache (each of which the eager translation runs or refuses with its own message)."""
    packed = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    packed[..., :5, :5] = torch.ones(5, 5, dtype=torch.bool).tril()
    packed[..., 5:, 5:] = torch.ones(3, 3, dtype=torch.bool).tril()
    hole = _hf_mask((9, 9), 9, 9).clone()
    hole[1, :, 6:, 3] = False                                           # an overlay, not padding
    static_right = _hf_mask((6, 4), 6, 16)                              # eagerly: top-left over 16 keys
    for mask in (packed, hole, static_right):
        fn, args = _attention_call(mask, mask.shape[2], mask.shape[3])
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        with pytest.raises(RuntimeError, match=r"mxattn \(torch.compile\): this attention mask is not"):
            compiled(*args)
    assert mx_hf.plan_attention_mask(packed, batch=1, q_len=8, kv_len=8).gather is not None
    assert mx_hf.plan_attention_mask(static_right, batch=2, q_len=6, kv_len=16).attn_mask_type == "padding_causal"
    bias = torch.where(_hf_mask((9, 9), 9, 9), 0.0, -1e9)
    bias[0, 0, 5, 0] = -3.0                                             # an additive bias, not a mask
    fn, args = _attention_call(bias, 9, 9)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match="values other than 0 and masked"):
        compiled(*args)


def test_traced_refusal_messages_fit_cuda_device_asserts():
    """CUDA refuses device-side assert messages of 255 characters or more ("Message length must be smaller than
    255"), which on a GPU would replace the refusal with that error."""
    for message in (hf_masks._TRACED_REFUSAL, hf_masks._TRACED_BIAS):
        assert message.startswith("mxattn (torch.compile): ") and len(message) < 255, len(message)


def test_compiled_model_has_no_graph_breaks_and_no_recompiles():
    """A transformers model with the registered attention, compiled: one graph (padded causal batch), training
    steps with new data and the same shapes reuse it, and its logits equal the eager model's on real tokens."""
    model = build(llama, attn=NAME)
    ids, am = batch()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids, attention_mask=am)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(model)                                    # inductor, as users compile
    eager = model(input_ids=ids, attention_mask=am).logits
    valid = am.bool()
    assert rel_rms(compiled(input_ids=ids, attention_mask=am).logits[valid], eager[valid]) < 1e-5
    model.train()

    def step(seed):
        ids, am = batch(seed=seed)
        compiled(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100)).loss.backward()

    step(1)                                                 # training mode and labels: compiled once more
    with torch._dynamo.config.patch(error_on_recompile=True):
        step(2)
        step(3)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def _left_padded_prompts(lengths, seed=7):
    """(ids, attention_mask, position_ids) [B, S]: prompts of `lengths` random tokens, left-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.stack([torch.cat([torch.zeros(s - n, dtype=torch.long), torch.randint(3, VOCAB, (n,), generator=g)])
                       for n in lengths])
    am = (torch.arange(s).unsqueeze(0) >= s - torch.tensor(lengths).unsqueeze(1)).long()
    return ids, am, (am.cumsum(1) - 1).clamp(min=0)


def test_compiled_left_padded_model_equals_eager_without_graph_breaks():
    """A left-padded batch through the compiled model: no graph break, logits and every parameter's gradient
    equal the eager model's bit for bit (aot_eager: the rest of the model is not re-fused)."""
    model = build(llama, attn=NAME)
    ids, am, pos = _left_padded_prompts((11, 6, 8))
    inputs = dict(input_ids=ids, attention_mask=am, position_ids=pos, labels=ids.masked_fill(am == 0, -100))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(**inputs)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    results = []
    for f in (model, compiled):
        model.zero_grad()
        out = f(**inputs)
        out.loss.backward()
        results.append((out.logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (eager, eager_grads), (traced, traced_grads) = results
    assert torch.equal(traced, eager)
    assert all(torch.equal(a, b) for a, b in zip(traced_grads, eager_grads))


def _decode_steps(forward, model, cache, ids, am, steps: int):
    """Eager prefill of the padded prompts into `cache`, then `steps` greedy single-token steps through
    `forward`; every step's logits [B, 1, V] (position ids and the 2-D mask as `generate` builds them)."""
    pos = (am.cumsum(1) - 1).clamp(min=0)
    logits = [model(input_ids=ids, attention_mask=am, position_ids=pos, past_key_values=cache, use_cache=True)
              .logits[:, -1:]]
    for _ in range(steps):
        nxt = logits[-1][:, -1].argmax(-1, keepdim=True)
        am = torch.cat([am, torch.ones_like(nxt)], dim=1)
        logits.append(forward(input_ids=nxt, attention_mask=am, position_ids=am.sum(1, keepdim=True) - 1,
                              past_key_values=cache, use_cache=True).logits)
    return logits


@pytest.mark.parametrize("padding,cache_kind", [("left", "dynamic"), ("left", "static"), ("right", "dynamic")])
def test_compiled_decode_steps_equal_eager(padding, cache_kind):
    """Decode steps after a left-padded prefill (DynamicCache: a new key count each step; StaticCache: the
    shapes HF compiles, keys past the written ones masked) and after a right-padded one (the prompt, the gap,
    the new tokens), through the model compiled with fullgraph=True: the logits of every step equal eager's."""
    from transformers import StaticCache
    model = build(llama, attn=NAME)
    if padding == "left":
        ids, am, _ = _left_padded_prompts((9, 4, 6))
    else:
        ids, am = batch(lengths=(9, 4, 6))

    def new_cache():
        return DynamicCache(config=model.config) if cache_kind == "dynamic" else \
            StaticCache(config=model.config, max_cache_len=16)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        eager = _decode_steps(model, model, new_cache(), ids, am, steps=4)
        traced = _decode_steps(compiled, model, new_cache(), ids, am, steps=4)
    for t, (a, b) in enumerate(zip(traced, eager)):
        assert torch.equal(a, b), t


def test_compiled_generate_with_left_padding_matches_eager():
    """transformers' own compiled generation (static cache, CompileConfig with fullgraph=True: any graph
    break raises) on left-padded prompts of different lengths: the same greedy tokens as eager generation,
    which gives each prompt its own tokens (test_generate_with_left_padding_*)."""
    from transformers import CompileConfig
    model = build(llama, attn=NAME)
    ids, am, _ = _left_padded_prompts((11, 6, 8), seed=12)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True                      # transformers compiles on CUDA only otherwise
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model.generate(ids, attention_mask=am, **kw)
        traced = model.generate(ids, attention_mask=am, compile_config=config, **kw)
    assert hasattr(model, "_compiled_call")                 # the decode steps did run compiled
    assert torch.equal(traced, eager)


def test_compiled_padding_free_batch_equals_eager():
    """cu_seq_lens_q/k kwargs under torch.compile (no graph break), with or without max_length_q/k (then
    bounded by the row's tokens): logits equal the eager run's."""
    model = build(llama, attn=NAME)
    g = torch.Generator().manual_seed(11)
    docs = [torch.randint(3, VOCAB, (n,), generator=g) for n in (9, 5, 13)]
    cu = torch.tensor([0, 9, 14, 27], dtype=torch.int32)
    inputs = dict(input_ids=torch.cat(docs).unsqueeze(0), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                  position_ids=torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        eager = model(**inputs, max_length_q=13, max_length_k=13).logits
        assert torch.equal(compiled(**inputs, max_length_q=13, max_length_k=13).logits, eager)
        assert torch.equal(compiled(**inputs).logits, eager)


# --------------------------------------------------------------------------- padding-free batches, sinks


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


def gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=8, max_position_embeddings=64,
                       layer_types=["sliding_attention", "full_attention"])
    return cfg, GptOssForCausalLM


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


# --------------------------------------------------------------------------- the MXFP8 KV cache for transformers


def test_mxfp8_cache_changes_nothing_for_mxfp8_attention_and_halves_the_bytes():
    """Prefill, a 3-token chunk and single-token steps with MXFP8Cache give the logits of a bf16 DynamicCache
    bit for bit under mxattn's attention (re-quantizing dequantized MXFP8 is exact), generate gives the same
    tokens, and the stored bytes are about half."""
    from mxattn.integrations.hf_cache import MXFP8Cache
    model = build(llama, attn=NAME).bfloat16()
    ids, _ = batch(lengths=(40, 40), seed=9)
    caches = {"dynamic": DynamicCache(config=model.config), "mxfp8": MXFP8Cache()}
    logits = {}
    for kind, cache in caches.items():
        with torch.no_grad():
            out = [model(input_ids=ids[:, :33], past_key_values=cache, use_cache=True).logits]
            out.append(model(input_ids=ids[:, 33:36], past_key_values=cache, use_cache=True).logits)
            for t in range(36, 40):
                out.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
        logits[kind] = torch.cat(out, dim=1)
    assert torch.equal(logits["mxfp8"], logits["dynamic"])
    bf16_bytes = sum(2 * layer.keys.numel() * 2 for layer in caches["dynamic"].layers)
    assert 0.5 < caches["mxfp8"].nbytes() / bf16_bytes < 0.62
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(ids[:, :20], past_key_values=MXFP8Cache(), **kw),
                           model.generate(ids[:, :20], **kw))
    with pytest.raises(NotImplementedError, match="beam search"):
        MXFP8Cache().layer_class_to_replicate().crop(-1)
    # the storage really is MXFP8: under torch SDPA (which does not quantize) the cache shows
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True).logits
        cache = MXFP8Cache()
        model(input_ids=ids[:, :39], past_key_values=cache, use_cache=True)
        last = model(input_ids=ids[:, 39:], past_key_values=cache, use_cache=True).logits
    assert 1e-3 < rel_rms(last[:, -1], full[:, -1]) < 0.1
