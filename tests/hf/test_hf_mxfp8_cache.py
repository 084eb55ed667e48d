"""`MXFP8Cache`, the MXFP8 KV cache for transformers' generation: under mxattn's attention it changes no logit
and stores about half the bytes of a bf16 DynamicCache; under other attention it is an MXFP8-quantized cache."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402
from mxattn.integrations.hf_cache import cache_kwargs  # noqa: E402
from hf_models import NAME, batch, build, llama, rel_rms  # noqa: E402
from hf_models import _quiet, _registered  # noqa: E402,F401  (autouse fixtures: importing turns them on)


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
            out = [model(input_ids=ids[:, :33], **cache_kwargs(cache), use_cache=True).logits]
            out.append(model(input_ids=ids[:, 33:36], **cache_kwargs(cache), use_cache=True).logits)
            for t in range(36, 40):
                out.append(model(input_ids=ids[:, t:t + 1], **cache_kwargs(cache), use_cache=True).logits)
        logits[kind] = torch.cat(out, dim=1)
    assert torch.equal(logits["mxfp8"], logits["dynamic"])
    bf16_bytes = sum(2 * layer.keys.numel() * 2 for layer in caches["dynamic"].layers)
    assert 0.5 < caches["mxfp8"].nbytes() / bf16_bytes < 0.62
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(ids[:, :20], **cache_kwargs(MXFP8Cache()), **kw),
                           model.generate(ids[:, :20], **kw))
    with pytest.raises(NotImplementedError, match="beam search"):
        MXFP8Cache().layer_class_to_replicate().crop(-1)
    # the storage really is MXFP8: under torch SDPA (which does not quantize) the cache shows
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        full = model(input_ids=ids, **cache_kwargs(DynamicCache(config=model.config)), use_cache=True).logits
        cache = MXFP8Cache()
        model(input_ids=ids[:, :39], **cache_kwargs(cache), use_cache=True)
        last = model(input_ids=ids[:, 39:], **cache_kwargs(cache), use_cache=True).logits
    assert 1e-3 < rel_rms(last[:, -1], full[:, -1]) < 0.1


def test_cache_kwargs_hands_generate_the_cache_under_the_name_transformers_takes():
    """`cache_kwargs` names the argument the installed transformers takes: generate uses the cache handed over
    (it holds the prompt and the new tokens afterwards) and warns of no deprecated argument (transformers that
    renamed `past_key_values` to `cache` warn on the old name; older ones refuse the new one)."""
    import warnings
    from mxattn.integrations.hf_cache import MXFP8Cache
    model = build(llama, attn=NAME)
    ids, _ = batch(lengths=(12, 12), seed=3)
    cache = MXFP8Cache()
    (name,) = cache_kwargs(cache)
    assert name in ("cache", "past_key_values")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", FutureWarning)
        model.generate(ids, **cache_kwargs(cache), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                       pad_token_id=0)
    assert cache.get_seq_length() == 12 + 3 - 1   # the last new token is sampled, never fed back
