"""`MXFP8PagedCache`: transformers' generate over mxattn's paged MXFP8 KV cache, read directly by mxattn's attention
function (reference backend on the CPU; tests/hf/test_hf_gpu.py runs the Triton paged kernel)."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
import mxattn.integrations.transformers as mx_hf  # noqa: E402
from mxattn.integrations.hf_cache import MXFP8PagedCache, cache_kwargs  # noqa: E402
from mxattn.integrations.hf_masks import UnsupportedMaskError  # noqa: E402
from transformers import (  # noqa: E402
    DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
)

NAME = "mxfp8_pages_test"
VOCAB = 96


@pytest.fixture(scope="module", autouse=True)
def _registered():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mx_hf.register(NAME, backend="reference")
        yield
    mx_hf.unregister(NAME)


def _model(kind="llama", attn=NAME):
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    if kind == "llama":
        cfg, cls = LlamaConfig(**common), LlamaForCausalLM
    elif kind == "mistral":
        cfg, cls = MistralConfig(sliding_window=8, **common), MistralForCausalLM
    else:                                   # one sliding-window layer, one full layer
        cfg, cls = Qwen2Config(use_sliding_window=True, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"], **common), Qwen2ForCausalLM
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return cls(cfg).bfloat16().eval()


def _prompts(lengths, seed=5):
    """(ids, attention_mask) [B, S], left-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), s), generator=g)
    am = (torch.arange(s).unsqueeze(0) >= s - torch.tensor(lengths).unsqueeze(1)).long()
    return ids * am, am


def _generate(model, ids, am, cache, new_tokens=9):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=am, **cache_kwargs(cache), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores, 1)


@pytest.mark.parametrize("kind,lengths", [("llama", (37, 37)), ("llama", (37, 30, 5)), ("mistral", (37, 21, 12)),
                                         ("qwen2_mixed", (37, 9, 25))],
                         ids=["unpadded", "left_padded", "sliding_window_left_padded", "mixed_layers_left_padded"])
def test_generate_over_the_paged_cache_equals_a_bf16_dynamic_cache(kind, lengths):
    """Prefill and decode steps read the pages and give the DynamicCache run's scores and tokens bit for bit
    (attention over each sequence's real tokens, its V blocks from its first real token, in both); the pages hold
    each row's real tokens only."""
    model = _model(kind)
    ids, am = _prompts(lengths)
    cache = MXFP8PagedCache(max_cache_len=64, page_size=32)
    tokens, scores = _generate(model, ids, am, cache)
    want_tokens, want_scores = _generate(model, ids, am, DynamicCache(config=model.config))
    assert torch.equal(tokens, want_tokens) and torch.equal(scores, want_scores)
    for layer in cache.layers:
        assert [layer.store.length(s) for s in layer.slots] == [n + 8 for n in lengths]
        assert layer.get_seq_length() == max(lengths) + 8
    assert 0 < cache.nbytes() and cache.bf16_nbytes() == 2 * 2 * (len(lengths) * 2) * 2 * 32 * 32 * 2


def test_a_paged_cache_read_by_another_attention_function_raises():
    """Under torch SDPA the new tokens would be attended alone: the layer's next update raises, naming the fix."""
    model = _model(attn="sdpa")
    ids, am = _prompts((12, 12))
    with pytest.raises(RuntimeError, match="register"):
        _generate(model, ids, am, MXFP8PagedCache(max_cache_len=32, page_size=32))


def test_right_padding_and_capacity_are_refused_before_storing():
    model = _model()
    ids = torch.randint(3, VOCAB, (2, 10))
    am = torch.ones_like(ids)
    am[1, 7:] = 0                                  # right padding: not what generate builds
    cache = MXFP8PagedCache(max_cache_len=32, page_size=32)
    with torch.no_grad(), pytest.raises(UnsupportedMaskError, match="left padding"):
        model(input_ids=ids, attention_mask=am, **cache_kwargs(cache), use_cache=True)
    assert all(layer.store.length(s) == 0 for layer in cache.layers for s in layer.slots)
    with torch.no_grad(), pytest.raises(ValueError, match="max_cache_len=8"):
        model(input_ids=ids, **cache_kwargs(MXFP8PagedCache(max_cache_len=8, page_size=32)), use_cache=True)


@pytest.mark.parametrize("kwargs,match", [(dict(max_cache_len=0), "max_cache_len"),
                                          (dict(max_cache_len=64, page_size=48), "multiple of 32"),
                                          (dict(max_cache_len=64, page_size=True), "page_size")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MXFP8PagedCache(**kwargs)


def test_beam_search_operations_raise():
    with pytest.raises(NotImplementedError, match="beam search"):
        MXFP8PagedCache(max_cache_len=64).layer_class_to_replicate().crop(-1)


def test_attention_sinks_reach_the_paged_call():
    """gpt-oss's s_aux (one sink logit per query head) runs as the learnable sink over the pages: the attention
    function's output equals mxfp8_attention with that sink over the same tokens."""
    import mxattn
    from mxattn.integrations.hf_cache import MXFP8PagedLayer
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, 40, 32, generator=g).bfloat16() for h in (4, 2, 2))
    sinks = torch.randn(4, generator=g)
    layer = MXFP8PagedLayer(page_size=32, max_cache_len=64)
    keys, values = layer.update(k, v)
    module = torch.nn.Module()
    module.is_causal = True
    fn = mx_hf.make_attention_function("reference")
    out, _ = fn(module, q, keys, values, None, scaling=0.25, s_aux=sinks)
    want = mxattn.mxfp8_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=0.25,
                                  attn_mask_type="causal", softmax_type="learnable", softmax_offset=sinks,
                                  backend="reference")
    assert torch.equal(out, want)
    with pytest.raises(RuntimeError, match="not the ones"):
        fn(module, q, keys, values, None, scaling=0.25)   # the step's tokens are stored once


def test_compiled_model_runs_the_paged_cache_eagerly_and_fullgraph_says_why():
    """Under torch.compile the paged layer's update and attention leave the graph (they run eagerly, the rest of
    the model compiled): generate gives the eager run's tokens. With fullgraph=True Dynamo refuses, naming the
    cache and what to use instead."""
    ids, am = _prompts((37, 30, 5))
    model = _model()
    want, want_scores = _generate(model, ids, am, MXFP8PagedCache(max_cache_len=64, page_size=32), new_tokens=4)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward)
    got, scores = _generate(model, ids, am, MXFP8PagedCache(max_cache_len=64, page_size=32), new_tokens=4)
    assert torch.equal(got, want)
    finite = want_scores.isfinite()
    assert torch.equal(finite, scores.isfinite())
    assert torch.allclose(scores[finite].float(), want_scores[finite].float(), atol=0.1, rtol=0.05)
    torch._dynamo.reset()                  # (the entries compiled above would be reused without tracing)
    model = _model()
    model.forward = torch.compile(model.forward, fullgraph=True)
    with pytest.raises(Exception, match="MXFP8PagedCache runs eagerly"):
        _generate(model, ids, am, MXFP8PagedCache(max_cache_len=64, page_size=32), new_tokens=2)
    torch._dynamo.reset()
