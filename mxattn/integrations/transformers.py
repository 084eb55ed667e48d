"""Hugging Face transformers: MXFP8 attention as an ``attn_implementation``.

>>> import mxattn.integrations.transformers as mx_hf
>>> mx_hf.register()                                   # name "mxfp8", backend "auto"
>>> model = AutoModel.from_pretrained(path, attn_implementation="mxfp8")

`register` adds one function to ``transformers.AttentionInterface`` and, under the same name, transformers'
boolean SDPA mask builder to ``AttentionMaskInterface`` (without the latter, transformers 5 hands a custom
attention function no mask at all). Every model whose attention goes through the attention interface then runs
`mxattn.mxfp8_attention`: q, k, v are read through strides as bshd, GQA stays GQA, the output has the inputs'
dtype.

Masks. mxattn masks are a diagonal band (causal, sliding window, bottom-right alignment) plus per-sequence key
lengths, so each HF mask is translated into TE mask words + ``cu_seqlens`` (and, for left padding, decode
steps and packed documents, row gathers) and the translation is *verified* against HF's mask before anything
runs: `mxattn.integrations.hf_masks` (`plan_attention_mask`, and `plan_attention_mask_traced` under
torch.compile) says what translates. Anything else raises `UnsupportedMaskError` saying what it found.

Query rows of right-padding tokens are computed as HF computes them (they attend the valid keys); they are not
zeroed, so outputs agree with eager/SDPA on every row that has a key.

Attention sinks (``s_aux``, gpt-oss) run as mxattn's learnable sink (`softmax_type="learnable"`). Padding-free
batches (``DataCollatorWithFlattening``: one row of packed sequences with the ``cu_seq_lens_q/k`` and
``max_length_q/k`` kwargs, as transformers hands flash attention) run as one packed (thd) call. With position
ids alone, transformers separates the documents only without a KV cache (``use_cache=False``); given a cache it
builds one causal mask over the row, and a one-time warning says the documents attend to each other.

MLA models (DeepSeek-V2/V3, ...: V narrower than Q and K) run with V at its own head dim where the backend takes
it (the reference backend); where the backend that runs the call takes one head dim (cudnn, triton: the first
usable one for backend "auto"), V is zero-padded to Q's head dim and O cut back: zero columns change no block
scale of V's own columns nor of dO, so O and the gradients are the same (bit for bit on the reference backend).
A V that arrives padded runs as it is.

Windows keep HF's meaning: the translation passes the diagonal it read off the mask (``bottom_right_diagonal``,
as Transformer Engine names it), so a bidirectional window of a padded batch stays top-left where HF's is.

Context parallelism: `set_context_parallel_group` records a torch.distributed group on a model's modules; the
attention function then runs `mxattn.context_parallel_attention` on this rank's shard of each sequence (causal
or full, sinks, GQA; the model's inputs sharded by the caller, as its docstring shows).

Not supported (raise ``NotImplementedError``): attention dropout in training, logit soft-capping, additive position
bias (T5-like), transformers' paged KV caches (continuous batching). mxattn's own paged MXFP8 cache
(`mxattn.integrations.hf_cache.MXFP8PagedCache`, eager generation) is read directly by this function.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ..attention import mxfp8_attention
from ..backends import check_backend_name
from ..context_parallel.api import attend_or_refuse
from ..context_parallel.checks import ContextParallelGroup, resolve_group
from ..recipe import Recipe, resolve_recipe
from ..tensor_cache import TensorValueCache
from .hf_masks import (MASKED_AT_OR_BELOW, MaskPlan, RowCompaction, RowGather,  # noqa: F401 -- re-exported
                       UnsupportedMaskError, plan_attention_mask, plan_attention_mask_traced)

#: names transformers treats specially (substring checks in `get_correct_attn_implementation` and friends)
_RESERVED_SUBSTRINGS = ("sdpa", "flash", "flex", "eager", "paged", "/", ":", "|")

#: the plans of the last few masks: a model hands the same mask tensor to every layer
_PLANS = TensorValueCache()


# --------------------------------------------------------------------------- the attention function


def _masks_registered(module) -> Optional[str]:
    """The module's attn_implementation when transformers has no mask builder for it (it then passes None)."""
    name = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if name is None:
        return None
    return None if name in _mask_functions() else name


_MASK_FUNCTIONS = []  # transformers' mask registry once imported (a list: no `global` statement for Dynamo)


def _mask_functions():
    """transformers' registry of mask builders by attn_implementation (imported once: a decode step asks per layer;
    kept in a module list rather than behind functools.lru_cache, which Dynamo warns about on every compile)."""
    if not _MASK_FUNCTIONS:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        _MASK_FUNCTIONS.append(ALL_MASK_ATTENTION_FUNCTIONS)
    return _MASK_FUNCTIONS[0]


def make_attention_function(backend: str = "auto", recipe: Optional[Recipe] = None):
    """An attention function with transformers' calling convention that runs `mxattn.mxfp8_attention` with
    `backend` and `recipe` (None: the default recipe; an `mxattn.Recipe` variant, checked here)."""
    check_backend_name(backend)
    recipe = resolve_recipe(recipe)
    try:  # the mask registry read now, not at a compiled model's first trace: Dynamo guards on the list being
        _mask_functions()  # empty there, so filling it inside the first trace recompiled the model at its second call
    except ImportError:
        pass  # (no transformers: the function is not called by transformers either)
    # what each call passes: None for the default, so a compiled model touches no Recipe object
    call_recipe = None if recipe.is_default else recipe

    def mxfp8_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                                scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                                sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                                s_aux: Optional[torch.Tensor] = None, position_bias: Optional[torch.Tensor] = None,
                                cache=None, **kwargs) -> Tuple[torch.Tensor, None]:
        """query [B, Hq, Sq, D], key [B, Hkv, Skv, D], value [B, Hkv, Skv, Dv] (transformers' layout; Dv may
        differ from D: MLA) -> ([B, Sq, Hq, Dv], None)."""
        if dropout and getattr(module, "training", True):
            raise NotImplementedError(
                f"mxattn MXFP8 attention has no attention dropout (got dropout={dropout} in training); set the "
                "config's attention dropout (attention_dropout / attention_probs_dropout_prob) to 0.0")
        if softcap is not None:
            raise NotImplementedError(f"mxattn MXFP8 attention has no logit soft-capping (softcap={softcap})")
        if position_bias is not None:
            raise NotImplementedError("mxattn MXFP8 attention cannot add a position bias to the logits")
        if cache is not None:
            raise NotImplementedError("mxattn MXFP8 attention does not read paged KV caches (continuous batching)")
        if kwargs.get("output_attentions", False):
            import warnings
            warnings.warn("mxattn MXFP8 attention returns no attention weights (output_attentions=True ignored)",
                          RuntimeWarning, stacklevel=2)
        if attention_mask is None:
            missing = _masks_registered(module)
            if missing is not None:
                raise RuntimeError(
                    f"attn_implementation {missing!r} has no entry in transformers' AttentionMaskInterface, so the "
                    "model built no mask and padding would be ignored; register it with "
                    "mxattn.integrations.transformers.register(name=...)")
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        cp = getattr(module, _CP_ATTRIBUTE, None)
        if cp is not None:         # this rank's shard of each sequence (`set_context_parallel_group`)
            return _context_parallel_call(cp, query, key, value, attention_mask, causal, scaling, sliding_window,
                                          s_aux, backend, call_recipe, kwargs), None
        paged = getattr(key, "_mxattn_paged_layer", None)
        if paged is not None:      # an MXFP8PagedCache layer's new tokens: its pages are read directly
            return _paged_cache_call(paged, query, key, value, attention_mask, causal, scaling, sliding_window,
                                     s_aux, backend, call_recipe), None
        batch, _, q_len, _ = query.shape
        kv_len = key.shape[2]
        # attention sinks (gpt-oss's s_aux: one logit per query head) are mxattn's learnable sink
        extra = dict(recipe=call_recipe) if s_aux is None else dict(
            softmax_type="learnable", softmax_offset=s_aux.float(), recipe=call_recipe)
        if kwargs.get("cu_seq_lens_q") is not None:
            plan = _plan_flattened(kwargs, batch, q_len, kv_len, causal, sliding_window)
        elif torch.compiler.is_compiling():
            plan = plan_attention_mask_traced(attention_mask, batch=batch, q_len=q_len, kv_len=kv_len,
                                              is_causal=causal, sliding_window=sliding_window)
        elif attention_mask is None:    # no values to read, nothing to cache (a decode step's usual case)
            plan = plan_attention_mask(None, batch=batch, q_len=q_len, kv_len=kv_len, is_causal=causal,
                                       sliding_window=sliding_window)
        else:
            plan = _PLANS.get((attention_mask,), (batch, q_len, kv_len, causal, sliding_window),
                              lambda: plan_attention_mask(attention_mask, batch=batch, q_len=q_len,
                                                          kv_len=kv_len, is_causal=causal,
                                                          sliding_window=sliding_window))
        if not (_MIXING_WARNED or torch.compiler.is_compiling()):
            _warn_if_documents_mix(kwargs, plan, q_len)
        if plan.kv_len is not None:
            key, value = key[:, :, :plan.kv_len], value[:, :, :plan.kv_len]
        if key.dtype != query.dtype or value.dtype != query.dtype:     # e.g. fp32 layer norms under PEFT
            key, value = key.to(query.dtype), value.to(query.dtype)
        if plan.gather is not None:
            out = _packed_call(plan, query, key, value, scaling, backend, extra)
        elif plan.rows is not None:
            out = _compacted_call(plan, query, key, value, scaling, backend, extra)
        elif plan.packed:          # padding-free batch: [1, H, T, D] with the sequences in cu_seqlens
            out = mxfp8_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                  qkv_format="thd", softmax_scale=scaling, backend=backend, **plan.kwargs(),
                                  **extra).unsqueeze(0)
        elif torch.compiler.is_compiling():  # (bshd: the ops promise O and the gradients dense in this order,
            # which the kernels write for transformers' projections: no copies in the graph)
            out = mxfp8_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                  qkv_format="bshd", softmax_scale=scaling, backend=backend, **plan.kwargs(),
                                  **extra)
        else:  # eagerly transformers' [B, H, S, D] as they are: the kernels get the same strides as through bshd
            # views, and O and the gradients stay as the kernels write them, with three view nodes fewer
            out = mxfp8_attention(query, key, value, qkv_format="bhsd", softmax_scale=scaling, backend=backend,
                                  **plan.kwargs(), **extra).transpose(1, 2)
        return out.contiguous(), None

    mxfp8_attention_forward.mxattn_backend = backend
    mxfp8_attention_forward.mxattn_recipe = recipe
    return mxfp8_attention_forward


#: set once the warning of `_warn_if_documents_mix` was given (a list: no `global` statement for Dynamo)
_MIXING_WARNED = []
#: whether a position_ids tensor restarts inside a row, read once per tensor (every layer gets the same one)
_RESTARTS = TensorValueCache()


def _warn_if_documents_mix(kwargs: dict, plan: MaskPlan, q_len: int) -> None:
    """Warn once when the position ids restart inside a batch row (packed documents) while the model was given
    a KV cache: transformers then detects no packing, so its mask (one causal band over the row) lets the
    documents attend to each other, as torch SDPA does with it. Read only for a plan with one band over whole
    rows (a padded or gathered plan has position ids of its own) and a cache (decode steps of one token have
    no row to restart in)."""
    if q_len < 2 or plan.packed or plan.gather is not None or plan.rows is not None or plan.cu_seqlens_q is not None:
        return
    if not (kwargs.get("use_cache") or kwargs.get("past_key_values") is not None
            or kwargs.get("past_key_value") is not None):
        return
    positions = kwargs.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape[-1] != q_len:
        return
    if _RESTARTS.get((positions,), q_len, lambda: bool((positions.diff(dim=-1) != 1).any())):
        _MIXING_WARNED.append(True)
        import warnings
        warnings.warn("mxattn: position_ids restart inside a batch row (packed documents) but the model was given "
                      "a KV cache, so transformers built one causal mask over the whole row and the documents "
                      "attend to each other (torch SDPA does the same); for padding-free training pass "
                      "use_cache=False to the model, or use DataCollatorWithFlattening(return_flash_attn_kwargs="
                      "True)", UserWarning, stacklevel=3)


def _paged_cache_call(layer, query, key, value, attention_mask, causal: bool, scaling, sliding_window, s_aux,
                      backend: str, recipe) -> torch.Tensor:
    """Attention of a step over an `MXFP8PagedCache` layer (`MXFP8PagedLayer.attend`): [B, Sq, Hq, D]."""
    if recipe is not None:
        raise NotImplementedError("MXFP8PagedCache runs the default recipe only (mxfp8_attention_with_kvcache); "
                                  "use transformers' DynamicCache with a recipe variant")
    if not causal:
        raise UnsupportedMaskError("MXFP8PagedCache serves causal decoders (generation); this module is not causal")
    softmax = {} if s_aux is None else dict(softmax_type="learnable", softmax_offset=s_aux.float())
    return layer.attend(query, key, value, attention_mask, scaling=scaling, sliding_window=sliding_window,
                        softmax_kwargs=softmax, backend=backend)


def _plan_flattened(kwargs: dict, batch: int, q_len: int, kv_len: int, causal: bool,
                    sliding_window: Optional[int]) -> MaskPlan:
    """A padding-free batch (transformers' DataCollatorWithFlattening): one row of concatenated sequences whose
    boundaries arrive as the cu_seq_lens_q / cu_seq_lens_k kwargs (and max_length_q / max_length_k), as for
    flash attention; each sequence attends only to itself (causal per sequence for a causal module). q_len,
    kv_len: the row's tokens, the bound of the longest sequence under torch.compile when max_length_q/k are
    not given (eagerly they are read off the cu_seq_lens)."""
    if batch != 1:
        raise UnsupportedMaskError(f"cu_seq_lens_q describes a padding-free batch, which is one row of packed "
                                   f"sequences; got batch {batch}")
    cu_q = kwargs["cu_seq_lens_q"]
    cu_k = kwargs.get("cu_seq_lens_k")
    cu_k = cu_q if cu_k is None else cu_k
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if torch.compiler.is_compiling():
        max_q, max_k = (bound if given is None else given for given, bound in ((max_q, q_len), (max_k, kv_len)))
    window = None
    if causal and sliding_window is not None and sliding_window > 0:
        window = (int(sliding_window) - 1, 0)
    elif sliding_window is not None and 0 < sliding_window < kv_len:
        # a bidirectional window as transformers hands flash attention one: sliding_window - 1 keys each side
        window = (int(sliding_window) - 1, int(sliding_window) - 1)
    return MaskPlan("padding_causal" if causal else "padding", window, cu_q.to(torch.int32), cu_k.to(torch.int32),
                    max_seqlen_q=None if max_q is None else int(max_q),
                    max_seqlen_kv=None if max_k is None else int(max_k), packed=True)


def _packed_call(plan: MaskPlan, query, key, value, scaling, backend, extra: dict) -> torch.Tensor:
    """The call of a `RowGather` plan: each sequence's rows gathered into a packed (thd) batch, O scattered
    back; query [B, Hq, Sq, D], key/value [B, Hkv, Skv, D] -> [B, Sq, Hq, D] (zeros on rows without a key).
    Differentiable (index_select / index_copy)."""
    b, hq, sq, d = query.shape
    flat = lambda x: x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])  # noqa: E731  [B*S, H, D]
    g = plan.gather
    q = flat(query).index_select(0, g.q_rows)
    k, v = (flat(t).index_select(0, g.kv_rows) for t in (key, value))
    o = mxfp8_attention(q, k, v, qkv_format="thd", softmax_scale=scaling, backend=backend, **plan.kwargs(),
                        **extra)
    out = o.new_zeros((b * sq, hq, o.shape[-1])).index_copy(0, g.q_rows, o)
    return out.view(b, sq, hq, o.shape[-1])


def _compacted_call(plan: MaskPlan, query, key, value, scaling, backend, extra: dict) -> torch.Tensor:
    """The call of a `RowCompaction` plan: each row's sequence gathered to the front of its row, one padded
    call, O gathered back; query [B, Hq, Sq, D], key/value [B, Hkv, Skv, D] -> [B, Sq, Hq, D] (zeros on rows
    without a key). Static shapes (torch.compile); differentiable (gather)."""
    rows = plan.rows

    def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:      # [B, H, S, D] -> bshd rows `index`
        x = x.transpose(1, 2)
        return torch.gather(x, 1, index.view(*index.shape, 1, 1).expand(-1, -1, x.shape[2], x.shape[3]))

    o = mxfp8_attention(take(query, rows.q_index), take(key, rows.kv_index), take(value, rows.kv_index),
                        qkv_format="bshd", softmax_scale=scaling, backend=backend, **plan.kwargs(), **extra)
    return torch.gather(o, 1, rows.q_back.view(*rows.q_back.shape, 1, 1).expand(-1, -1, o.shape[2], o.shape[3]))


def register(name: str = "mxfp8", backend: str = "auto", recipe: Optional[Recipe] = None) -> str:
    """Register MXFP8 attention with transformers under `name`; returns `name`.

    Afterwards ``from_pretrained(..., attn_implementation=name)``, ``config._attn_implementation = name`` before
    building a model, or ``model.set_attn_implementation(name)`` select it. backend: mxattn's backend ("auto",
    "cudnn", "triton", "reference"); recipe: None (the default recipe) or an `mxattn.Recipe` variant (which
    "auto" routes to a backend that runs it). Registering again replaces the function (e.g. to change the
    backend or the recipe; several names may be registered with different recipes).
    """
    if not isinstance(name, str) or not name or any(s in name for s in _RESERVED_SUBSTRINGS):
        raise ValueError(f"name must be a non-empty string without {_RESERVED_SUBSTRINGS} (transformers gives "
                         f"those a meaning of their own), got {name!r}")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:
        raise ImportError("mxattn.integrations.transformers needs transformers >= 5.0: pip install "
                          "'mxattn[hf]'") from exc
    function = make_attention_function(backend, recipe)
    AttentionInterface.register(name, function)
    # transformers' boolean SDPA masks (None where SDPA would use is_causal / no mask): what we translate above
    AttentionMaskInterface.register(name, _mask_builder(sdpa_mask))
    return name


def _mask_builder(sdpa_mask):
    """transformers' `sdpa_mask`, except that under torch.compile it also answers None (no mask) where it would
    in eager mode without reading a value: no padding mask, a plain causal or bidirectional pattern
    (`allow_is_causal_skip`: no cache that needs the mask, no packed sequences, no overlays), as many keys as
    queries or one query, and no sliding window that bites. transformers skips only in eager mode there (it
    cannot tell exporting from compiling on torch < 2.14), so a compiled model would otherwise hand every layer
    a dense [B, 1, Sq, Skv] mask, whose translation (`plan_attention_mask_traced`: checks, row gathers and their
    scatter-adds in the backward) costs far more than the attention it describes. The attention function reads
    None as SDPA reads it (`_plan_without_mask`)."""

    def mxattn_mask(*args, **kwargs):
        if not args and torch.compiler.is_compiling() and _skippable(**kwargs):
            return None
        return sdpa_mask(*args, **kwargs)

    mxattn_mask.__wrapped__ = sdpa_mask
    return mxattn_mask


#: what a size argument of the mask builders may be
_SIZE = (int, torch.SymInt)


def _skippable(kv_length=None, attention_mask=None, allow_is_causal_skip=True, local_size=None, q_length=None,
               q_offset=0, cache_position=None, **_) -> bool:
    """Whether `sdpa_mask`'s keyword arguments describe a mask the attention function rebuilds from None without
    reading a tensor's values (`_mask_builder`). Older transformers versions pass cache_position (a tensor of
    the query positions) where later ones pass q_length and q_offset. Sizes may be symbolic (dynamic shapes:
    the comparisons below then become guards)."""
    if not allow_is_causal_skip or attention_mask is not None or not isinstance(kv_length, _SIZE):
        return False
    if q_length is None:
        if cache_position is None:
            return False
        q_length = cache_position.shape[0]
    if isinstance(q_offset, torch.Tensor) or not isinstance(q_length, _SIZE):
        return False
    if local_size is not None and kv_length >= local_size:
        return False
    return q_length == 1 or q_length == kv_length


def unregister(name: str = "mxfp8") -> None:
    """Remove `name` from transformers' attention and mask interfaces (no error if absent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface._global_mapping.pop(name, None)
    AttentionMaskInterface._global_mapping.pop(name, None)


# --------------------------------------------------------------------------- context parallelism

#: the attribute `set_context_parallel_group` sets on a model's modules
_CP_ATTRIBUTE = "_mxattn_context_parallel"


def set_context_parallel_group(model: torch.nn.Module, cp_group, cp_global_ranks: Optional[Sequence[int]],
                               cp_stream=None, cp_comm_type: str = "p2p") -> None:
    """Run a transformers model's mxattn attention context-parallel over cp_group (Transformer Engine's
    `set_context_parallel_group`, for a whole model): every module carrying the model's config (its attention
    modules among them) records the group, and mxattn's attention function then runs
    `mxattn.context_parallel_attention` on this rank's shard of each sequence. cp_group None (cp_global_ranks
    then ignored) or of one rank: the ordinary path again.

    cp_global_ranks: cp_group's members' global ranks in group-rank order; cp_stream: a CUDA stream for the
    ring's transfers (None: the library's); cp_comm_type "p2p", "all_gather" or "a2a" (what each guarantees and
    takes: `context_parallel_attention`). The model's attn_implementation must be a name `register` gave, with
    the default recipe.

    The model then takes this rank's shard of every sequence in Transformer Engine's load-balanced layout (with
    cp ranks the sequence is cut into 2*cp chunks, rank r holding chunks r and 2*cp-1-r:
    `mxattn.context_parallel.shard_sequence`), S a multiple of 64*cp tokens. The caller shards:

    - input_ids [B, S] -> [B, S/cp];
    - position_ids: the tokens' positions in the whole sequence, sharded alike (RoPE needs the true positions);
    - the next-token labels, shifted on the whole sequence before sharding (a chunk's last label is the next
      chunk's first token), and the loss is reduced over the ranks: each rank's sum of per-token losses over the
      whole batch's token count, so the sum over the ranks is the whole batch's mean; then every parameter's
      gradient is summed over cp_group (as DDP over the group would);
    - attention_mask: an all-ones [B, S/cp], so that transformers reads no packed sequences off the position
      ids, which jump between a shard's two chunks (or use_cache=True, which also keeps it from looking).

    >>> cp, rank = dist.get_world_size(group), dist.get_rank(group)
    >>> set_context_parallel_group(model, group, dist.get_process_group_ranks(group), cp_comm_type="p2p")
    >>> labels = torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=-100)        # shifted, then sharded
    >>> positions = torch.arange(S).expand(B, S)
    >>> ids_l, pos_l, labels_l = (shard_sequence(t, cp, rank, seq_dim=1) for t in (input_ids, positions, labels))
    >>> logits = model(input_ids=ids_l, position_ids=pos_l, attention_mask=torch.ones_like(ids_l),
    ...                use_cache=False).logits
    >>> loss = F.cross_entropy(logits.flatten(0, 1).float(), labels_l.flatten(), ignore_index=-100,
    ...                        reduction="sum") / (labels != -100).sum()
    >>> loss.backward()
    >>> for p in model.parameters():
    ...     dist.all_reduce(p.grad, group=group)

    Under context parallelism the attention function takes no mask but the module's own band (None, or the plain
    causal mask transformers builds for a shard without padding), and raises ValueError naming attention_mask
    for any other (padding, packed documents) on every rank alike: padding is not carried through transformers
    here; `context_parallel_attention` takes padded and packed batches (cu_seqlens_q, qkv_format="thd"). A
    sliding_window runs where cp_comm_type takes it ("a2a"; causal windows under "all_gather"; none under "p2p",
    a window as long as the sequence excepted); learnable sinks (s_aux) run as softmax_offset, their gradient
    summed over the ranks like any parameter's.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    modules = [m for m in model.modules() if getattr(m, "config", None) is not None]
    record = resolve_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
    if record is not None:
        _check_mxattn_attention(modules)
    for m in modules:
        if record is None:
            m.__dict__.pop(_CP_ATTRIBUTE, None)
        else:
            m.__dict__[_CP_ATTRIBUTE] = record


def _check_mxattn_attention(modules) -> None:
    """Raise ValueError unless every attn_implementation of the modules' configs is an mxattn function with the
    default recipe (any other would run on this rank's tokens alone)."""
    from transformers import AttentionInterface
    names = {getattr(m.config, "_attn_implementation", None) for m in modules} - {None}
    if not names:
        raise ValueError("the model has no module with a transformers config naming an attn_implementation")
    for name in sorted(names, key=str):
        function = AttentionInterface._global_mapping.get(name) if isinstance(name, str) else None
        if getattr(function, "mxattn_backend", None) is None:
            raise ValueError(f"the model's attn_implementation {name!r} is not mxattn's: register() a name and build "
                             "the model with attn_implementation=name (or model.set_attn_implementation(name))")
        if not function.mxattn_recipe.is_default:
            raise ValueError(f"attn_implementation {name!r} runs recipe={function.mxattn_recipe}: context "
                             "parallelism runs the default recipe")


def _context_parallel_call(cp: ContextParallelGroup, query, key, value, attention_mask, causal: bool, scaling,
                           sliding_window, s_aux, backend: str, recipe, kwargs: dict) -> torch.Tensor:
    """The attention of this rank's shard: query [B, Hq, S/cp, D], key [B, Hkv, S/cp, D], value [B, Hkv, S/cp,
    Dv] (transformers' layout) -> [B, S/cp, Hq, Dv] through `context_parallel_attention` (bshd). This function's
    refusals travel in that call's own agreement over the group, so every rank raises alike."""
    q_len = query.shape[2]
    window = _context_parallel_window(sliding_window, causal, q_len * cp.size)
    error = _context_parallel_refusal(cp, attention_mask, query.shape[0], q_len, key.shape[2], causal,
                                      sliding_window, window, recipe, kwargs)
    if key.dtype != query.dtype or value.dtype != query.dtype:
        key, value = key.to(query.dtype), value.to(query.dtype)
    return attend_or_refuse(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), error, cp_group=cp.group,
        cp_global_ranks=cp.global_ranks, cp_comm_type=cp.comm_type, cp_stream=cp.stream, qkv_format="bshd",
        attn_mask_type="causal" if causal else "no_mask", window_size=window, softmax_scale=scaling,
        softmax_type="vanilla" if s_aux is None else "learnable",
        softmax_offset=None if s_aux is None else s_aux.float(), backend=backend)


def _context_parallel_window(sliding_window, causal: bool, seq_len: int) -> Optional[Tuple[int, int]]:
    """TE's window_size of the module's sliding_window over the whole sequence (None where it covers it)."""
    if sliding_window is None or not 0 < sliding_window < seq_len:
        return None
    return (int(sliding_window) - 1, 0) if causal else (int(sliding_window) - 1, int(sliding_window) - 1)


def _context_parallel_refusal(cp: ContextParallelGroup, attention_mask, batch: int, q_len: int, kv_len: int,
                              causal: bool, sliding_window, window, recipe, kwargs: dict) -> Optional[str]:
    """Why this rank cannot run the call context-parallel, or None."""
    if recipe is not None:
        return f"recipe={recipe}: context parallelism runs the default recipe"
    if kwargs.get("cu_seq_lens_q") is not None:
        return ("cu_seq_lens_q: a padding-free (packed) batch is not carried through transformers under context "
                "parallelism; run mxattn.context_parallel_attention with qkv_format='thd' and cu_seqlens_q")
    if kv_len != q_len:
        return (f"the keys ({kv_len} tokens) are not this rank's {q_len} query tokens: context parallelism runs "
                "each whole sequence in one forward, with no KV cache of earlier tokens")
    if window is not None and (cp.comm_type == "p2p" or (cp.comm_type == "all_gather" and not causal)):
        what = "a sliding window" if causal else "a bidirectional sliding window"
        use = "'all_gather' or 'a2a'" if causal else "'a2a'"
        return (f"sliding_window={sliding_window} is {what}, which cp_comm_type={cp.comm_type!r} cannot carry "
                f"(as in Transformer Engine); use cp_comm_type={use}")
    if attention_mask is None:
        return None
    try:
        plan = _PLANS.get((attention_mask,), (batch, q_len, kv_len, causal, sliding_window),
                          lambda: plan_attention_mask(attention_mask, batch=batch, q_len=q_len, kv_len=kv_len,
                                                      is_causal=causal, sliding_window=sliding_window))
        found = None if _plain(plan, causal) else "padding or packed sequences"
    except UnsupportedMaskError as exc:
        found = str(exc)
    if found is None:
        return None
    return (f"attention_mask: under context parallelism only the plain {'causal ' if causal else ''}mask (or "
            f"None) is taken, as this rank's tokens are two chunks of each sequence; got a mask with {found}. "
            "transformers builds one from a padding attention_mask, and, given no attention_mask and no cache, "
            "from position_ids that jump, as a shard's do between its chunks: pass attention_mask="
            "torch.ones_like(input_ids) with the shard's position_ids. Padding is not carried through transformers "
            "here; run mxattn.context_parallel_attention with a padding attn_mask_type and cu_seqlens_q")


def _plain(plan: MaskPlan, causal: bool) -> bool:
    """Whether a mask's plan is the module's band alone: no padding, sequences, gathers or cropped keys."""
    return (plan.attn_mask_type == ("causal" if causal else "no_mask") and plan.cu_seqlens_q is None
            and plan.cu_seqlens_kv is None and plan.gather is None and plan.rows is None and not plan.packed
            and plan.kv_len is None)


__all__ = ["MaskPlan", "UnsupportedMaskError", "make_attention_function", "plan_attention_mask", "register",
           "set_context_parallel_group", "unregister"]
