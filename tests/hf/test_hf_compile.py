"""The Hugging Face integration under torch.compile: the registered attention function traced with
fullgraph=True on HF's masks (the translation runs on the device) and compiled transformers models (training,
decode steps, compiled generation, padding-free batches) equal eager bit for bit, without graph breaks."""

import os
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import mxattn  # noqa: E402
from mxattn.integrations import hf_masks  # noqa: E402
from mxattn.integrations import transformers as mx_hf  # noqa: E402
from transformers import DynamicCache  # noqa: E402
from transformers.masking_utils import sdpa_mask  # noqa: E402
from mxattn.integrations.hf_cache import cache_kwargs  # noqa: E402
from hf_models import NAME, VOCAB, _attention_call, _hf_mask, batch, build, llama, rel_rms  # noqa: E402
from hf_models import _quiet, _registered  # noqa: E402,F401  (autouse fixtures: importing turns them on)


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


def test_compiled_model_without_a_mask_does_not_recompile_in_a_fresh_process(monkeypatch):
    """Training a compiled model on unpadded batches (no attention_mask: the attention function then checks that
    transformers has a mask builder for its name) compiles once. In a fresh process transformers' mask registry
    had not been read before the first trace, which read it and so changed what the trace guarded on: the second
    step recompiled the whole model."""
    monkeypatch.setattr(mx_hf, "_MASK_FUNCTIONS", [])               # as after `import mxattn` in a new process
    mx_hf.register(NAME, backend="reference")
    model = build(llama, attn=NAME).train()
    torch._dynamo.reset()
    compiled = torch.compile(model)

    def step(seed):
        ids, _ = batch(lengths=(12, 12), seed=seed)
        compiled(input_ids=ids, labels=ids).loss.backward()

    step(0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        step(1)
        step(2)


@pytest.mark.parametrize("factory", ["gpt2", "llama"])
def test_compiled_training_gradients_equal_eager(factory):
    """Training steps of a compiled transformers model (GPT-2's fused QKV projection, a GQA Llama) give the eager
    model's loss and gradients. Inductor may hand the attention op K and V in other strides at run time than
    Dynamo traced above it, so what the forward keeps for the backward must not be laid out from traced strides
    (`mxattn.runtime.saved_block`: a layout from shapes alone; laid out from the traced strides, the backward read the
    block wrongly and such a model trained to nonsense)."""
    def gpt2():
        from transformers import GPT2Config, GPT2LMHeadModel
        return GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=128, n_layer=2, n_head=4, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0), GPT2LMHeadModel

    model = build(gpt2 if factory == "gpt2" else llama, attn=NAME).train()
    ids, _ = batch(lengths=(20, 20))
    torch._dynamo.reset()
    compiled = torch.compile(model)
    for step in range(3):
        ids, _ = batch(lengths=(20, 20), seed=step)
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        expected = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        got = compiled(input_ids=ids, labels=ids).loss
        got.backward()
        assert abs(got.item() - loss.item()) < 1e-4 * abs(loss.item())
        for p, e in zip(model.parameters(), expected):
            assert rel_rms(p.grad, e) < 1e-2, step


def test_compiling_a_model_raises_no_warning_about_mxattn_code():
    """torch.compile of a model with the registered attention: Dynamo says nothing about mxattn's code (it warned
    on every compile about a functools.lru_cache-wrapped helper that the attention function calls when a model
    hands it no mask)."""
    package = os.path.dirname(mxattn.__file__)
    ours = {name for _dir, _sub, files in os.walk(package) for name in files if name.endswith(".py")}
    model = build(llama, attn=NAME)
    ids, am = batch()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        compiled(input_ids=ids, attention_mask=am)      # a padded batch: the model's mask
        compiled(input_ids=ids)                          # no padding: no mask
    about_ours = [str(w.message) for w in caught
                  if w.filename.startswith(package) or set(re.findall(r"([\w.]+\.py):\d+", str(w.message))) & ours]
    assert not about_ours, about_ours


def _traced_targets(model, **inputs):
    """(the model's output under torch.compile with fullgraph=True, the names of every op in Dynamo's graphs)."""
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, backend=keep_graph, fullgraph=True)(**inputs)
    return out, {str(n.target) for gm in graphs for n in gm.graph.nodes}


def test_compiled_model_without_padding_translates_no_mask():
    """transformers builds the causal mask of a batch without padding only eagerly-skipped (under torch.compile it
    hands every layer a dense mask); mxattn's mask builder answers None there as in eager mode, so the compiled
    model has no mask translation in its graph (no row gathers, no device-side checks) and equals eager bit for
    bit. With padding the mask still arrives and is translated on the device."""
    model = build(llama, attn=NAME)
    ids, am = batch(lengths=(20, 20, 20))
    out, targets = _traced_targets(model, input_ids=ids)
    assert not any("gather" in t or "_assert_async" in t for t in targets), sorted(targets)
    assert torch.equal(out.logits, model(input_ids=ids).logits)
    ids, am = batch()
    out, targets = _traced_targets(model, input_ids=ids, attention_mask=am)
    assert any("_assert_async" in t for t in targets)
    valid = am.bool()
    assert torch.equal(out.logits[valid], model(input_ids=ids, attention_mask=am).logits[valid])


@pytest.mark.parametrize("kwargs,skips", [
    (dict(q_length=9, kv_length=9), True),                          # training batch, no padding
    (dict(q_length=1, kv_length=12, q_offset=11), True),            # decode step over a dynamic cache
    (dict(q_length=4, kv_length=12, q_offset=8), False),            # chunked prefill: the band needs the mask
    (dict(q_length=9, kv_length=9, attention_mask=torch.ones(2, 9, dtype=torch.bool)), False),   # padding mask
    (dict(q_length=9, kv_length=9, allow_is_causal_skip=False), False),      # packed sequences, static caches
    (dict(q_length=1, kv_length=12, q_offset=torch.tensor(11)), False),     # a static cache's traced offset
    (dict(q_length=9, kv_length=9, local_size=4), False),           # a window that bites
    (dict(q_length=9, kv_length=9, local_size=16), True),           # one that cannot
    (dict(cache_position=torch.arange(9), kv_length=9), True),      # older transformers' arguments
    (dict(cache_position=torch.arange(8, 12), kv_length=12), False),
])
def test_mask_builder_skips_under_compile_only_what_none_describes(kwargs, skips):
    """mxattn's mask builder under torch.compile answers None (no mask) exactly where transformers' eager rule
    would, without reading values, whatever transformers itself does while compiling (here: a builder that
    always builds); eagerly it is transformers' builder."""
    built = torch.ones(1, dtype=torch.bool)
    builder = mx_hf._mask_builder(lambda **kw: built)
    compiled = torch.compile(lambda: builder(batch_size=2, **kwargs), backend="eager", fullgraph=True)
    torch._dynamo.reset()
    assert (compiled() is None) == skips
    assert builder(batch_size=2, **kwargs) is built


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
    logits = [model(input_ids=ids, attention_mask=am, position_ids=pos, **cache_kwargs(cache), use_cache=True)
              .logits[:, -1:]]
    for _ in range(steps):
        nxt = logits[-1][:, -1].argmax(-1, keepdim=True)
        am = torch.cat([am, torch.ones_like(nxt)], dim=1)
        logits.append(forward(input_ids=nxt, attention_mask=am, position_ids=am.sum(1, keepdim=True) - 1,
                              **cache_kwargs(cache), use_cache=True).logits)
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
