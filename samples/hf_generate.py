"""Batched greedy generation with a Hugging Face decoder swapped to MXFP8 attention, prompts left-padded.

    python samples/hf_generate.py                 # a small random-weight Llama (GQA) from a config, CPU or GPU
    python samples/hf_generate.py --model PATH    # a local checkpoint with its tokenizer (padding_side="left")

Each prompt is also generated alone; the sample prints the new tokens of both and whether they agree (they do,
token for token, on the reference backend: every sequence of a left-padded batch is computed as if alone).
"""

import argparse
import warnings

import torch

import mxattn.integrations.transformers as mx_hf


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="local checkpoint (AutoModelForCausalLM + AutoTokenizer)")
    ap.add_argument("--new-tokens", type=int, default=12, help="greedy tokens per prompt (default 12)")
    ap.add_argument("--backend", default="auto", help="mxattn backend (auto, cudnn, triton, reference)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="mxattn: backend='auto'")
    name = mx_hf.register("mxfp8", backend=args.backend)
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
        tok.pad_token = tok.pad_token or tok.eos_token
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=name).to(args.device).eval()
        texts = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]
        batch = tok(texts, return_tensors="pt", padding=True).to(args.device)
        prompts = [tok(t, return_tensors="pt").input_ids[0].to(args.device) for t in texts]
        pad_id = tok.pad_token_id
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
        cfg._attn_implementation = name
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(args.device).eval()
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(5, 512, (n,), generator=g).to(args.device) for n in (37, 12, 25)]
        s = max(len(p) for p in prompts)
        ids = torch.stack([torch.cat([p.new_zeros(s - len(p)), p]) for p in prompts])     # left padding
        mask = torch.stack([torch.cat([p.new_zeros(s - len(p)), torch.ones_like(p)]) for p in prompts])
        batch, pad_id = dict(input_ids=ids, attention_mask=mask), 0
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=pad_id)
    with torch.no_grad():
        batched = model.generate(**batch, **kw)[:, batch["input_ids"].shape[1]:]
        same = 0
        for i, p in enumerate(prompts):
            alone = model.generate(p.unsqueeze(0), attention_mask=torch.ones_like(p).unsqueeze(0), **kw)[0, len(p):]
            same += int(torch.equal(alone, batched[i]))
            print(f"prompt {i} ({len(p)} tokens): batched {batched[i].tolist()}")
            print(f"{'':>{len(str(i)) + 7}} ({len(p)} tokens): alone   {alone.tolist()}")
    print(f"{same} of {len(prompts)} prompts got the same tokens batched (left-padded) as alone")


if __name__ == "__main__":
    main()
