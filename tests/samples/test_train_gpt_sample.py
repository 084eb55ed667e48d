"""The GPT training sample (samples/train_gpt.py) on CPU: both models learn, MXFP8 tracks BF16 within 5%."""

import importlib.util
import math
import os

import pytest
from repo_paths import ROOT

import mxattn

SAMPLE = os.path.join(str(ROOT), "samples", "train_gpt.py")

# A small config: about 10 s on 2 idle cores (the reference MXFP8 backend dominates).
ARGV = ["--steps", "30", "--layers", "2", "--dim", "128", "--heads", "4", "--seq", "64", "--batch", "16",
        "--lr", "2e-3", "--device", "cpu", "--backend", "reference", "--seed", "0", "--log-every", "10",
        "--final-window", "5", "--data-bytes", "400000"]


def _load_sample():
    spec = importlib.util.spec_from_file_location("train_gpt_sample", SAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("train_gpt_out")
    return _load_sample().main(ARGV + ["--out", str(out)]), out


def _mean(xs):
    return sum(xs) / len(xs)


def test_curves_have_one_finite_loss_per_step(result):
    res, _ = result
    assert res["steps"] == list(range(30))
    for key in ("loss_bf16", "loss_mxfp8"):
        assert len(res[key]) == 30
        assert all(math.isfinite(x) for x in res[key]), key
    # Same init weights and same first batch: the step-0 losses differ only by attention rounding.
    assert abs(res["loss_bf16"][0] - res["loss_mxfp8"][0]) < 0.01
    # Both start near ln(256) = 5.55 (uniform over the byte vocabulary).
    assert 5.0 < res["loss_bf16"][0] < 6.0
    # ...but the MXFP8 model really ran a different kernel (quantization changes the numbers a little).
    assert res["loss_bf16"] != res["loss_mxfp8"]


def test_the_printed_training_time_leaves_the_first_step_apart(result):
    """The first step (where a GPU compiles the kernels) is timed apart from the other steps, for both models."""
    res, _ = result
    for name in ("bf16", "mxfp8"):
        assert res[f"first_step_seconds_{name}"] > 0 and res[f"seconds_{name}"] > 0


@pytest.mark.parametrize("key", ["loss_bf16", "loss_mxfp8"])
def test_loss_falls(result, key):
    curve = result[0][key]
    first, last = _mean(curve[:5]), _mean(curve[-5:])
    assert last < first - 1.0, f"{key}: mean of first 5 steps {first:.3f}, of last 5 {last:.3f}"


def test_mxfp8_final_loss_within_5_percent_of_bf16(result):
    res, _ = result
    assert res["final_bf16"] == pytest.approx(_mean(res["loss_bf16"][-5:]))
    assert res["final_mxfp8"] == pytest.approx(_mean(res["loss_mxfp8"][-5:]))
    rel = abs(res["final_mxfp8"] - res["final_bf16"]) / res["final_bf16"]
    assert rel <= 0.05, f"final bf16 {res['final_bf16']:.4f}, mxfp8 {res['final_mxfp8']:.4f} ({100 * rel:.2f}%)"


def test_validation_losses_are_close_and_below_uniform(result):
    res, _ = result
    for key in ("val_bf16", "val_mxfp8"):
        assert math.isfinite(res[key]) and res[key] < math.log(256) - 1.0, (key, res[key])
    assert abs(res["val_mxfp8"] - res["val_bf16"]) / res["val_bf16"] <= 0.05


def test_png_written_when_matplotlib_present(result):
    res, out = result
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert res["png"] is None
        return
    assert res["png"] == os.path.join(str(out), "train_gpt_loss.png")
    with open(res["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_are_rejected():
    sample = _load_sample()
    with pytest.raises(SystemExit):
        sample.main(["--steps", "0"])
    with pytest.raises(ValueError, match="divisible"):
        sample.CausalSelfAttention(dim=130, heads=4, attention="bf16")
    with pytest.raises(ValueError, match="attention"):
        sample.CausalSelfAttention(dim=128, heads=4, attention="fp8")


def _short_argv(tmp_path, steps):
    argv = ARGV[:]
    argv[argv.index("--steps") + 1] = str(steps)
    return argv + ["--out", str(tmp_path)]


def test_train_single_equals_main(tmp_path, capsys):
    """train_single (what samples/recipe_study.py trains with) gives main's losses bit for bit: same weights,
    batches and schedule for each attention."""
    sample = _load_sample()
    argv = _short_argv(tmp_path, 4)
    res = sample.main(argv)
    for attention in ("bf16", "mxfp8"):
        single = sample.train_single(argv, attention)
        assert len(single["loss"]) == 4 and single["loss"] == res[f"loss_{attention}"], attention
        assert single["final"] == res[f"final_{attention}"] and single["val"] == res[f"val_{attention}"]
    assert res["recipe"] == mxattn.Recipe()
    recipe = mxattn.Recipe(p_quant="none")
    assert sample.train_single(argv, "mxfp8", recipe)["loss"] == sample.main(argv + ["--recipe", "p_quant=none"])[
        "loss_mxfp8"]
    with pytest.raises(ValueError, match="attention='mxfp8' only"):
        sample.train_single(argv, "bf16", recipe)


@pytest.mark.parametrize("text,expected", [
    ("", mxattn.Recipe()),
    ("default", mxattn.Recipe()),
    ("p_quant=none", mxattn.Recipe(p_quant="none")),
    (" p_quant = none , v_operand=bf16 ", mxattn.Recipe(p_quant="none", v_operand="bf16")),
    ("scaling=per_tensor,ds_quant=bf16", mxattn.Recipe(scaling="per_tensor", ds_quant="bf16")),
])
def test_parse_recipe(text, expected):
    assert _load_sample().parse_recipe(text) == expected


@pytest.mark.parametrize("text,words", [
    ("p_quant=fixed16", "Recipe.p_quant must be one of"),
    ("v_operand", "expected field=value"),
    ("p_quant=none,,", "expected field=value"),
    ("colour=red", "unknown field 'colour'"),
    ("p_quant=none,p_quant=lazy16", "field 'p_quant' given twice"),
    ("scaling=per_tensor,scale_rounding=floor", "scale_rounding='floor'"),
])
def test_bad_recipe_is_rejected_naming_the_option(text, words, capsys):
    sample = _load_sample()
    with pytest.raises(ValueError, match="--recipe") as info:
        sample.parse_recipe(text)
    assert words in str(info.value)
    with pytest.raises(SystemExit):
        sample.main(["--recipe", text, "--steps", "1"])
    err = capsys.readouterr().err
    assert "error: --recipe: " in err and words in err


def test_recipe_option_reaches_the_mxfp8_model(tmp_path, capsys):
    """--recipe changes the MXFP8 model's numerics (and says so in the header line) and nothing else; without it
    the header carries no recipe."""
    sample = _load_sample()
    short = _short_argv(tmp_path, 2)
    plain = sample.main(short)
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("GPT: 2 layers") and "recipe" not in header
    variant = sample.main(short + ["--recipe", "v_operand=bf16,p_quant=none"])
    header = capsys.readouterr().out.splitlines()[0]
    assert "mxattn backend 'reference', recipe p_quant='none', v_operand='bf16';" in header
    assert variant["recipe"] == mxattn.Recipe(p_quant="none", v_operand="bf16")
    assert variant["loss_bf16"] == plain["loss_bf16"]
    assert variant["loss_mxfp8"][0] != plain["loss_mxfp8"][0]
    again = sample.main(short + ["--recipe", "default"])
    assert again["loss_mxfp8"] == plain["loss_mxfp8"]   # Recipe() and no recipe: the same bits
    with pytest.raises(ValueError, match="attention='mxfp8' only"):
        sample.CausalSelfAttention(dim=128, heads=4, attention="bf16", recipe=mxattn.Recipe())
