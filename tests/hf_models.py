"""Shared by the Hugging Face transformers integration tests in `tests/hf/`: tiny models built locally on CPU.

`_registered` (autouse, module scope) registers the "mxfp8" attention on the reference backend and a capturing
one ("mxfp8_capture") that records each attention call in CALLS; `_quiet` (autouse) silences the backend-choice
RuntimeWarning. A test module turns both on by importing them.
"""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mxattn.integrations import transformers as mx_hf  # noqa: E402
from transformers import (  # noqa: E402
    AttentionInterface, BertConfig, BertModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
    Qwen2Config, Qwen2ForCausalLM,
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


def deepseek_v3(qk_nope=64, qk_rope=32, v_head=64, heads=4):
    """A 2-layer DeepSeek-V3 (MLA; one dense layer, one MoE layer): Q and K of head dim qk_nope + qk_rope, V of
    v_head."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
                           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                           first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=qk_nope,
                           qk_rope_head_dim=qk_rope, v_head_dim=v_head, max_position_embeddings=64,
                           attention_dropout=0.0)
    return cfg, DeepseekV3ForCausalLM


def build(factory, attn="eager", seed=0):
    cfg, cls = factory()
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return cls(cfg).eval()


def main_output(out):
    return out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state


MODELS = {"bert": bert, "llama_gqa": llama, "qwen2_sliding_full": qwen2_mixed, "mistral_sliding": mistral_sliding}


def gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=8, max_position_embeddings=64,
                       layer_types=["sliding_attention", "full_attention"])
    return cfg, GptOssForCausalLM


def _hf_mask(lengths, q_len, kv_len, window=None, causal=True, q_offset=0):
    """HF's own boolean mask builder (what the models call)."""
    from transformers.masking_utils import (bidirectional_mask_function, causal_mask_function,
                                            sliding_window_causal_mask_function)
    fn = (sliding_window_causal_mask_function(window) if window else causal_mask_function) if causal \
        else bidirectional_mask_function
    pad = torch.arange(max(q_offset + q_len, kv_len)).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    return sdpa_mask(batch_size=len(lengths), q_length=q_len, kv_length=kv_len, q_offset=q_offset,
                     mask_function=fn, attention_mask=pad, allow_is_causal_skip=False, local_size=window)


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
