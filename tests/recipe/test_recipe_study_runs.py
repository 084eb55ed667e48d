"""--runs: one seed's training runs split over shards (samples/recipe_study.py and samples/recipe_study_hf.py at
--size tiny on the CPU) merge to the study a single run over that seed gives (losses bit for bit, summary equal);
--merge refuses a study with a (run, seed) missing, naming it; --runs refuses an unknown label, naming the known
ones. benchmarks/recipe_study_plan.py (the GPU script's plan) assigns every (script, seed, run) once, near the
ideal balance; benchmarks/recipe_study_gpu.sh runs a plan end to end with a Python that swaps the GPU options for
tiny CPU ones."""

import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
from repo_paths import ROOT

ROOT = str(ROOT)
#: one thread, 2 steps, one recipe besides the default, one seed: a shard takes about a second
COMMON = ["--size", "tiny", "--steps", "2", "--threads", "1", "--recipes", "p_quant=none", "--seeds", "1"]
GPT_TRAIN = COMMON + ["--skip-errors", "--skip-future"]
LOSSES = ("final", "val", "first")


def _load(name: str, folder: str = "samples"):
    spec = importlib.util.spec_from_file_location(f"{name}_runs_test", os.path.join(ROOT, folder, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rs = _load("recipe_study")


def _quiet(main, argv):
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        return main(argv)


def _refusal(main, argv) -> str:
    """The message of the SystemExit that main(argv) raises (its code, or what argparse printed)."""
    err = io.StringIO()
    with pytest.raises(SystemExit) as exc, contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        main(argv)
    return str(exc.value.code) + err.getvalue()


def _losses(runs: dict) -> dict:
    return {label: {seed: {k: run[k] for k in LOSSES} for seed, run in by_seed.items()}
            for label, by_seed in runs.items()}


def _without_timings(summary: dict) -> dict:
    return {label: {k: v for k, v in row.items() if k not in ("seconds", "tokens_per_s")}
            for label, row in summary.items()}


def _split_and_merge(main, train_argv, json_name, baseline, root):
    """A single run over seed 0, shards of its baselines and of its other recipe, and their merge: {name: result}."""
    out = {"single": _quiet(main, train_argv + ["--out-dir", str(root / "single")]),
           "baselines": _quiet(main, train_argv + ["--runs", f"{baseline},default", "--out-dir",
                                                   str(root / "baselines")]),
           "recipes": _quiet(main, train_argv + ["--runs", "p_quant=none", "--out-dir", str(root / "recipes")])}
    out["merged"] = _quiet(main, ["--merge", str(root / "recipes" / json_name), str(root / "baselines" / json_name),
                                  "--out-dir", str(root / "merged")])
    return out


# ------------------------------------------------------------------------------------------ recipe_study.py


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_runs")
    out = _split_and_merge(rs.main, GPT_TRAIN, "recipe_study.json", rs.BF16, root)
    out["dir"] = root
    return out


def test_gpt_shards_train_only_their_runs_and_keep_the_study_recipes(gpt):
    assert list(gpt["baselines"]["training"]["runs"]) == [rs.BF16, "default"]
    assert list(gpt["recipes"]["training"]["runs"]) == ["p_quant=none"]
    assert list(gpt["recipes"]["recipes"]) == list(gpt["single"]["recipes"]) == ["default", "p_quant=none"]
    # the recipe shard cannot take paired differences: its summary holds what it can, its md says so
    row = gpt["recipes"]["training"]["summary"]["p_quant=none"]
    assert "final" in row and "final_minus_bf16" not in row and "final_minus_default" not in row
    md = open(gpt["recipes"]["paths"]["md"]).read()
    assert "This shard trained only `p_quant=none` of the study's runs (--runs)" in md
    assert "| p_quant=none | " in md and "| n/a | n/a | n/a |" in md
    assert "(--runs)" not in open(gpt["single"]["paths"]["md"]).read()
    # the baselines' shard has both baselines: its differences are all there
    assert "final_minus_default" in gpt["baselines"]["training"]["summary"][rs.BF16]


def test_gpt_split_seed_merges_to_the_single_run(gpt):
    merged, single = gpt["merged"]["training"], gpt["single"]["training"]
    assert list(merged["runs"]) == list(single["runs"]) == [rs.BF16, "default", "p_quant=none"]
    assert _losses(merged["runs"]) == _losses(single["runs"])           # bit for bit on the CPU
    assert _without_timings(merged["summary"]) == _without_timings(single["summary"])
    assert list(merged["summary"]) == list(single["summary"]) and merged["seeds"] == [0]
    assert merged["config"] == single["config"]
    md = open(gpt["merged"]["paths"]["md"]).read()
    assert "n/a" not in md and "(--runs)" not in md


def test_gpt_merge_refuses_a_missing_run_naming_it(gpt, tmp_path):
    root = gpt["dir"]
    message = _refusal(rs.main, ["--merge", str(root / "baselines" / "recipe_study.json"),
                                 "--out-dir", str(tmp_path / "m")])
    assert "no shard ran 'p_quant=none' seed 0" in message
    # a seed's run missing while the other seed is complete
    seed1 = _quiet(rs.main, GPT_TRAIN[:-4] + ["--seeds", "1", "--seed", "1", "--skip-errors", "--skip-future",
                                             "--runs", f"{rs.BF16},p_quant=none", "--out-dir", str(tmp_path / "s1")])
    message = _refusal(rs.main, ["--merge", str(root / "single" / "recipe_study.json"), seed1["paths"]["json"],
                                 "--out-dir", str(tmp_path / "m")])
    assert "no shard ran 'default' seed 1" in message and "seed 0" not in message
    assert not (tmp_path / "m").exists()


def test_runs_refuses_unknown_labels_naming_the_known_ones():
    message = _refusal(rs.parse_args, GPT_TRAIN + ["--runs", "default,p_quant=sometimes"])
    assert "--runs: unknown run label(s) ['p_quant=sometimes']" in message
    assert f"known: {rs.BF16}, default, p_quant=none" in message
    # a recipe outside --recipes' set is not the study's
    message = _refusal(rs.parse_args, GPT_TRAIN + ["--runs", "v_operand=bf16"])
    assert "unknown run label(s) ['v_operand=bf16']" in message
    assert "--runs selects training runs" in _refusal(rs.parse_args, ["--skip-training", "--runs", "default"])
    assert "--merge runs nothing" in _refusal(rs.parse_args, ["--merge", "a.json", "--runs", "default"])
    assert rs.parse_args(GPT_TRAIN + ["--runs", f" p_quant=none,{rs.BF16}"]).run_labels == [rs.BF16, "p_quant=none"]
    assert rs.parse_args(GPT_TRAIN).run_labels == [rs.BF16, "default", "p_quant=none"]


# ------------------------------------------------------------------------------------------ recipe_study_hf.py


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    pytest.importorskip("transformers")
    module = _load("recipe_study_hf")
    root = tmp_path_factory.mktemp("hf_runs")
    return module, _split_and_merge(module.main, COMMON, "recipe_study_hf.json", module.SDPA, root), root


def test_hf_split_seed_merges_to_the_single_run(hf):
    module, out, root = hf
    assert list(out["recipes"]["runs"]) == ["p_quant=none"] and out["recipes"]["recipes"] == ["default", "p_quant=none"]
    assert list(out["recipes"]["summary"]["p_quant=none"]) == ["final", "val", "seconds", "tokens_per_s"]
    assert "This shard trained only `p_quant=none`" in (root / "recipes" / "recipe_study_hf.md").read_text()
    merged, single = out["merged"], out["single"]
    assert list(merged["runs"]) == list(single["runs"]) == [module.SDPA, "default", "p_quant=none"]
    assert _losses(merged["runs"]) == _losses(single["runs"])
    assert _without_timings(merged["summary"]) == _without_timings(single["summary"])
    assert "n/a" not in (root / "merged" / "recipe_study_hf.md").read_text()


def test_hf_merge_refuses_a_missing_run_and_runs_an_unknown_label(hf, tmp_path):
    module, out, root = hf
    message = _refusal(module.main, ["--merge", str(root / "recipes" / "recipe_study_hf.json"),
                                     "--out-dir", str(tmp_path)])
    assert "no shard ran 'sdpa' seed 0, 'default' seed 0" in message
    message = _refusal(module.parse_args, COMMON + ["--runs", "bf16"])
    assert "unknown run label(s) ['bf16']; known: sdpa, default, p_quant=none" in message


# ------------------------------------------------------------------------------------------ the GPU plan


@pytest.fixture(scope="module")
def planner():
    return _load("recipe_study_plan", "benchmarks")


@pytest.mark.parametrize("ngpus,seeds,steps", [(1, 3, 1000), (2, 3, 2000), (3, 2, 1000), (4, 3, 1000),
                                               (4, 3, 250), (5, 3, 1000), (8, 3, 1000), (8, 1, 500)])
def test_plan_assigns_every_run_once_near_the_ideal(planner, ngpus, seeds, steps):
    plan = planner.make_plan(ngpus, seeds, steps)
    expected = planner.study_runs(seeds)
    assert len(expected) == 2 * seeds * (1 + len(rs.study_recipes()))
    # every (script, seed, label) in exactly one process of the printed plan
    lines = planner.plan_lines(plan)
    seen = []
    for gpu, name, script, first, count, runs, est in lines:
        assert 0 <= gpu < ngpus
        if runs == "-":
            assert script == "recipe_study.py"
            continue
        key = {"recipe_study.py": "gpt", "recipe_study_hf.py": "hf"}[script]
        labels = planner.study_labels(key) if runs == "*" else runs.split(",")
        seen += [(key, seed, label) for seed in range(int(first), int(first) + int(count)) for label in labels]
    assert sorted(seen) == sorted(expected)
    assert sum(1 for line in lines if line[5] == "-") == 1
    assert len({line[1] for line in lines}) == len(lines)                 # shard names (folders) distinct
    # the heaviest GPU within reason of the ideal (the total over the GPUs), or the single heaviest job's time
    loads = plan.loads()
    ideal = plan.total() / ngpus
    heaviest_job = max(plan.cost.values()) + plan.process_s
    assert max(loads) <= max(1.25 * ideal, heaviest_job + plan.process_s), (loads, ideal)
    assert max(loads) == pytest.approx(max(sum(line[6] for line in lines if line[0] == g) for g in range(ngpus)))
    # few processes: at most about three per GPU per script
    assert len(lines) <= 1 + min(len(expected), 2 * 3 * ngpus)


def test_plan_weights_and_printout(planner):
    pt, base = ("gpt", 0, "scaling=per_tensor"), ("gpt", 0, "default")
    assert planner.run_cost(pt, 1000, 9.0, 1.0) == pytest.approx(9 * planner.run_cost(base, 1000, 9.0, 1.0))
    assert planner.run_cost(("hf", 0, "default"), 1000, 9.0, 1.5) == pytest.approx(
        1.5 * planner.run_cost(base, 1000, 9.0, 1.0))
    one = planner.make_plan(1, 2, 100)
    assert [(line[1], line[5]) for line in planner.plan_lines(one)] == \
        [("gpt_parts12", "-"), ("gpt_gpu0_0", "*"), ("hf_gpu0_1", "*")]       # one GPU: one process per script
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "recipe_study_plan.py"), "--gpus", "2",
                             "--gpu-ids", "5,7", "--seeds", "2", "--steps", "100"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "GPU 5: ~" in result.stderr and "GPU 7: ~" in result.stderr and "ideal" in result.stderr
    assert all(len(line.split("\t")) == 7 and all(line.split("\t")) for line in result.stdout.splitlines())


@pytest.mark.slow
def test_gpu_script_runs_its_plan_and_merges(tmp_path):
    """benchmarks/recipe_study_gpu.sh on two pretend GPUs (~40 s on 2 cores): PYTHON swaps --size gpu, --device
    cuda and --backend auto for tiny, cpu and reference; the plan's start-up and parts-1-and-2 estimates are set so
    that it splits seed 0's GPT runs over both GPUs (--runs with the baseline's label, spaces and all); both merges
    hold every run."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\nargs=()\nfor a in \"$@\"; do case \"$a\" in gpu) a=tiny;; cuda) a=cpu;; "
                    f"auto) a=reference;; esac; args+=(\"$a\"); done\nexec {sys.executable} \"${{args[@]}}\"\n")
    fake.chmod(0o755)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0,1", SEEDS="1", STEPS="2", OUT=str(tmp_path / "out"),
               PYTHON=str(fake), PLAN_ARGS="--parts12-s 30 --process-s 8")
    result = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "recipe_study_gpu.sh")], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "plan: 16 training runs (2 steps each)" in result.stderr and "GPU 1: ~" in result.stderr
    merged = tmp_path / "out" / "merged"
    gpt = json.loads((merged / "recipe_study.json").read_text())
    hf = json.loads((merged / "recipe_study_hf.json").read_text())
    assert list(gpt["training"]["runs"]) == [rs.BF16] + [label for label, _ in rs.study_recipes()]
    assert "errors" in gpt and "future" in gpt
    assert len(hf["runs"]) == 1 + len(rs.study_recipes())
    assert all(list(by_seed) == ["0"] for by_seed in list(hf["runs"].values()) + list(gpt["training"]["runs"].values()))
    assert len(gpt["shard_commands"]) == 3 and len(hf["shard_commands"]) == 1   # parts 1 and 2, two halves of seed 0
    assert any(f"--runs '{rs.BF16}," in command for command in gpt["shard_commands"])
