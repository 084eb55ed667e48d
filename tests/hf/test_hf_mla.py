"""Hugging Face transformers' DeepSeek-V3 (multi-head latent attention: Q and K of head dim qk_nope + qk_rope, V
of v_head_dim) built tiny on the CPU with the registered "mxfp8" attention on the reference backend: V reaches
mxattn at its own head dim; each attention call equals `ref` bit for bit, the model is close to eager/SDPA in
its logits, loss and gradients, compiled training equals eager; on a backend of one head dim (triton) V is
padded to Q's head dim and gives the same numbers; the paged MXFP8 cache, which MLA models (they cache latents) cannot feed, says why.
Batched left-padded `generate`: tests/hf/test_hf_whole_models.py."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mxattn.integrations import transformers as mx_hf  # noqa: E402
from mxattn.integrations.hf_cache import MXFP8PagedCache, MXFP8PagedLayer, cache_kwargs  # noqa: E402
from one_width_backend import one_width_triton  # noqa: E402
from ref import mxfp8_ref  # noqa: E402
from hf_models import CAPTURE, NAME, _calls, batch, build, deepseek_v3, rel_rms  # noqa: E402
from hf_models import _quiet, _registered  # noqa: E402,F401  (autouse fixtures: importing turns them on)


def _loss_and_grads(model, ids, am, forward=None):
    """(loss, logits, {name: gradient}) of a training step of model (through forward: model compiled)."""
    model.zero_grad()
    run = model if forward is None else forward
    out = run(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100))
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dims", [(64, 32, 64), (128, 64, 128)], ids=["96_64", "192_128"])
def test_each_attention_call_takes_v_at_its_head_dim_and_equals_ref(dims):
    model = build(lambda: deepseek_v3(*dims, heads=2 if dims[0] == 128 else 4), attn=CAPTURE)
    ids, _ = batch(lengths=(20, 20))
    calls = _calls()
    with torch.no_grad():
        model(input_ids=ids)
    assert len(calls) == 2
    d_qk, d_v = dims[0] + dims[1], dims[2]
    for call in calls:
        q, k, v = call["q"], call["k"], call["v"]
        assert q.shape[-1] == k.shape[-1] == d_qk and v.shape[-1] == d_v and call["out"].shape[-1] == d_v
        # (fp32 inputs: the kernels write O in bf16, cast to fp32)
        want, _ = mxfp8_ref.sdpa_fwd(q, k, v, attn_scale=call["scaling"], causal=True)
        assert torch.equal(call["out"], want.transpose(1, 2).float())


@pytest.mark.parametrize("dims", [(64, 32, 64), (128, 64, 128)], ids=["96_64", "192_128"])
def test_padded_batch_logits_close_to_eager_and_sdpa(dims):
    factory = lambda: deepseek_v3(*dims, heads=2 if dims[0] == 128 else 4)  # noqa: E731
    ids, am = batch(lengths=(20, 13, 6))
    valid = am.bool()
    logits = {}
    for attn in ("eager", "sdpa", NAME):
        with torch.no_grad():
            logits[attn] = build(factory, attn=attn)(input_ids=ids, attention_mask=am).logits[valid]
    assert rel_rms(logits["sdpa"], logits["eager"]) < 1e-5
    err = rel_rms(logits[NAME], logits["eager"])
    assert 0 < err < 0.1
    assert (logits[NAME].argmax(-1) == logits["eager"].argmax(-1)).float().mean() > 0.9


def test_training_loss_and_gradients_close_to_eager():
    ids, am = batch(lengths=(20, 13))
    loss, _, grads = _loss_and_grads(build(deepseek_v3, attn=NAME).train(), ids, am)
    ref_loss, _, ref_grads = _loss_and_grads(build(deepseek_v3, attn="sdpa").train(), ids, am)
    assert abs(loss.item() - ref_loss.item()) < 2e-3 * abs(ref_loss.item())
    assert all(torch.isfinite(g).all() for g in grads.values())
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight",
                 "model.layers.1.self_attn.o_proj.weight"):
        assert grads[name].abs().sum() > 0 and rel_rms(grads[name], ref_grads[name]) < 0.15, name


def test_on_a_backend_of_one_head_dim_v_is_padded_and_gives_the_reference_numbers(monkeypatch):
    """A backend that runs one head dim for Q, K and V (triton; here a CPU stand-in computing the reference
    backend's arithmetic) gets MLA's V zero-padded to Q's head dim by mxattn and O cut back: the loss, logits and
    every gradient are the reference backend's on V as it is, bit for bit (zero columns change no scale of V's
    own columns, nor dO's)."""
    ids, am = batch(lengths=(20, 13))
    model = build(deepseek_v3, attn=NAME).train()
    plain = _loss_and_grads(model, ids, am)
    _, widths = one_width_triton(monkeypatch)
    mx_hf.register("mxfp8-one-width", backend="triton")
    try:
        model.set_attn_implementation("mxfp8-one-width")
        padded = _loss_and_grads(model, ids, am)
    finally:
        model.set_attn_implementation(NAME)
        mx_hf.unregister("mxfp8-one-width")
    assert widths == [96, 96]  # (two layers; Q's head dim 64 + 32)
    assert torch.equal(plain[0], padded[0]) and torch.equal(plain[1], padded[1])
    assert all(torch.equal(plain[2][n], padded[2][n]) for n in plain[2])


def test_compiled_training_equals_eager():
    model = build(deepseek_v3, attn=NAME).train()
    ids, am = batch(lengths=(20, 13))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    eager = _loss_and_grads(model, ids, am)
    traced = _loss_and_grads(model, ids, am, compiled)
    assert torch.equal(traced[0], eager[0]) and torch.equal(traced[1], eager[1])
    assert all(torch.equal(traced[2][n], eager[2][n]) for n in eager[2])


def test_the_paged_cache_says_why_an_mla_model_cannot_use_it():
    """DeepSeek-V3 hands its cache the compressed latents, not the keys and values it attends: the paged cache
    (read inside mxattn's attention call) never gets them, and its next update says so."""
    model = build(deepseek_v3, attn=NAME)
    ids, am = batch(lengths=(12, 12))
    with torch.no_grad(), pytest.raises(RuntimeError, match="MLA models such as DeepSeek-V3 cache compressed latents"):
        model.generate(ids, attention_mask=am, **cache_kwargs(MXFP8PagedCache(max_cache_len=64)), max_new_tokens=3,
                       do_sample=False, pad_token_id=0)


def test_a_paged_layer_of_two_head_dims_equals_attention_over_the_prefix():
    """A model that caches its keys (d_qk) and values (d_v) themselves can use the paged cache: a prefill and a
    decode step through one `MXFP8PagedLayer` and the attention function equal `mxfp8_attention` over the
    tokens so far, bit for bit."""
    import mxattn
    fn = mx_hf.make_attention_function("reference")
    module = torch.nn.Module()
    module.is_causal = True
    layer = MXFP8PagedLayer(page_size=32, max_cache_len=64)
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, h, 41, 96, generator=g).bfloat16() for h in (4, 2))
    v = torch.randn(1, 2, 41, 64, generator=g).bfloat16()
    for start, stop in ((0, 40), (40, 41)):
        keys, values = layer.update(k[:, :, start:stop], v[:, :, start:stop])
        out, _ = fn(module, q[:, :, start:stop], keys, values, None, scaling=0.1)
        want = mxattn.mxfp8_attention(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], qkv_format="bhsd",
                                      attn_mask_type="causal_bottom_right", softmax_scale=0.1, backend="reference")
        assert out.shape == (1, stop - start, 4, 64) and torch.equal(out, want.transpose(1, 2))
    assert layer.store.head_dim == 96 and layer.store.head_dim_v == 64

