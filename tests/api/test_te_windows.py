"""Masks and sliding windows mean what they mean in Transformer Engine, checked against an oracle written from TE's
own definitions, not from mxattn's code (`tests/te_oracle.py`):

* the window TE runs, its warnings and errors: ``check_set_window_size`` in
  transformer_engine/pytorch/attention/dot_product_attention/utils.py;
* the diagonal: ``DotProductAttention.forward``'s ``bottom_right_diagonal`` resolution (top-left for ``causal`` and
  ``padding_causal``, bottom-right for the ``*_bottom_right`` types, the argument otherwise, None = bottom-right);
* the keys: the ``window_size`` docstring, query i attends keys in ``[i + sk - sq - left, i + sk - sq + right]``
  (bottom-right; ``[i - left, i + right]`` top-left, as ``get_full_mask`` builds it), per sequence with its own
  lengths in a padded or packed batch, -1 = unbounded.

The probe reads which keys a row attended off the output: Q = 0 gives every allowed key the same weight and V is
one-hot per key, so O[i, j] > 0 exactly where query i attended key j (rows without a key give O = 0); with dO
one-hot per query, dV[j, i] > 0 exactly where query i attended key j (the backward's band). The same tests run the
triton backend on a CUDA GPU (marked gpu).
"""

import random
import warnings

import pytest
import torch

import mxattn
from mxattn import mask as mask_module
from te_oracle import TYPES, WINDOWS, te_bottom_right, te_keep, te_window

D = 128  # one-hot V over at most D keys, one-hot dO over at most D queries

BACKENDS = [pytest.param(("reference", "cpu"), id="reference"),
            pytest.param(("triton", "cuda"), id="triton", marks=pytest.mark.gpu)]


# --------------------------------------------------------------------------- the probe

def _one_hot(n, d, device):
    return torch.eye(n, d, device=device)


class Probe:
    """Inputs of one layout with the expected [rows, keys] keep matrix (rows and keys in the tensors' own
    coordinates: batch row b's query i, key j; packed: the token indices), and the call's length arguments."""

    def __init__(self, layout, lens_q, lens_kv, device, rows_q=None, rows_kv=None):
        self.layout, self.lens_q, self.lens_kv = layout, list(lens_q), list(lens_kv)
        cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(),  # noqa: E731
                                       dtype=torch.int32, device=device)
        self.kwargs = {}
        if layout == "packed":
            tq, tkv = sum(lens_q), sum(lens_kv)
            self.q = torch.zeros(tq, 1, D, device=device)
            self.k = torch.randn(tkv, 1, D, device=device)
            self.v = _one_hot(tkv, D, device).unsqueeze(1)
            self.do = _one_hot(tq, D, device).unsqueeze(1)
            self.kwargs = dict(qkv_format="thd", cu_seqlens_q=cu(lens_q), cu_seqlens_kv=cu(lens_kv))
        else:
            b = len(lens_q)
            sq, skv = rows_q or max(lens_q), rows_kv or max(lens_kv)
            self.q = torch.zeros(b, sq, 1, D, device=device)
            self.k = torch.randn(b, skv, 1, D, device=device)
            self.v = _one_hot(skv, D, device).view(1, skv, 1, D).repeat(b, 1, 1, 1)
            self.do = _one_hot(sq, D, device).view(1, sq, 1, D).repeat(b, 1, 1, 1)
            if layout == "padded":
                self.kwargs = dict(cu_seqlens_q=cu(lens_q), cu_seqlens_kv=cu(lens_kv))

    def expected(self, window, bottom_right):
        """[B, Sq, Skv] (packed: [1, T_q, T_kv]) bool keep of the whole tensors."""
        if self.layout == "packed":
            out = torch.zeros(1, sum(self.lens_q), sum(self.lens_kv), dtype=torch.bool)
            q0 = kv0 = 0
            for lq, lkv in zip(self.lens_q, self.lens_kv):
                out[0, q0:q0 + lq, kv0:kv0 + lkv] = te_keep(lq, lkv, window, bottom_right)
                q0, kv0 = q0 + lq, kv0 + lkv
            return out
        b, sq, skv = self.q.shape[0], self.q.shape[1], self.k.shape[1]
        out = torch.zeros(b, sq, skv, dtype=torch.bool)
        for i, (lq, lkv) in enumerate(zip(self.lens_q, self.lens_kv)):
            out[i, :lq, :lkv] = te_keep(lq, lkv, window, bottom_right)
        return out

    def attended(self, backend, backward=False, **kw):
        """([B, Sq, Skv] keys the forward attended, and the same read off dV when backward)."""
        q, v = self.q, self.v.clone().requires_grad_(backward)
        o = mxattn.mxfp8_attention(q, self.k, v, backend=backend, **self.kwargs, **kw)
        n_kv = self.v.shape[-3]
        fwd = o[..., 0, :n_kv].detach().float().cpu() > 0
        if not backward:
            return (fwd.unsqueeze(0) if self.layout == "packed" else fwd), None
        o.backward(self.do.to(o.dtype))
        n_q = self.do.shape[-3]
        bwd = v.grad[..., 0, :n_q].float().cpu().transpose(-1, -2) > 0           # dV[j, i] -> [i, j]
        if self.layout == "packed":
            fwd, bwd = fwd.unsqueeze(0), bwd.unsqueeze(0)
        return fwd, bwd


def _lengths(rng, layout, shape):
    """Per-sequence (lens_q, lens_kv) with S_q < S_kv, S_q > S_kv or equal ("lt", "gt", "eq"), within D."""
    batch = 1 if layout == "dense" else 3
    limit = D // batch if layout == "packed" else 48
    lens_q, lens_kv = [], []
    for _ in range(batch):
        a, b = sorted(rng.sample(range(1, limit + 1), 2))
        lq, lkv = {"lt": (a, b), "gt": (b, a), "eq": (b, b)}[shape]
        if layout != "dense" and rng.random() < 0.3:   # sequences of their own shapes inside one batch
            lq, lkv = lkv, lq
        lens_q.append(lq)
        lens_kv.append(lkv)
    return lens_q, lens_kv


def _check_call(probe, backend, mask_type, window, diagonal, backward):
    """Run one (mask type, window, bottom_right_diagonal) on the probe and compare with the oracle; TE's warning
    and error too."""
    rule = te_window(mask_type, window)
    mask_module._WARNED_WINDOWS.clear()                      # (the warning comes once per combination)
    kw = dict(attn_mask_type=mask_type, window_size=window, bottom_right_diagonal=diagonal)
    what = (probe.layout, probe.lens_q, probe.lens_kv, mask_type, window, diagonal)
    if rule is None:
        with pytest.raises(ValueError, match="window_size"):
            probe.attended(backend, **kw)
        return
    used, warns = rule
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fwd, bwd = probe.attended(backend, backward, **kw)
    te_warnings = [w for w in caught if "window_size should be" in str(w.message)]
    assert len(te_warnings) == (1 if warns else 0), what
    expected = probe.expected(used, te_bottom_right(mask_type, diagonal))
    assert torch.equal(fwd, expected), what
    if backward:
        assert torch.equal(bwd, expected), what


#: one test per window, so that parallel workers share a backend's kernel builds
WINDOW_PARAMS = [pytest.param(w, id="none" if w is None else f"{w[0]}_{w[1]}") for w in WINDOWS]


@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("window", WINDOW_PARAMS)
@pytest.mark.parametrize("shape", ["lt", "gt", "eq"])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "causal_bottom_right"])
def test_dense_windows_attend_the_keys_te_attends(backend_device, window, shape, mask_type):
    """Every window (left, right in -1, 0, 1, 16) and bottom_right_diagonal (None, True, False) of a dense call
    with S_q < S_kv, S_q > S_kv and S_q == S_kv: the keys each row attends (forward and backward) are TE's, TE's
    warnings come (once) where TE warns, ValueError where TE asserts."""
    backend, device = backend_device
    rng = random.Random(f"dense-{shape}-{mask_type}")
    torch.manual_seed(0)
    for _ in range(2):
        lens_q, lens_kv = _lengths(rng, "dense", shape)
        probe = Probe("dense", lens_q, lens_kv, device)
        for diagonal in (None, True, False):
            _check_call(probe, backend, mask_type, window, diagonal, backward=window in (None, (16, 1), (1, 16)))


@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("window", WINDOW_PARAMS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_padded_and_packed_windows_align_per_sequence(backend_device, window, layout, mask_type):
    """Padded (bshd + cu_seqlens, rows past each length) and packed (thd) batches whose sequences have their own
    query and key counts (fewer, more or as many queries as keys): each sequence's rows attend TE's keys of that
    sequence, aligned with its own lengths; padding rows attend nothing."""
    backend, device = backend_device
    rng = random.Random(f"{layout}-{mask_type}")
    torch.manual_seed(1)
    for shape in ("lt", "gt", "eq"):
        lens_q, lens_kv = _lengths(rng, layout, shape)
        pad = dict(rows_q=max(lens_q) + 3, rows_kv=max(lens_kv) + 5) if layout == "padded" else {}
        probe = Probe(layout, lens_q, lens_kv, device, **pad)
        for diagonal in (None, True, False):
            _check_call(probe, backend, mask_type, window, diagonal, backward=window in ((16, 1), (0, 16)))


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_the_issues_example(backend_device):
    """S_q = 5, S_kv = 12, window (2, 1): TE and FlashAttention attend keys 5..8 from row 0 (bottom-right);
    bottom_right_diagonal=False asks for TE's top-left window, keys 0..1."""
    backend, device = backend_device
    probe = Probe("dense", [5], [12], device)
    fwd, _ = probe.attended(backend, window_size=(2, 1))
    assert fwd[0, 0].nonzero().flatten().tolist() == [5, 6, 7, 8]
    fwd, _ = probe.attended(backend, window_size=(2, 1), bottom_right_diagonal=False)
    assert fwd[0, 0].nonzero().flatten().tolist() == [0, 1]
    fwd, _ = probe.attended(backend, attn_mask_type="padding", window_size=(2, 1),
                            cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32, device=device),
                            cu_seqlens_kv=torch.tensor([0, 12], dtype=torch.int32, device=device))
    assert fwd[0, 0].nonzero().flatten().tolist() == [5, 6, 7, 8]


def test_te_rules_warn_once_per_combination_and_name_the_argument():
    """TE's warnings come once per (mask type, window) however often it is called; its errors are ValueErrors
    that name window_size and the rule; bottom_right_diagonal must be None or a bool."""
    mask_module._WARNED_WINDOWS.clear()
    q = torch.randn(1, 8, 1, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            mxattn.mxfp8_attention(q, q, q, attn_mask_type="causal", window_size=(4, 2), backend="reference")
            mxattn.mxfp8_attention(q, q, q, window_size=(-1, 0), backend="reference")
    messages = [str(w.message) for w in caught if "window_size should be" in str(w.message)]
    assert len(messages) == 2
    assert "attn_mask_type='causal'" in messages[0] and "(4, 0)" in messages[0]
    assert "attn_mask_type='no_mask'" in messages[1] and "(-1, -1)" in messages[1]
    for mask_type, window in (("causal", (-1, 3)), ("no_mask", (5, -1)), ("no_mask", (-1, 5)),
                              ("padding_causal_bottom_right", (-1, 16)), ("no_mask", (-2, 3))):
        with pytest.raises(ValueError, match=r"window_size"):
            mask_module.resolve_mask(mask_type, window)
    with pytest.raises(TypeError, match="bottom_right_diagonal"):
        mxattn.mxfp8_attention(q, q, q, window_size=(2, 2), bottom_right_diagonal="bottom_right",
                               backend="reference")


def test_the_rules_table_matches_te_for_every_window():
    """`mxattn.mask.te_window` and `resolve_mask` against the oracle for every mask type, window (left, right in
    -1, 0, 1, 16, and None) and bottom_right_diagonal: the window TE runs as cuDNN's band (left + 1, right), the
    alignment (a band without bounds, or one whose every sequence has S_q == S_kv, is sent top-left: the same
    keys)."""
    for mask_type in TYPES:
        for window in WINDOWS:
            rule = te_window(mask_type, window)
            for diagonal in (None, True, False):
                if rule is None:
                    with pytest.raises(ValueError):
                        mask_module.resolve_mask(mask_type, window, diagonal)
                    continue
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    band, padding = mask_module.resolve_mask(mask_type, window, diagonal)
                    same = mask_module.resolve_mask(mask_type, window, diagonal, equal_lengths=True).band
                (left, right), _ = rule
                assert padding == mask_type.startswith("padding")
                assert (band.left_bound, band.right_bound) == (None if left == -1 else left + 1,
                                                               None if right == -1 else right)
                bounded = (left, right) != (-1, -1)
                br = te_bottom_right(mask_type, diagonal) and bounded
                assert band.diagonal_alignment == ("bottom_right" if br else "top_left"), (mask_type, window)
                causal_type = "causal" in mask_type
                assert same.diagonal_alignment == ("bottom_right" if br and causal_type else "top_left")


def test_equal_lengths_send_the_same_band_top_left_and_plans_keep_them_apart():
    """A no_mask window with S_q == S_kv is sent top-left (the same keys; cuDNN refuses fewer top-left bands), one
    with S_q != S_kv bottom-right; a dense call's plan, which serves every KV length, keeps the two apart."""
    from mxattn import attention as attention_module
    from mxattn.layouts import to_bhsd

    def band(sq, skv, **kw):
        q, k = torch.zeros(1, sq, 1, 32), torch.zeros(1, skv, 1, 32)
        args, _ = attention_module.encode_call(
            to_bhsd(q, "bshd"), to_bhsd(k, "bshd"), to_bhsd(k, "bshd"), qkv_format="bshd", attn_mask_type="no_mask",
            softmax_scale=None, backend="reference", out_dtype=torch.float32, cu_seqlens_q=None,
            cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, softmax_type="vanilla",
            softmax_offset=None, recipe=None, **kw)
        return args.mask()

    assert band(16, 16, window_size=(3, 2)).diagonal_alignment == "top_left"
    assert band(16, 24, window_size=(3, 2)).diagonal_alignment == "bottom_right"
    assert band(16, 24, window_size=(3, 2), bottom_right_diagonal=False).diagonal_alignment == "top_left"
    probe_eq, probe_lt = Probe("dense", [16], [16], "cpu"), Probe("dense", [16], [24], "cpu")
    for _ in range(2):                                                    # (the second call replays the plan)
        for probe in (probe_eq, probe_lt, probe_eq):
            fwd, _ = probe.attended("reference", window_size=(3, 2))
            assert torch.equal(fwd, probe.expected((3, 2), True))


def test_module_takes_bottom_right_diagonal_as_te_does():
    """DotProductAttention: bottom_right_diagonal in __init__ and forward (forward's wins), TE's window check at
    __init__ (its warning, its error), and the mask type's own alignment for the causal types."""
    mask_module._WARNED_WINDOWS.clear()
    with pytest.warns(UserWarning, match="window_size should be"):
        module = mxattn.DotProductAttention(1, D, attn_mask_type="causal", window_size=(3, 3), backend="reference",
                                            qkv_format="bshd")
    assert module.window_size == (3, 0)                                   # kept as TE keeps it
    with pytest.raises(ValueError, match="window_size"):
        mxattn.DotProductAttention(1, D, attn_mask_type="no_mask", window_size=(3, -1))
    probe = Probe("dense", [5], [12], "cpu")

    def keys(module, **kw):
        out = module(probe.q, probe.k, probe.v, **kw)
        return (out.view(1, 5, 1, D)[0, :, 0, :12] > 0)

    top = mxattn.DotProductAttention(1, D, attn_mask_type="no_mask", window_size=(2, 1), backend="reference",
                                     bottom_right_diagonal=False)
    assert torch.equal(keys(top), te_keep(5, 12, (2, 1), False))
    assert torch.equal(keys(top, bottom_right_diagonal=True), te_keep(5, 12, (2, 1), True))
    default = mxattn.DotProductAttention(1, D, attn_mask_type="no_mask", window_size=(2, 1), backend="reference")
    assert torch.equal(keys(default), te_keep(5, 12, (2, 1), True))
    # causal types: the type's alignment, whatever bottom_right_diagonal says (TE overrides it)
    assert torch.equal(keys(default, attn_mask_type="causal", window_size=(2, 0), bottom_right_diagonal=True),
                       te_keep(5, 12, (2, 0), False))
    assert torch.equal(keys(top, attn_mask_type="causal_bottom_right", window_size=(2, 0)),
                       te_keep(5, 12, (2, 0), True))
    assert "bottom_right_diagonal=False" in repr(top)


def test_quantized_entry_point_takes_bottom_right_diagonal():
    """`mxfp8_attention_quantized` shares the options: a bottom-right window with a right bound gives the bytes of
    `mxfp8_attention` with the same arguments, top-left likewise."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, n, 2, 64, generator=g).bfloat16() for n in (40, 72, 72))
    inputs = mxattn.quantize_attention_inputs(q, k, v)
    for diagonal in (None, False):
        kw = dict(window_size=(16, 4), bottom_right_diagonal=diagonal, backend="reference")
        assert torch.equal(mxattn.mxfp8_attention_quantized(*inputs, **kw), mxattn.mxfp8_attention(q, k, v, **kw))
    assert not torch.equal(mxattn.mxfp8_attention(q, k, v, window_size=(16, 4), backend="reference"),
                           mxattn.mxfp8_attention(q, k, v, window_size=(16, 4), bottom_right_diagonal=False,
                                                  backend="reference"))


def test_kvcache_call_takes_te_meaning_and_refuses_a_top_left_diagonal():
    """`mxfp8_attention_with_kvcache` runs TE's padding_causal_bottom_right: bottom_right_diagonal None or True
    are that; False (top-left) raises before anything is written, naming the argument; a window with a right
    bound warns as TE does and runs with right 0; (-1, right > 0) raises."""
    cache = mxattn.MXFP8KVCache(num_pages=8, page_size=32, kv_heads=1, head_dim=64, max_sequences=2)
    slots = [cache.new_sequence(), cache.new_sequence()]
    g = torch.Generator().manual_seed(2)
    for slot, n in zip(slots, (20, 33)):
        x = torch.randn(n, 1, 64, generator=g).bfloat16()
        cache.append(slot, x, x)
    q = torch.randn(5, 2, 64, generator=g).bfloat16()
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    call = lambda **kw: mxattn.mxfp8_attention_with_kvcache(q, cache, slots, cu_seqlens_q=cu,  # noqa: E731
                                                            backend="reference", **kw)
    base = call(window_size=(7, 0))
    assert torch.equal(call(window_size=(7, 0), bottom_right_diagonal=True), base)
    mask_module._WARNED_WINDOWS.clear()
    with pytest.warns(UserWarning, match="window_size should be"):
        assert torch.equal(call(window_size=(7, 3)), base)
    lens = list(cache._lens)
    with pytest.raises(ValueError, match="bottom_right_diagonal=False"):
        call(window_size=(7, 0), bottom_right_diagonal=False, k_new=q[:, :1], v_new=q[:, :1])
    with pytest.raises(ValueError, match="window_size"):
        call(window_size=(-1, 2))
    with pytest.raises(TypeError, match="bottom_right_diagonal"):
        call(bottom_right_diagonal=0)
    assert list(cache._lens) == lens                                     # nothing was appended


def test_triton_kernels_get_the_band_of_te_windows():
    """What the triton backend hands its kernels for a no_mask/padding window (`_mask_args`, on the CPU): a dense
    call the bottom-right offset S_kv - S_q and the bounds (left + 1, right); a padded or packed call its band with
    bottom_right set, each sequence's offset taken from its own lengths in the kernels; bottom_right_diagonal=False
    the top-left offset 0. The kernels read any band (tests marked gpu run them)."""
    from mxattn.attention import encode_call
    from mxattn.backends.triton_backend import _mask_args
    from mxattn.layouts import to_bhsd

    def mask_args(sq, skv, **kw):
        q, k = torch.zeros(2, sq, 1, 64), torch.zeros(2, skv, 1, 64)
        opts = dict(attn_mask_type="no_mask", window_size=(16, 1), bottom_right_diagonal=None, cu_seqlens_q=None,
                    cu_seqlens_kv=None)
        opts.update(kw)
        args, _ = encode_call(to_bhsd(q, "bshd"), to_bhsd(k, "bshd"), to_bhsd(k, "bshd"), qkv_format="bshd",
                              softmax_scale=None, backend="triton", out_dtype=torch.bfloat16, max_seqlen_q=None,
                              max_seqlen_kv=None, softmax_type="vanilla", softmax_offset=None, recipe=None, **opts)
        kw = _mask_args(args.params(), sq, skv)
        kw.pop("seq", None)
        return kw

    assert mask_args(40, 72) == dict(offset=32, left_bound=17, right_bound=1)
    assert mask_args(72, 40) == dict(offset=-32, left_bound=17, right_bound=1)
    assert mask_args(40, 72, bottom_right_diagonal=False) == dict(offset=0, left_bound=17, right_bound=1)
    cu_q, cu_kv = torch.tensor([0, 40, 70], dtype=torch.int32), torch.tensor([0, 72, 100], dtype=torch.int32)
    padded = mask_args(40, 72, attn_mask_type="padding", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    assert padded == dict(offset=0, bottom_right=True, left_bound=17, right_bound=1)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense_lt", "dense_gt", "padded", "packed"])
@pytest.mark.parametrize("window", [(16, 8), (64, 0), (0, 32)])
def test_triton_bottom_right_windows_match_the_reference_backend(case, window):
    """The triton backend (forward and backward, Triton or Gluon kernels as it chooses) on bottom-right windows
    with a right bound, dense with S_q < S_kv and S_q > S_kv, padded and packed with lengths of their own: O and
    the gradients agree with the reference backend on the CPU (random inputs, relative RMS < 1e-2)."""
    from mxattn.metrics import rel_rms
    g = torch.Generator().manual_seed(7)
    kw = dict(attn_mask_type="no_mask", window_size=window)
    if case.startswith("dense"):
        sq, skv = (100, 300) if case == "dense_lt" else (300, 100)
        shapes = [(2, sq, 4, 128), (2, skv, 2, 128), (2, skv, 2, 128), (2, sq, 4, 128)]
    else:
        lens_q, lens_kv = [70, 200, 33], [190, 64, 33]
        cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
        kw.update(attn_mask_type="padding", cu_seqlens_q=cu(lens_q), cu_seqlens_kv=cu(lens_kv))
        if case == "packed":
            kw.update(qkv_format="thd")
            shapes = [(sum(lens_q), 4, 128), (sum(lens_kv), 2, 128), (sum(lens_kv), 2, 128), (sum(lens_q), 4, 128)]
        else:
            shapes = [(3, 210, 4, 128), (3, 200, 2, 128), (3, 200, 2, 128), (3, 210, 4, 128)]
    q, k, v, do = (torch.randn(s, generator=g).bfloat16() for s in shapes)

    def run(device, backend):
        leaves = [t.detach().to(device).requires_grad_() for t in (q, k, v)]
        args = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
        o = mxattn.mxfp8_attention(*leaves, backend=backend, **args)
        o.backward(do.to(device))
        return [t.float().cpu() for t in (o.detach(), *(leaf.grad for leaf in leaves))]

    for name, a, b in zip(("O", "dQ", "dK", "dV"), run("cuda", "triton"), run("cpu", "reference")):
        assert rel_rms(a, b) < 1e-2, name


def test_windows_under_torch_compile_fullgraph():
    """The window rules run at trace time without a graph break (TE's warning too): a compiled call gives the eager
    call's bytes, bottom-right and top-left."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 16, 2, 32, generator=g), torch.randn(1, 24, 2, 32, generator=g)
    mask_module._WARNED_WINDOWS.clear()
    for kw in (dict(attn_mask_type="causal", window_size=(4, 2)), dict(window_size=(3, 1)),
               dict(window_size=(3, 1), bottom_right_diagonal=False)):
        torch._dynamo.reset()  # (one code object: a recompile would make the window's ints dynamic)
        fn = torch.compile(lambda q, k, v, kw=kw: mxattn.mxfp8_attention(q, k, v, backend="reference", **kw),
                           fullgraph=True, backend="eager")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            assert torch.equal(fn(q, k, k), mxattn.mxfp8_attention(q, k, k, backend="reference", **kw))
