"""The triton backend and the bench module import cleanly without a GPU (and without triton installed), and
report why they cannot run."""

import importlib
import importlib.util
import json

import pytest
import torch
from repo_paths import ROOT

HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_backend_imports_and_declares_interface():
    mod = importlib.import_module("mxattn.backends.triton_backend")
    from mxattn.backends.base import AttentionBackend
    assert issubclass(mod.TritonBackend, AttentionBackend)
    assert mod.TritonBackend.name == "triton"
    assert {64, 128} <= set(mod.TritonBackend.supported_head_dims)
    importlib.import_module("mxattn.kernels")  # the package itself never imports triton


def test_availability_on_cpu_device_gives_reason():
    from mxattn.backends.triton_backend import TritonBackend
    ok, reason = TritonBackend.availability(torch.device("cpu"))
    assert ok is False
    assert "CUDA" in reason and "cpu" in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_availability_on_cuda_without_gpu_gives_reason():
    from mxattn.backends.triton_backend import TritonBackend
    ok, reason = TritonBackend.availability(torch.device("cuda"))
    assert ok is False
    assert ("triton is not installed" in reason) if not HAS_TRITON else ("CUDA is not available" in reason)


def test_registry_reports_triton_reason_without_raising():
    from mxattn.backends import availability
    ok, reason = availability("triton", torch.device("cpu"))
    assert ok is False and reason


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed here")
def test_kernel_modules_import_without_gpu():
    entry_points = {"triton_quantize": "quantize_rowcol", "triton_attention_fwd": "attention_fwd",
                    "triton_attention_bwd": "attention_bwd"}
    for name, fn in entry_points.items():
        module = importlib.import_module(f"mxattn.kernels.{name}")
        assert callable(getattr(module, fn)), f"{name}.{fn}"


def test_backend_rejects_cpu_tensors_before_any_kernel():
    from mxattn.backends.base import AttentionParams
    from mxattn.backends.triton_backend import TritonBackend
    from mxattn.mask import MaskSpec
    q = torch.zeros(1, 1, 32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        TritonBackend().forward(q, q, q, AttentionParams(softmax_scale=0.125, mask=MaskSpec()))
    with pytest.raises(TypeError, match="dtype"):
        TritonBackend().forward(q.to(torch.int32), q, q, AttentionParams(softmax_scale=0.125, mask=MaskSpec()))


def test_bench_helpers_and_markdown(tmp_path):
    from mxattn import bench
    assert bench.gpu_dir_name("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert bench.kept_pairs(4, 4, False) == 16
    assert bench.kept_pairs(4, 4, True) == 10
    # a sliding window (keys j > i - window): rows keep 1, 2, 2, 2 causal; 4, 4, 3, 2 without causal
    assert bench.kept_pairs(4, 4, True, 2) == 7 and bench.kept_pairs(4, 4, False, 2) == 13
    assert bench.kept_pairs(4, 4, True, 100) == 10
    cfg = {"config": "c", "triton_fwd_ms": 2.0, "triton_fwd_kernel_ms": 1.5, "triton_bwd_ms": 4.0,
           "triton_fwdbwd_ms": 6.0, "sdpa_cudnn_fwd_ms": 1.0, "sdpa_cudnn_bwd_ms": 2.0,
           "sdpa_cudnn_fwdbwd_ms": 3.0, "ratio_fwd_vs_cudnn": 0.5, "ratio_bwd_vs_cudnn": 0.5,
           "ratio_fwdbwd_vs_cudnn": 0.5, "ratio_fwd_kernel_vs_cudnn": 0.67, "triton_fwdbwd_peak_bytes": 2**20,
           "sdpa_cudnn_fwdbwd_peak_bytes": 2**21, "notes": ["n1"]}
    md = bench.markdown({"gpu": "X", "torch": "t", "triton": "tr", "iters": 20, "warmup": 5, "configs": [cfg]})
    assert "| c | triton MXFP8 | 2.000 (kernel 1.500)" in md and "0.50" in md and "n1" in md
    md = bench.markdown({"gpu": "X", "torch": "t", "triton": "tr", "iters": 20, "warmup": 5, "configs": [cfg],
                         "host": {"bshd_s4096_fwd_host_us": 301.2, "sdpa_cudnn_bf16_bshd_s4096_fwd_host_us": 41.0}})
    assert "idle launch queue, median; target <= 40 us): bshd_s4096 301 us, sdpa_cudnn_bf16_bshd_s4096 41 us." in md
    assert "both sides replayed from CUDA graphs" not in md  # no graph figures: no such table
    graphs = {"triton_fwd_kernel_graph_ms": 0.5, "triton_fwd_graph_ms": 0.6, "triton_fwdbwd_graph_ms": 2.5,
              "sdpa_cudnn_fwd_graph_ms": 0.45, "sdpa_cudnn_fwdbwd_graph_ms": None}
    ratios = bench.graph_ratios(graphs)
    assert ratios == {"ratio_fwd_kernel_graph_vs_cudnn_graph": 0.9, "ratio_fwd_graph_vs_cudnn_graph": 0.75}
    md = bench.markdown({"gpu": "X", "torch": "t", "triton": "tr", "iters": 20, "warmup": 5,
                         "configs": [{**cfg, **graphs, **ratios}]})
    assert "both sides replayed from CUDA graphs" in md and "| c | 0.90 | 0.75 | - | 0.500 / 0.450 |" in md
    p = tmp_path / "results.json"
    p.write_text(json.dumps({"gpu": "X", "configs": [cfg]}))
    rc = bench.main(["--plot-from", str(p)])
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    assert rc == (0 if has_mpl else 1)
    assert (tmp_path / "chart.png").exists() == has_mpl


def test_bench_rejects_too_few_iterations():
    from mxattn import bench
    with pytest.raises(SystemExit):
        bench.main(["--iters", "5"])


def test_kernel_sweep_lives_outside_the_package_and_checks_its_arguments(capsys):
    """The tuning sweep is benchmarks/kernel_sweep.py (no `--sweep` in `python -m mxattn bench`): it names the
    kernel groups it takes, and without a GPU it says so."""
    import runpy

    from mxattn import bench
    assert not hasattr(bench, "sweep") and "--sweep" not in _help(bench.main)
    sweep = runpy.run_path(str(ROOT / "benchmarks" / "kernel_sweep.py"), run_name="kernel_sweep")
    with pytest.raises(SystemExit):
        sweep["main"](["--kernels", "fwd,bogus"])
    assert "--kernels takes a comma list of fwd, fwd_fp8_on_chip, bwd_pre, bwd_fp8, quantize" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert sweep["main"](["--kernels", "fwd"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err


def _help(main) -> str:
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["--help"])
    return out.getvalue()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed here")
def test_quantizer_checks_arguments_before_any_kernel():
    from mxattn.kernels.triton_quantize import quantize_rowcol
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        quantize_rowcol([1.0])
    with pytest.raises(ValueError, match="x must be 4-D"):
        quantize_rowcol(torch.zeros(32, 32))
    with pytest.raises(TypeError, match="x must have dtype in"):
        quantize_rowcol(torch.zeros(1, 1, 32, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        quantize_rowcol(torch.zeros(1, 1, 32, 32, dtype=torch.bfloat16))
