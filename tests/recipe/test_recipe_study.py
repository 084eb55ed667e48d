"""samples/recipe_study.py at --size tiny on the CPU: the study's functions measure what they claim (bf16 V has no
future-token dependence, the default has; P in bf16 is closer to FP64 than the default), and the output files hold
a row for every recipe."""

import contextlib
import importlib.util
import io
import json
import math
import os

import pytest
from repo_paths import ROOT
import torch

ROOT = str(ROOT)
STUDY = os.path.join(ROOT, "samples", "recipe_study.py")


def _load_study():
    spec = importlib.util.spec_from_file_location("recipe_study_sample", STUDY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rs = _load_study()
LABELS = [label for label, _ in rs.study_recipes()]
ARGV = ["--size", "tiny", "--seeds", "2", "--steps", "3", "--threads", "1"]  # one thread: quick on a busy CPU


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """The whole study at --size tiny (2 seeds, 3 training steps): (result, out_dir, stderr text)."""
    out = str(tmp_path_factory.mktemp("recipe_study"))
    err = io.StringIO()
    threads = torch.get_num_threads()
    with contextlib.redirect_stderr(err):
        result = rs.main(ARGV + ["--out-dir", out])
    assert torch.get_num_threads() == threads and result["threads"] == 1   # --threads is the study's only
    return result, out, err.getvalue()


def test_recipes_are_all_variants_with_labels_train_gpt_parses():
    from mxattn.recipe import all_variants
    recipes = rs.study_recipes()
    assert [r for _, r in recipes] == list(all_variants())
    assert recipes[0][0] == "default" and "scaling=per_tensor" in LABELS
    train_gpt = rs.load_train_gpt()
    for label, recipe in recipes:
        assert train_gpt.parse_recipe(label) == recipe, label


def test_input_distributions_have_their_shape():
    cpu = torch.device("cpu")
    gauss = rs.make_inputs("gaussian", 1, 2, 512, 64, 0, cpu)
    heavy = rs.make_inputs("heavy_tailed", 1, 2, 512, 64, 0, cpu)
    outl = rs.make_inputs("outlier_channels", 1, 2, 512, 64, 0, cpu)
    for t in gauss + heavy + outl:
        assert t.dtype == torch.bfloat16 and t.shape == (1, 2, 512, 64)

    def kurtosis(t):
        t = t.double().flatten()
        return (((t - t.mean()) / t.std()) ** 4).mean().item()

    assert abs(kurtosis(gauss[0]) - 3) < 0.3
    assert kurtosis(heavy[0]) > 6                      # Student-t(3): heavy tails
    assert abs(heavy[0].double().std().item() - 1) < 0.3  # ...at about unit variance
    for i, t in enumerate(outl[:3]):                   # q plain; k and v with 4 channels x20..x50
        ch = t.double().std(dim=(0, 1, 2))
        big = (ch > 10 * ch.median()).sum().item()
        assert big == (0 if i == 0 else 4), (i, ch)
        assert ch.max().item() < 60 * ch.median().item()
    with pytest.raises(ValueError, match="unknown distribution"):
        rs.make_inputs("uniform", 1, 1, 32, 32, 0, cpu)


def test_bf16_v_has_zero_future_token_sensitivity_and_the_default_has_some():
    cpu = torch.device("cpu")
    q, k, v, _ = rs.make_inputs("gaussian", 1, 1, 96, 32, 0, cpu)
    for magnitude in (0.0, 256.0, 4096.0):
        for region in ("same_block", "later_blocks"):
            assert rs.future_change(rs.Recipe(v_operand="bf16"), q, k, v, 9, region, magnitude, 1) == (0.0, 0.0)
    assert rs.future_change(rs.Recipe(), q, k, v, 9, "same_block", 4096.0, 1)[0] > 1e-3
    # the default's coupling is V's block scale: later blocks share none with rows 0..9
    assert rs.future_change(rs.Recipe(), q, k, v, 9, "later_blocks", 4096.0, 1) == (0.0, 0.0)
    # one FP32 scale per tensor couples every token
    assert rs.future_change(rs.Recipe(scaling="per_tensor"), q, k, v, 9, "later_blocks", 4096.0, 1)[0] > 1e-3
    with pytest.raises(ValueError, match="no later_blocks positions"):
        rs.future_change(rs.Recipe(), q, k, v, 70, "later_blocks", 0.0, 1)


def test_study_future_table(study):
    changes = study[0]["future"]["changes"]
    assert set(changes) == set(LABELS)
    assert all(cell["max_abs"] == 0.0 and cell["max_rel"] == 0.0 for cell in changes["v_operand=bf16"].values())
    assert changes["default"]["same_block, v=4096"]["max_abs"] > 1e-3
    assert changes["default"]["same_block, v=256"]["max_abs"] > 0
    assert all(changes["default"][c]["max_abs"] == 0.0 for c in changes["default"] if c.startswith("later"))
    assert changes["scaling=per_tensor"]["later_blocks, v=4096"]["max_abs"] > 1e-3


def test_study_errors(study):
    cases = study[0]["errors"]
    assert [(c["distribution"], c["mask"]) for c in cases] == [(d, m) for d in rs.DISTRIBUTIONS for m in rs.MASKS]
    assert next(c for c in cases if c["distribution"] == "long")["seq"] > cases[0]["seq"]
    for c in cases:
        errs = c["errors"]
        assert set(errs) == {rs.BF16, rs.QK_ONLY, *LABELS}
        for label, row in errs.items():
            for metric in rs.METRICS:
                s = row[metric]
                assert len(s["values"]) == 2 and s["min"] <= s["mean"] <= s["max"]
                assert math.isfinite(s["mean"]) and 0 < s["mean"] < 1, (c["distribution"], label, metric)
            if label != rs.BF16:
                # every MXFP8 recipe is an order of magnitude further from FP64 than BF16 attention
                assert row["O"]["mean"] > 5 * errs[rs.BF16]["O"]["mean"], (label, c)
        if c["distribution"] in ("gaussian", "long"):
            # P in bf16 removes P's FP8 rounding: O comes closer to FP64 than with the default
            assert errs["p_quant=none"]["O"]["mean"] < errs["default"]["O"]["mean"], c
            assert errs["v_operand=bf16"]["O"]["mean"] < errs["default"]["O"]["mean"], c
            # Q and K in MXFP8 alone already cost most of the default's O error
            assert errs[rs.QK_ONLY]["O"]["mean"] < errs["default"]["O"]["mean"], c
    outl = [c for c in cases if c["distribution"] == "outlier_channels"]
    assert all(c["logit_std"]["mean"] > 3 * cases[0]["logit_std"]["mean"] for c in outl)


def test_study_training(study):
    training = study[0]["training"]
    assert training["seeds"] == [0, 1] and training["config"]["steps"] == 3
    assert list(training["summary"]) == [rs.BF16] + LABELS
    for label, by_seed in training["runs"].items():
        assert set(by_seed) == {"0", "1"}
        for run in by_seed.values():
            assert math.isfinite(run["final"]) and math.isfinite(run["val"])
            assert 4.5 < run["first"] < 6.5               # about ln(256) at the start
    # every attention starts from the seed's weights and batch: step-0 losses agree closely
    for seed in ("0", "1"):
        firsts = [by_seed[seed]["first"] for by_seed in training["runs"].values()]
        assert max(firsts) - min(firsts) < 0.01
    s = training["summary"]["default"]
    assert s["final_minus_default"]["max"] == 0.0 and s["final"]["min"] <= s["final"]["mean"] <= s["final"]["max"]
    assert training["summary"][rs.BF16]["final_minus_bf16"]["max"] == 0.0


def test_output_files_hold_every_recipe(study):
    result, out, err = study
    assert result["paths"] == {"json": os.path.join(out, "recipe_study.json"),
                               "md": os.path.join(out, "recipe_study.md")}
    with open(result["paths"]["json"]) as f:
        saved = json.load(f)
    assert saved["command"] == "python samples/recipe_study.py " + " ".join(ARGV + ["--out-dir", out])
    assert set(saved["future"]["changes"]) == set(LABELS) and set(saved["training"]["summary"]) == {rs.BF16, *LABELS}
    with open(result["paths"]["md"]) as f:
        md = f.read()
    assert f"Command: `{saved['command']}`" in md.splitlines()[2]
    for label in LABELS:   # 4 error tables, the future table, the training summary and its per-seed table
        assert md.count(f"| {label} |") == 7, label
    assert md.count(f"| {rs.BF16} |") == 6 and md.count(f"| {rs.QK_ONLY} |") == 4
    try:
        import matplotlib  # noqa: F401
        assert saved["plots"].startswith("written: ")
        assert os.path.exists(os.path.join(out, "recipe_study_errors.png"))
    except ImportError:
        assert saved["plots"] == "matplotlib is not installed: no PNG plots written"
        assert "matplotlib is not installed" in md
        assert not [name for name in os.listdir(out) if name.endswith(".png")]
    # progress on stderr: one "[k/N]" line per unit of work
    lines = [line for line in err.splitlines() if line.startswith("[")]
    total = len(rs.error_cases(rs.SIZES["tiny"])) * 2 + 2 + 2 * (1 + len(LABELS))
    assert len(lines) == total and lines[0].startswith(f"[1/{total}] ") and lines[-1].startswith(f"[{total}/{total}]")


def test_skip_training_default_out_dir_and_bad_arguments(tmp_path, monkeypatch):
    """Parts 2 alone, written to benchmarks/results/cpu/recipe_study/ under the (here temporary) repository."""
    monkeypatch.setattr(rs, "ROOT", str(tmp_path))
    with contextlib.redirect_stderr(io.StringIO()):
        result = rs.main(["--size", "tiny", "--seeds", "1", "--skip-training", "--skip-errors", "--threads", "1"])
    out = tmp_path / "benchmarks" / "results" / "cpu" / "recipe_study"
    assert result["paths"]["md"] == str(out / "recipe_study.md")
    assert "training" not in result and "errors" not in result and set(result["future"]["changes"]) == set(LABELS)
    with open(out / "recipe_study.md") as f:
        md = f.read()
    assert "## 2. Future-token sensitivity" in md and "## 3." not in md and "## 1." not in md
    assert json.loads((out / "recipe_study.json").read_text())["device"] == "cpu"
    for argv in (["--seeds", "0"], ["--steps", "0"], ["--future-magnitudes", "big"], ["--future-magnitudes", "-1"],
                 ["--size", "huge"]):
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            rs.parse_args(argv)


def test_hf_study_trains_llama_with_every_recipe_from_the_same_weights(tmp_path):
    """samples/recipe_study_hf.py at --size tiny (2 seeds, 3 steps): a row for SDPA and every recipe, every recipe's
    registered attention ran (the losses differ from SDPA's and v_operand=bf16's from the default's, on the same
    weights and batches), a seed's first loss is the same for every attention (same weights, same first batch,
    attention rounding aside), and the names it registered with transformers are gone afterwards."""
    pytest.importorskip("transformers")
    from transformers import AttentionInterface
    spec = importlib.util.spec_from_file_location("recipe_study_hf_sample",
                                                  os.path.join(ROOT, "samples", "recipe_study_hf.py"))
    hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf)
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        result = hf.main(["--size", "tiny", "--seeds", "2", "--steps", "3", "--out-dir", str(tmp_path)])
    assert list(result["summary"]) == ["sdpa"] + LABELS
    runs = result["runs"]
    for seed in ("0", "1"):
        assert runs["default"][seed]["final"] != runs["sdpa"][seed]["final"]
        assert runs["v_operand=bf16"][seed]["final"] != runs["default"][seed]["final"]
        for label in LABELS:
            assert abs(runs[label][seed]["first"] - runs["sdpa"][seed]["first"]) < 0.05, label
    assert runs["sdpa"]["0"]["first"] != runs["sdpa"]["1"]["first"]   # seeds draw other weights
    md = (tmp_path / "recipe_study_hf.md").read_text()
    assert all(f"| {label} |" in md for label in ["sdpa"] + LABELS)
    assert json.loads((tmp_path / "recipe_study_hf.json").read_text())["seeds"] == [0, 1]
    assert not any(name.startswith("mxfp8study") for name in AttentionInterface._global_mapping)


def test_recipes_option_runs_a_subset_with_the_default(tmp_path):
    """--recipes keeps the default (the paired differences' baseline) and the labels given, in the study and in
    the transformers study; unknown labels are refused naming the known ones."""
    assert [label for label, _ in rs.study_recipes(["v_operand=bf16"])] == ["default", "v_operand=bf16"]
    with contextlib.redirect_stderr(io.StringIO()):
        result = rs.main(["--size", "tiny", "--seeds", "1", "--steps", "2", "--skip-errors", "--threads", "1",
                          "--recipes", "p_quant=none", "--out-dir", str(tmp_path)])
    assert set(result["future"]["changes"]) == {"default", "p_quant=none"}
    assert list(result["training"]["runs"]) == list(result["training"]["summary"]) == \
        ["bf16 (torch SDPA)", "default", "p_quant=none"]
    err = io.StringIO()
    with pytest.raises(SystemExit), contextlib.redirect_stderr(err):
        rs.parse_args(["--recipes", "p_quant=sometimes"])
    assert "unknown recipe label" in err.getvalue() and "v_operand=bf16" in err.getvalue()


def test_a_study_cut_during_training_keeps_what_it_measured(tmp_path, monkeypatch):
    """Parts 1 and 2 are written before training starts, and each training run as it ends (a study stopped by a
    time limit keeps what it measured instead of leaving no file); a finished study removes the runs file."""
    real = rs.run_training
    seen = []

    def cut_after_two(*args, on_run=None, **kw):
        def hook(runs):
            on_run(runs)
            seen.append(json.loads((tmp_path / "recipe_study_training_runs.json").read_text()))
            if len(seen) == 2:
                raise KeyboardInterrupt
        return real(*args, on_run=hook, **kw)

    monkeypatch.setattr(rs, "run_training", cut_after_two)
    with pytest.raises(KeyboardInterrupt), contextlib.redirect_stderr(io.StringIO()):
        rs.main(["--size", "tiny", "--seeds", "1", "--steps", "2", "--skip-errors", "--threads", "1",
                 "--recipes", "p_quant=none", "--out-dir", str(tmp_path)])
    assert list(seen[-1]) == ["bf16 (torch SDPA)", "default"] and "final" in seen[-1]["default"]["0"]
    assert "## 2. Future-token sensitivity" in (tmp_path / "recipe_study.md").read_text()
    monkeypatch.setattr(rs, "run_training", real)
    with contextlib.redirect_stderr(io.StringIO()):
        rs.main(["--size", "tiny", "--seeds", "1", "--steps", "2", "--skip-errors", "--threads", "1",
                 "--recipes", "p_quant=none", "--out-dir", str(tmp_path)])
    assert not (tmp_path / "recipe_study_training_runs.json").exists()
    assert "## 3." in (tmp_path / "recipe_study.md").read_text()
