"""benchmarks/models_ab.py: the A/B of an environment switch over whole-model benchmark runs (its run order, the
ratios it reads from a run, its summary, and one real CPU run of both arms)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from repo_paths import ROOT

pytest.importorskip("transformers")


def _module():
    spec = importlib.util.spec_from_file_location("models_ab", ROOT / "benchmarks" / "models_ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runs_alternate_so_each_arm_goes_first_equally():
    ab = _module()
    assert ab.arm_order(1) == ["A", "B"]
    assert ab.arm_order(3) == ["A", "B", "B", "A", "A", "B"]
    order = ab.arm_order(4)
    assert order.count("A") == order.count("B") == 4
    assert [order[i] for i in range(0, 8, 2)] == ["A", "B", "A", "B"]  # (who starts each pair)


def test_only_arm_b_gets_the_switch_and_both_import_this_repository():
    ab = _module()
    base = {"PATH": "/bin", "PYTHONPATH": "/elsewhere", "MXATTN_GLUON_BWD": "1"}
    a, b = (ab.arm_environment(arm, "MXATTN_GLUON_BWD", "0", base) for arm in "AB")
    assert a["MXATTN_GLUON_BWD"] == "1" and b["MXATTN_GLUON_BWD"] == "0"
    for env in (a, b):
        assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/elsewhere"] and env["PATH"] == "/bin"
    assert base["MXATTN_GLUON_BWD"] == "1"  # (the caller's environment untouched)
    assert ab.arm_environment("B", "X", "1", {})["PYTHONPATH"] == str(ROOT)


def test_ratios_are_read_per_row_from_a_run():
    ab = _module()
    run = {"train": [{"model": "gpt2_x", "mode": "eager", "ratio": 1.2}, {"model": "gpt2_x", "mode": "compiled",
                                                                           "ratio": 1.3}],
           "generate": [{"model": "gpt2_x", "batch": 8, "ratio": {"sdpa": 1.0, "mxfp8": 0.9, "mxfp8 + paged": 0.8}}]}
    assert ab.row_ratios(run) == {"train gpt2_x eager": 1.2, "train gpt2_x compiled": 1.3,
                                  "generate gpt2_x b8 mxfp8": 0.9, "generate gpt2_x b8 mxfp8 + paged": 0.8}
    assert ab.row_ratios({}) == {}


def test_the_summary_compares_the_arms_medians():
    ab = _module()
    runs = [dict(arm="A", ratios={"x": 1.0, "y": 2.0}), dict(arm="B", ratios={"x": 1.5}),
            dict(arm="B", ratios={"x": 1.3}), dict(arm="A", ratios={"x": 1.2, "y": 2.2})]
    rows = {r["label"]: r for r in ab.summarize(runs)}
    assert list(rows) == ["x", "y"]
    assert rows["x"]["a"] == [1.0, 1.2] and rows["x"]["b"] == [1.5, 1.3]
    assert rows["x"]["a_median"] == pytest.approx(1.1) and rows["x"]["b_median"] == pytest.approx(1.4)
    assert rows["x"]["b_over_a"] == pytest.approx(1.4 / 1.1)
    assert rows["y"]["b"] == [] and rows["y"]["b_median"] is None and rows["y"]["b_over_a"] is None
    assert "| x | 1.00, 1.20 | 1.50, 1.30 | 1.100 | 1.400 | 1.273 |" in ab.markdown("E=1", ab.summarize(runs), [])


@pytest.mark.parametrize("args, words", [(["--env", "NOVALUE"], "NAME=VALUE"),
                                         (["--env", "X=1", "--runs", "0"], "at least 1"),
                                         (["--env", "X=1", "--", "--out-dir", "d"], "before '--'")])
def test_bad_arguments_are_refused_naming_the_option(args, words, capsys):
    with pytest.raises(SystemExit):
        _module().main(args)
    assert words in capsys.readouterr().err


@pytest.mark.slow
def test_one_run_of_each_arm_on_the_cpu(tmp_path):
    """Both arms really run models_bench (tiny GPT-2, reference backend) and their ratios are collected (the
    switch here, MXATTN_AB_PROBE, changes nothing in models_bench: the two arms give the same rows)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "benchmarks/models_ab.py", "--env", "MXATTN_AB_PROBE=1", "--runs", "1",
                          "--out-dir", str(tmp_path), "--", "--device", "cpu", "--backend", "reference", "--quick",
                          "--train-only", "--no-compile", "--models", "gpt2"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    out = json.loads((tmp_path / "ab.json").read_text())
    assert [r["arm"] for r in out["runs"]] == ["A", "B"]
    (row,) = out["rows"]
    assert row["label"].startswith("train gpt2") and row["label"].endswith("eager")
    assert len(row["a"]) == len(row["b"]) == 1 and row["a"][0] > 0 and row["b"][0] > 0
    assert all("train" in r["models"] for r in out["runs"])  # each run's whole models.json, kept in ab.json
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ab.json", "ab.md"]  # no per-run folders
    assert "B = MXATTN_AB_PROBE=1" in (tmp_path / "ab.md").read_text()
