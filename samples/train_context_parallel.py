"""Train a small decoder whose attention runs context-parallel in MXFP8, launched with torchrun.

Each rank holds two chunks of every sequence, Transformer Engine's load balancing for causal attention: with cp
ranks the sequence is cut into 2*cp chunks and rank r holds chunks r and 2*cp-1-r
(`mxattn.context_parallel.shard_sequence`). Embeddings, norms and MLPs work token by token, so only the attention
layers talk to the other ranks: each `mxattn.DotProductAttention` gets the group through
`set_context_parallel_group` (cp_comm_type "p2p", "all_gather" or "a2a"). Every rank computes the loss of its own
tokens over the whole batch's token count; the ranks' parameter gradients are summed (as data parallelism
averages them), which gives each rank the whole sequence's gradient.

    torchrun --nproc-per-node 2 samples/train_context_parallel.py                      # CPU processes, gloo
    torchrun --nproc-per-node 4 samples/train_context_parallel.py --device cuda --seq 16384 --comm-type a2a

With --check (default on) rank 0 also runs the same model unsharded on the whole sequences at the first step and
prints both losses: they agree to the MXFP8 merge's rounding. Prints the loss every --log-every steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:
    import mxattn
except ImportError:  # running from a source checkout without `pip install -e .`: use the repo's copy
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import mxattn
from mxattn.context_parallel import shard_sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import VOCAB_SIZE, get_batch, load_stdlib_bytes  # noqa: E402


class Block(nn.Module):
    """Pre-LN decoder block with MXFP8 causal attention. forward(x [b, s, dim]) -> [b, s, dim] (s: the local
    tokens when the attention is context-parallel)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, backend: str):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.attn = mxattn.DotProductAttention(heads, self.head_dim, num_gqa_groups=kv_heads, qkv_format="bshd",
                                               attn_mask_type="causal", backend=backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.ln1(x)
        q = self.q(h).to(torch.bfloat16).view(b, s, self.heads, self.head_dim)
        k, v = self.kv(h).to(torch.bfloat16).view(b, s, 2, self.kv_heads, self.head_dim).unbind(dim=2)
        x = x + self.proj(self.attn(q, k, v).to(x.dtype))
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    """Byte-level decoder. forward(idx [b, s] int64, positions [s] int64: the tokens' places in the whole
    sequence) -> logits [b, s, VOCAB_SIZE] float32."""

    def __init__(self, layers: int, dim: int, heads: int, kv_heads: int, max_seq: int, backend: str):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB_SIZE, dim)
        self.pos_emb = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, backend) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB_SIZE, bias=False)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)).float()

    def set_context_parallel_group(self, group, ranks, comm_type: str, stream=None) -> None:
        """Make every attention layer context-parallel over `group` (global ranks `ranks`)."""
        for block in self.blocks:
            block.attn.set_context_parallel_group(group, ranks, cp_stream=stream, cp_comm_type=comm_type)


def token_loss_sum(model: Decoder, x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Sum of the next-byte cross-entropies of the tokens given (fp32 scalar)."""
    logits = model(x, positions)
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), y.reshape(-1), reduction="sum")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--comm-type", choices=("p2p", "all_gather", "a2a"), default="p2p")
    p.add_argument("--backend", default="auto", help="mxattn backend of the attention calls (default auto)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=512,
                   help="whole-sequence length; 2 * ranks chunks of it must each be a multiple of 32 tokens")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the unsharded comparison at the first step")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("launch with torchrun, e.g. torchrun --nproc-per-node 2 samples/train_context_parallel.py")
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group, ranks = dist.group.WORLD, list(range(world))
    try:
        torch.manual_seed(args.seed)  # the same weights on every rank
        model = Decoder(args.layers, args.dim, args.heads, args.kv_heads, args.seq, args.backend).to(device)
        reference = None
        if args.check and rank == 0:
            reference = Decoder(args.layers, args.dim, args.heads, args.kv_heads, args.seq, args.backend).to(device)
            reference.load_state_dict(model.state_dict())
        model.set_context_parallel_group(group, ranks, args.comm_type)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        data = load_stdlib_bytes(1 << 21)
        gen = torch.Generator().manual_seed(args.seed + 1)  # the same batches on every rank
        positions = shard_sequence(torch.arange(args.seq, device=device), world, rank, seq_dim=0)
        tokens = args.batch * args.seq
        start = time.perf_counter()
        for step in range(args.steps):
            x, y = get_batch(data, args.batch, args.seq, gen, device)
            x_local, y_local = (shard_sequence(t, world, rank, seq_dim=1) for t in (x, y))
            loss = token_loss_sum(model, x_local, y_local, positions) / tokens
            loss.backward()
            for p in model.parameters():  # each rank holds its tokens' share of every parameter's gradient
                dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            dist.all_reduce(total)
            if reference is not None and step == 0:
                with torch.no_grad():
                    whole = token_loss_sum(reference, x, y, torch.arange(args.seq, device=device)) / tokens
                print(f"step 0: context-parallel loss {total.item():.6f}, unsharded {whole.item():.6f}, "
                      f"difference {abs(total.item() - whole.item()):.2e}", flush=True)
            if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {total.item():.4f}  ({args.comm_type} over {world} ranks, "
                      f"{time.perf_counter() - start:.1f} s)", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
