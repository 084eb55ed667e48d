"""The config matrix shared by the CPU graph tests and the Blackwell execution tests of the cudnn backend."""

from mxattn.mask import MaskSpec

SEQS = (128, 500, 1024, 4096)
HEAD_DIMS = ((64, 64), (128, 128), (192, 128))  # (d_qk, d_v): cuDNN runs d_qk=192 only with d_v=128
HEADS = ((8, 8), (8, 2), (8, 1))
MASKS = {
    "none": MaskSpec(),
    "causal_tl": MaskSpec(causal=True),
    "causal_br": MaskSpec(causal=True, diagonal_alignment="bottom_right"),
    "swa_tl": MaskSpec(left_bound=100, right_bound=0),
    "band_br": MaskSpec(left_bound=64, right_bound=32, diagonal_alignment="bottom_right"),
    "left_only_br": MaskSpec(left_bound=200, diagonal_alignment="bottom_right"),
}
LAYOUTS = {"bhsd": (0, 1, 2, 3), "bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3)}  # physical order of B,H,S,D
