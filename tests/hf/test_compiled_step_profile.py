"""benchmarks/compiled_step_profile.py's GPU time per step counts each kernel once (its own row), not again in the
row of the operator that launched it."""
import importlib.util
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from repo_paths import ROOT

pytest.importorskip("transformers")


def _module():
    spec = importlib.util.spec_from_file_location("compiled_step_profile",
                                                  ROOT / "benchmarks" / "compiled_step_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_time_counts_the_gpu_rows_only():
    rows = [SimpleNamespace(key="aten::mm", device_type=DeviceType.CPU, self_device_time_total=300.0),
            SimpleNamespace(key="nvjet_gemm", device_type=DeviceType.CUDA, self_device_time_total=300.0),
            SimpleNamespace(key="mxattn::attention_fwd", device_type=DeviceType.CPU, self_device_time_total=200.0),
            SimpleNamespace(key="_attn_fwd_kernel", device_type=DeviceType.CUDA, self_device_time_total=150.0),
            SimpleNamespace(key="_quantize_qkv_kernel", device_type=DeviceType.CUDA, self_device_time_total=50.0),
            SimpleNamespace(key="Memset", device_type=DeviceType.CUDA, self_device_time_total=500.0)]
    assert _module().gpu_ms_per_step(rows, 2) == pytest.approx((300 + 150 + 50 + 500) / 2 / 1e3)
