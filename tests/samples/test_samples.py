"""The user-facing samples run end to end (CPU) and print what they promise."""

import os
import subprocess
import sys

import pytest
from repo_paths import ROOT



def _run(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_forward_sample():
    out = _run("samples/forward.py")
    assert "output (2, 512, 8, 128) torch.bfloat16" in out
    err = float(out.rsplit(":", 1)[1])
    assert 0 < err < 0.1


def test_backward_sample():
    out = _run("samples/backward.py")
    assert "dq: shape (2, 256, 8, 64), dtype torch.bfloat16" in out
    assert "dk: shape (2, 256, 2, 64)" in out


def test_compare_with_ref_sample_is_exact_on_reference():
    out = _run("samples/compare_with_ref.py", "--backend", "reference", "--seq", "200", "--heads", "4",
               "--kv-heads", "2", "--head-dim", "64", "--causal")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["O"], ["dQ"], ["dK"], ["dV"])]
    assert len(rows) == 4
    for name, max_diff, rel_ref, rel64, rel_ref64 in rows:
        assert float(max_diff) == 0.0 and float(rel_ref) == 0.0, name
        assert 0 < float(rel64) < 0.1 and float(rel64) == pytest.approx(float(rel_ref64))


def test_demo_and_info_commands():
    out = _run("-m", "mxattn", "demo", "--seq", "256", "--heads", "2", "--head-dim", "64")
    assert "cpu: reference backend (no CUDA device)" in out
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in out.splitlines()
            if line.strip().split()[:1] in (["O"], ["dQ"], ["dK"], ["dV"])}
    assert set(rows) == {"O", "dQ", "dK", "dV"}
    for name, (vs64, vs16, bf16_vs64) in rows.items():
        assert 0 < vs64 < 0.1 and bf16_vs64 < vs64, name
    info = _run("-m", "mxattn", "info")
    for key in ("torch", "cudnn frontend", "backend cudnn", "backend triton", "backend reference"):
        assert key in info
    reference_line = next(line for line in info.splitlines() if line.startswith("backend reference"))
    assert reference_line.split()[2:4] == ["usable:", "pure"]


def test_varlen_sample():
    out = _run("samples/varlen.py")
    assert "each document equals its own call, bit for bit: True" in out
    assert "no NaN in the output: True, real rows equal the packed output: True" in out
    err = float(out.rsplit(":", 1)[1])
    assert 0 < err < 0.1


@pytest.mark.parametrize("argv,message", [
    (["--backend", "triton", "--seq", "64"], "backend 'triton' cannot run this call on cpu"),
    (["--heads", "8", "--kv-heads", "3", "--seq", "64"], "divisible by key/value heads"),
    (["--device", "tpu9"], "--device"),
    (["--seq", "0"], "--seq must be >= 1"),
])
def test_demo_errors_are_one_line(argv, message, capsys):
    """Bad demo options end with one `error:` line and exit status 2, not a traceback."""
    from mxattn import demo
    with pytest.raises(SystemExit) as exit_info:
        demo.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and "Traceback" not in "\n".join(err)
    assert "error:" in err[-1] and message in err[-1]


def test_demo_on_cuda_without_cuda_is_one_line(capsys, monkeypatch):
    import torch
    from mxattn import demo
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        demo.main(["--device", "cuda"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda" in err[0]


def test_every_cli_option_has_help():
    """`demo --help` and `bench --help` explain every option."""
    import argparse
    from mxattn import bench, demo
    for module in (demo, bench):
        seen = []
        real = argparse.ArgumentParser.parse_args

        def capture(self, args=None, namespace=None):
            seen.append(self)
            raise SystemExit(0)

        argparse.ArgumentParser.parse_args = capture
        try:
            with pytest.raises(SystemExit):
                module.main([])
        finally:
            argparse.ArgumentParser.parse_args = real
        actions = [a for a in seen[0]._actions if a.option_strings and a.dest != "help"]
        assert actions and all(a.help for a in actions), [a.dest for a in actions if not a.help]


def test_kvcache_sample():
    out = _run("samples/kvcache_decode.py")
    assert "bit for bit: True" in out and "(0.5" in out


@pytest.mark.slow
def test_hf_generate_sample():
    pytest.importorskip("transformers")
    out = _run("samples/hf_generate.py", "--backend", "reference", "--new-tokens", "6")
    assert "3 of 3 prompts got the same tokens batched (left-padded) as alone" in out


def test_serve_sample_reports_speed_bytes_and_agreement():
    pytest.importorskip("transformers")
    # ~255 cached tokens per row: the open V block (up to 31 tokens in bf16) is a small share of the bytes
    out = _run("samples/serve.py", "--prompts", "3", "--new-tokens", "6", "--repeats", "1", "--min-prompt", "240",
               "--max-prompt", "250", "--backend", "reference")
    import re
    for label in ("bf16 DynamicCache", "MXFP8Cache", "MXFP8PagedCache"):
        assert re.search(rf"^{label} +[0-9.]+ tokens/s +cache +[0-9.]+ MiB$", out, re.M), out
    found = re.findall(r"^(MXFP8\w*Cache) bytes / bf16 DynamicCache bytes: ([0-9.]+); ([0-9]) of 3 prompts got "
                       r"the same tokens", out, re.M)
    ratios, same = {f[0]: float(f[1]) for f in found}, {f[0]: int(f[2]) for f in found}
    assert 0.5 < ratios["MXFP8Cache"] < 0.56, out  # E4M3 + E8M0 per 32 + one open bf16 V block per layer
    assert same["MXFP8PagedCache"] == 3, out         # each prompt's real tokens alone: the DynamicCache's numbers
    paged = float(re.search(r"MXFP8PagedCache: ([0-9.]+)x the bytes of bf16 pages", out).group(1))
    assert 0.5 < paged < 0.7, out                  # the pages (8 of 32 tokens per row) + the open V blocks
