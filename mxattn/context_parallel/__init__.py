"""Context parallelism for MXFP8 attention on torch.distributed, with Transformer Engine's semantics: the
sequence split over the ranks of a group in TE's load-balanced layout (`shard_sequence`; dense, padded and packed
thd batches), and three ways of attending across it (`context_parallel_attention`'s cp_comm_type: "p2p",
"all_gather", "a2a")."""

from .api import context_parallel_attention
from .checks import COMM_TYPES
from .layout import shard_sequence, unshard_sequence

__all__ = ["COMM_TYPES", "context_parallel_attention", "shard_sequence", "unshard_sequence"]
