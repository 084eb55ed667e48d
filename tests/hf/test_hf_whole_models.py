"""Hugging Face transformers integration (`mxattn.integrations.transformers`), whole models: tiny models built
locally on CPU.

Every model runs with attn_implementation="mxfp8" against "eager" on the same weights; each attention call is
also checked bit for bit against an `mxfp8_attention` call made here on the same q/k/v, and at MXFP8 level
against torch SDPA with HF's own mask. Also here: padding (right and left; prefill, decode steps, generate), the
masks and features that are refused, registration, the sample and the benchmark's HF rows.
"""

import os
import subprocess
import sys

import pytest
from repo_paths import ROOT
import torch

transformers = pytest.importorskip("transformers")

import mxattn  # noqa: E402
from mxattn.integrations import transformers as mx_hf  # noqa: E402
from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache  # noqa: E402
from transformers.masking_utils import sdpa_mask  # noqa: E402
from mxattn.integrations.hf_cache import cache_kwargs  # noqa: E402
from hf_models import (  # noqa: E402
    CAPTURE, LENGTHS, MODELS, NAME, VOCAB, _attention_call, _calls, batch, bert, build, deepseek_v3, llama,
    main_output, mistral_sliding, qwen2_mixed, rel_rms,
)
from hf_models import _quiet, _registered  # noqa: E402,F401  (autouse fixtures: importing turns them on)


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


def _chunked_logits(model, ids, ends):
    """model's logits over ids [B, S] (no grad) fed in consecutive chunks ending at ends (a prefill, then decode
    chunks and steps) against one fresh DynamicCache, concatenated along the sequence."""
    cache = DynamicCache(config=model.config)
    out, start = [], 0
    with torch.no_grad():
        for end in ends:
            out.append(model(input_ids=ids[:, start:end], **cache_kwargs(cache), use_cache=True).logits)
            start = end
    return torch.cat(out, dim=1)


def test_decode_with_kv_cache_bottom_right():
    """Prefill, then a 3-token chunk and a 1-token step against a DynamicCache: bottom-right alignment."""
    logits = {}
    for attn in ("eager", NAME):
        model = build(llama, attn=attn)
        ids, _ = batch(lengths=(14, 14), seed=3)
        logits[attn] = _chunked_logits(model, ids, (10, 13, 14))
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
        calls = _calls()
        logits[attn] = _chunked_logits(model, ids, (12, 15, 16))
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


@pytest.mark.parametrize("factory", [llama, deepseek_v3], ids=["llama", "deepseek_v3_mla"])
def test_generate_with_left_padding_matches_each_prompt_alone(factory):
    """Batched greedy generation with left padding (HF's recommended side): each prompt's new tokens equal
    those it gets generated alone, and its first-step logits match to float rounding (DeepSeek-V3: MLA, V of
    another head dim than Q and K)."""
    model = build(factory, attn=NAME)
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
        model(input_ids=ids, attention_mask=am, **cache_kwargs(cache), use_cache=True)
        step = model(input_ids=nxt, attention_mask=torch.cat([am, torch.ones_like(nxt)], dim=1),
                     position_ids=torch.tensor(lengths).unsqueeze(1), **cache_kwargs(cache), use_cache=True).logits
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


# --------------------------------------------------------------------------- registration, sample, benchmark


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
