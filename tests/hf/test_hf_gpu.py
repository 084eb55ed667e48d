"""The Hugging Face integration on a CUDA GPU with the triton backend: left padding, decode steps after right
padding and padding-free batches run as packed calls; each
sequence equals its own call, and batched greedy generation gives each prompt its own tokens."""

import pytest
import torch

import mxattn

transformers = pytest.importorskip("transformers")
import mxattn.integrations.transformers as mx_hf  # noqa: E402

pytestmark = pytest.mark.gpu
NAME = "mxfp8_triton_gpu_test"


@pytest.fixture(scope="module", autouse=True)
def _registered():
    mx_hf.register(NAME, backend="triton")
    yield
    mx_hf.unregister(NAME)


def _llama(dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = NAME
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).cuda().to(dtype).eval()


def _left_padded(prompts):
    """(ids, attention_mask) [B, S] of 1-D token tensors, left-padded with 0."""
    s = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([p.new_zeros(s - len(p)), p]) for p in prompts])
    am = torch.stack([torch.cat([p.new_zeros(s - len(p)), torch.ones_like(p)]) for p in prompts])
    return ids, am


def _greedy(model, ids, am, new_tokens: int, **kw):
    """Greedy generation: (new tokens [B, n], logits [B, n, V] fp32 of each step)."""
    out = model.generate(ids, attention_mask=am, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1).float()


def _compare_greedy(got, want, what: str) -> int:
    """got, want: (tokens [n], logits [n, V]) of one prompt from two runs whose GEMMs differ (another batch size
    or compiled): the logits of every compared step agree to rel-RMS 2e-2 and the tokens are equal, except at
    a tie within the two runs' rounding (want's top-2 logit gap at most twice the largest logit difference
    there), after which the sequences diverge and are not compared. Returns the steps compared."""
    (tok, logits), (tok_w, logits_w) = got, want
    for t in range(len(tok_w)):
        diff = (logits[t] - logits_w[t])
        assert (diff.norm() / logits_w[t].norm()).item() < 2e-2, f"{what}: step {t} logits differ"
        if tok[t] != tok_w[t]:
            top2 = logits_w[t].topk(2).values
            assert (top2[0] - top2[1]).item() <= 2 * diff.abs().max().item(), \
                f"{what}: step {t} token {int(tok[t])} instead of {int(tok_w[t])} at a clear margin"
            return t + 1
    return len(tok_w)


def test_left_padded_logits_and_packed_documents_on_triton():
    """bf16: a left-padded batch's logits and a packed batch's (cu_seq_lens kwargs, or position ids alone) match
    each prompt's own run (generation: the fp32 tests below)."""
    model = _llama()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=g).cuda() for n in (40, 17, 29)]
    ids, am = _left_padded(prompts)
    s = ids.shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(1) - 1).clamp(min=0)).logits
        for b, p in enumerate(prompts):
            alone = model(input_ids=p.unsqueeze(0)).logits[0].float()
            part = logits[b, s - len(p):].float()
            assert ((part - alone).norm() / alone.norm()).item() < 2e-2, b
        docs = torch.cat(prompts).unsqueeze(0)
        pos = torch.cat([torch.arange(len(p), device="cuda") for p in prompts]).unsqueeze(0)
        cu = torch.tensor([0, 40, 57, 86], dtype=torch.int32, device="cuda")
        packed = model(input_ids=docs, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=40,
                       max_length_k=40).logits[0].float()
        by_mask = model(input_ids=docs, position_ids=pos, use_cache=False).logits[0].float()
        for p, start in zip(prompts, cu[:-1].tolist()):
            alone = model(input_ids=p.unsqueeze(0)).logits[0].float()
            for got in (packed, by_mask):
                part = got[start:start + len(p)]
                assert ((part - alone).norm() / alone.norm()).item() < 2e-2


def test_left_padded_attention_is_each_sequence_alone_on_triton():
    fn = mx_hf.make_attention_function("triton")
    module = torch.nn.Module()
    module.is_causal = True
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, h, 70, 64, generator=g).cuda().bfloat16() for h in (8, 2, 2))
    pads = (0, 9, 33)
    keep = (torch.arange(70).unsqueeze(0) >= torch.tensor(pads).unsqueeze(1)).view(3, 1, 1, 70)
    mask = (keep & torch.ones(70, 70, dtype=torch.bool).tril()).cuda()
    out = fn(module, q, k, v, mask, scaling=0.125)[0]
    for b, pad in enumerate(pads):
        alone = mxattn.mxfp8_attention(*(t[b:b + 1, :, pad:].transpose(1, 2) for t in (q, k, v)),
                                       attn_mask_type="causal", softmax_scale=0.125, backend="triton")
        assert torch.equal(out[b:b + 1, pad:], alone) and not out[b, :pad].any(), b


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_batched_left_padded_generate_gives_each_prompt_its_own_tokens_on_triton(cache):
    """Batched greedy generation of left-padded prompts of different lengths (DynamicCache, and the static cache
    run eagerly) gives every prompt the tokens it gets generated alone. fp32 weights keep the GEMMs' batch-size-
    dependent rounding small; the attention itself is bit for bit each sequence's own call, so a token may only
    differ at a tie within that rounding (`_compare_greedy`), and nearly all steps are compared."""
    model = _llama(torch.float32)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 97, (n,), generator=g).cuda() for n in (40, 17, 29, 6)]
    ids, am = _left_padded(prompts)
    kw = dict(cache_implementation="static", disable_compile=True) if cache == "static" else {}
    n = 10
    with torch.no_grad():
        batched = _greedy(model, ids, am, n, **kw)
        compared = 0
        for b, p in enumerate(prompts):
            alone = _greedy(model, p.unsqueeze(0), torch.ones_like(p).unsqueeze(0), n, **kw)
            compared += _compare_greedy((batched[0][b], batched[1][b]), (alone[0][0], alone[1][0]), f"prompt {b}")
    assert compared >= 0.75 * n * len(prompts), compared


def test_compiled_left_padded_generate_equals_eager_on_triton():
    """transformers' compiled generation (static cache) on left-padded prompts: with CompileConfig(fullgraph=True)
    (any graph break raises) on aot_eager the tokens and logits equal eager generation's bit for bit; with the
    default configuration (inductor, CUDA graphs) they agree up to ties (`_compare_greedy`)."""
    from transformers import CompileConfig
    model = _llama(torch.float32)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 97, (n,), generator=g).cuda() for n in (33, 12, 20)]
    ids, am = _left_padded(prompts)
    kw = dict(cache_implementation="static")
    with torch.no_grad():
        eager = _greedy(model, ids, am, 8, disable_compile=True, **kw)
        torch._dynamo.reset()
        traced = _greedy(model, ids, am, 8, compile_config=CompileConfig(fullgraph=True, backend="aot_eager",
                                                                         mode=None), **kw)
        assert torch.equal(traced[0], eager[0]) and torch.equal(traced[1], eager[1])
        torch._dynamo.reset()
        default = _greedy(model, ids, am, 8, compile_config=CompileConfig(fullgraph=True), **kw)
    assert hasattr(model, "_compiled_call")
    compared = sum(_compare_greedy((default[0][b], default[1][b]), (eager[0][b], eager[1][b]), f"prompt {b}")
                   for b in range(len(prompts)))
    assert compared >= 0.75 * 8 * len(prompts), compared


@pytest.mark.parametrize("case", ["left_prefill", "left_decode", "left_static_decode", "right_decode"])
def test_compiled_attention_per_sequence_on_triton(case):
    """The attention function traced with fullgraph=True (device-side mask translation, rows gathered with
    static shapes, one padded triton call): output and gradients equal the eager function's (packed calls) bit
    for bit, and each sequence equals its own call."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask
    pads, q_len, kv_len, q_offset = {"left_prefill": ((0, 9, 33), 70, 70, 0), "left_decode": ((0, 9, 33), 1, 70, 69),
                                     "left_static_decode": ((0, 9, 33), 1, 96, 69),
                                     "right_decode": ((0, 0, 0), 1, 70, 69)}[case]
    j = torch.arange(kv_len).unsqueeze(0)
    keys = j >= torch.tensor(pads).unsqueeze(1)
    if case == "right_decode":                          # prompts of 60, 41, 13 tokens padded to 60, 10 new ones
        keys = (j < torch.tensor([60, 41, 13]).unsqueeze(1)) | (j >= 60)
    mask = sdpa_mask(batch_size=3, q_length=q_len, kv_length=kv_len, q_offset=q_offset,
                     mask_function=causal_mask_function, attention_mask=keys, allow_is_causal_skip=False).cuda()
    fn = mx_hf.make_attention_function("triton")
    module = torch.nn.Module()
    module.is_causal = True
    g = torch.Generator().manual_seed(7)
    q = torch.randn(3, 8, q_len, 64, generator=g).cuda().bfloat16()
    k, v = (torch.randn(3, 2, kv_len, 64, generator=g).cuda().bfloat16() for _ in range(2))
    do = torch.randn(3, q_len, 8, 64, generator=g).cuda().bfloat16()
    call = lambda q, k, v: fn(module, q, k, v, mask, scaling=0.125)[0]  # noqa: E731

    def run(f):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = f(*leaves)
        return (out,) + torch.autograd.grad(out, leaves, do)

    torch._dynamo.reset()
    eager, traced = run(call), run(torch.compile(call, fullgraph=True, backend="aot_eager"))
    for a, b in zip(traced, eager):
        assert torch.equal(a, b), case
    for b in range(3):
        rows = mask[b, 0].any(dim=1).nonzero().flatten()
        cols = mask[b, 0].any(dim=0).nonzero().flatten()
        alone = mxattn.mxfp8_attention(q[b:b + 1, :, rows].transpose(1, 2), k[b:b + 1, :, cols].transpose(1, 2),
                                       v[b:b + 1, :, cols].transpose(1, 2), attn_mask_type="causal_bottom_right",
                                       softmax_scale=0.125, backend="triton")
        assert torch.equal(traced[0][b, rows], alone[0]), (case, b)


def test_padding_free_training_each_document_as_its_own_call_on_triton():
    """A padding-free batch (one row, cu_seq_lens_q/k and max_length_q/k as DataCollatorWithFlattening(
    return_flash_attn_kwargs=True) passes them): the attention call's output and dQ, dK, dV of every document
    equal its own call bit for bit; through the model (fp32, training mode), each document's logits and the
    gradient reaching its input embeddings match its own forward and backward."""
    lengths = (70, 17, 129, 40)
    cu = torch.tensor([0, 70, 87, 216, 256], dtype=torch.int32, device="cuda")
    fn = mx_hf.make_attention_function("triton")
    module = torch.nn.Module()
    module.is_causal = True
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 8, 256, 64, generator=g).cuda().bfloat16().requires_grad_()
    k, v = (torch.randn(1, 2, 256, 64, generator=g).cuda().bfloat16().requires_grad_() for _ in range(2))
    do = torch.randn(1, 256, 8, 64, generator=g).cuda().bfloat16()
    out = fn(module, q, k, v, None, scaling=0.125, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=129,
             max_length_k=129)[0]
    grads = torch.autograd.grad(out, (q, k, v), do)
    for start, n in zip(cu[:-1].tolist(), lengths):
        parts = [t[:, :, start:start + n].detach().requires_grad_() for t in (q, k, v)]
        alone = mxattn.mxfp8_attention(*(t.transpose(1, 2) for t in parts), attn_mask_type="causal",
                                       softmax_scale=0.125, backend="triton")
        assert torch.equal(out[:, start:start + n], alone), start
        for g_all, g_alone in zip(grads, torch.autograd.grad(alone, parts, do[:, start:start + n])):
            assert torch.equal(g_all[:, :, start:start + n], g_alone), start
    model = _llama(torch.float32).train()
    docs = [torch.randint(3, 97, (n,), generator=g).cuda() for n in lengths]
    embed = model.get_input_embeddings()
    weights = torch.randn(256, 97, generator=g).cuda()

    def forward_backward(ids, pos, w, **kw):
        x = embed(ids).detach().requires_grad_()
        logits = model(inputs_embeds=x, position_ids=pos, use_cache=False, **kw).logits[0]
        (logits * w).sum().backward()
        return logits.detach(), x.grad[0]

    flat = forward_backward(torch.cat(docs).unsqueeze(0),
                            torch.cat([torch.arange(n, device="cuda") for n in lengths]).unsqueeze(0), weights,
                            cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=129, max_length_k=129)
    for d, start in zip(docs, cu[:-1].tolist()):
        n = len(d)
        alone = forward_backward(d.unsqueeze(0), torch.arange(n, device="cuda").unsqueeze(0),
                                 weights[start:start + n])
        for got, want in zip(flat, alone):
            part = got[start:start + n]
            assert ((part - want).norm() / want.norm()).item() < 2e-2, start


def test_generate_over_the_paged_mxfp8_cache_reads_the_pages_on_triton(monkeypatch):
    """MXFP8PagedCache on CUDA: every attention call of generate goes through the Triton paged step (no bf16
    copy of the cache), and each left-padded prompt's greedy tokens and logits agree with a bf16 DynamicCache
    under the same attention (the paged kernel's split-KV and 16-row decode tiles sum in another fp32 order)."""
    from transformers import DynamicCache

    from mxattn.integrations.hf_cache import MXFP8PagedCache, cache_kwargs
    from mxattn.runtime import paged_step
    model = _llama(torch.float32)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 97, (n,), generator=g).cuda() for n in (45, 12, 30)]
    ids, am = _left_padded(prompts)
    launches = []
    real = paged_step.paged_step
    monkeypatch.setattr(paged_step, "paged_step", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    cache = MXFP8PagedCache(max_cache_len=ids.shape[1] + 12, page_size=32)
    with torch.no_grad():
        got = _greedy(model, ids, am, 12, **cache_kwargs(cache))
        want = _greedy(model, ids, am, 12, **cache_kwargs(DynamicCache(config=model.config)))
    assert len(launches) == 2 * 12          # two layers, prefill + 11 decode steps
    assert [cache.layers[0].store.length(s) for s in cache.layers[0].slots] == [len(p) + 11 for p in prompts]
    for b in range(len(prompts)):
        assert _compare_greedy((got[0][b], got[1][b]), (want[0][b], want[1][b]), f"prompt {b}") >= 1
