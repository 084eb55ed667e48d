"""The bench report's MLA line renders what `bench_mla` records (the figures and the ratios, named shapes)."""

from mxattn.bench_report import markdown


def test_the_mla_line_names_the_shapes_and_gives_the_figures_and_ratios():
    mla = {"dims": [192, 128], "train": [2, 128, 4096], "decode": [16, 128, 4096],
           "train_mxattn_fwd_ms": 3.0, "train_sdpa_bf16_fwd_ms": 4.5, "train_sdpa_over_mxattn_fwd": 1.5,
           "train_mxattn_fwdbwd_ms": 10.0, "train_sdpa_bf16_fwdbwd_ms": 12.0, "train_sdpa_over_mxattn_fwdbwd": 1.2,
           "decode_mxattn_fwd_ms": 0.5, "decode_sdpa_bf16_fwd_ms": 0.25, "decode_sdpa_over_mxattn_fwd": 0.5}
    text = markdown({"gpu": "a GPU", "torch": "t", "triton": "tr", "iters": 20, "warmup": 5, "configs": [],
                     "mla": mla})
    line = next(x for x in text.splitlines() if x.startswith("MLA head dims"))
    assert "Q, K 192, V 128" in line and "B2 H128 S4096 causal" in line and "B16 H128 one query on 4096 keys" in line
    assert "3.000 vs 4.500 ms (1.50x)" in line and "10.000 vs 12.000 ms (1.20x)" in line
    assert "0.500 vs 0.250 ms (0.50x)" in line
