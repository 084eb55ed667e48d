"""The Hugging Face integration on a CUDA GPU with the triton backend: left padding, decode steps after right
padding and padding-free batches run as packed calls; each sequence equals its own call."""

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


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg._attn_implementation = NAME
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).cuda().bfloat16().eval()


def test_left_padded_generate_and_packed_documents_on_triton():
    model = _llama()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=g).cuda() for n in (40, 17, 29)]
    s = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([p.new_zeros(s - len(p)), p]) for p in prompts])
    am = torch.stack([torch.cat([p.new_zeros(s - len(p)), torch.ones_like(p)]) for p in prompts])
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        # bf16 GEMMs of other batch sizes may round differently, so tokens are not compared here (the CPU test
        # does); the left-padded rows' logits are compared with each prompt's own
        assert model.generate(ids, attention_mask=am, **kw).shape == (3, s + 6)
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
