"""Sharded recipe studies (samples/recipe_study.py and samples/recipe_study_hf.py at --size tiny on the CPU): shards
of other seeds merged by --merge give the study a single run over all their seeds gives (the summary recomputed
over every seed, checked here against an independent computation), with tokens/s per run; shards that do not make
one study are refused with a message naming the field or run and both files. benchmarks/recipe_study_gpu.sh, which
runs the shards on every GPU, is checked for its syntax here (test_recipe_study_runs.py runs it on pretend GPUs)."""

import contextlib
import importlib.util
import io
import json
import os
import shutil
import statistics
import subprocess

import pytest
from repo_paths import ROOT

ROOT = str(ROOT)
#: one thread and one recipe besides the default: a shard takes about a second
COMMON = ["--size", "tiny", "--steps", "2", "--threads", "1", "--recipes", "p_quant=none"]
TRAIN_ONLY = ["--skip-errors", "--skip-future", "--seeds", "1"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_merge_test", os.path.join(ROOT, "samples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rs = _load("recipe_study")
LABELS = [rs.BF16, "default", "p_quant=none"]


def _quiet(main, argv):
    """main(argv) with its progress and tables kept off the test output."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        return main(argv)


def _refusal(main, argv) -> str:
    """The message of the SystemExit that main(argv) raises."""
    with pytest.raises(SystemExit) as exc:
        _quiet(main, argv)
    return str(exc.value.code)


def _copy(path: str, directory) -> str:
    """A copy of the shard file `path` in `directory` (two files of the same shard)."""
    directory.mkdir(exist_ok=True)
    return shutil.copy(path, str(directory / os.path.basename(path)))


def _expected_summary(runs: dict, baseline: str) -> dict:
    """mean, min and max over the seeds of the final and validation losses and of their differences from
    `baseline` and the default paired by seed, and the means of seconds and tokens/s, computed from the runs."""
    out = {}
    for label, by_seed in runs.items():
        seeds = sorted(by_seed, key=int)
        row = {}
        for key in ("final", "val"):
            for name, values in ((key, [by_seed[s][key] for s in seeds]),
                                 (f"{key}_minus_base", [by_seed[s][key] - runs[baseline][s][key] for s in seeds]),
                                 (f"{key}_minus_default",
                                  [by_seed[s][key] - runs["default"][s][key] for s in seeds])):
                row[name] = (sum(values) / len(values), min(values), max(values))
        for key in ("seconds", "tokens_per_s"):
            row[key] = statistics.mean(by_seed[s][key] for s in seeds)
        out[label] = row
    return out


def _check_summary(runs: dict, summary: dict, baseline: str, base_key: str) -> None:
    """summary is what a single run over every seed of `runs` computes (see _expected_summary)."""
    expected = _expected_summary(runs, baseline)
    assert list(summary) == list(runs)
    for label, row in expected.items():
        for name, (mean, lo, hi) in ((k, v) for k, v in row.items() if isinstance(v, tuple)):
            got = summary[label][name.replace("_base", f"_{base_key}")]
            assert (got["mean"], got["min"], got["max"]) == pytest.approx((mean, lo, hi), abs=1e-12), (label, name)
        for key in ("seconds", "tokens_per_s"):
            assert summary[label][key]["mean"] == pytest.approx(row[key]), (label, key)


def _check_throughput(runs: dict, batch: int, seq: int, steps: int) -> None:
    """Every run records tokens/s = batch * seq * steps / seconds, positive."""
    for label, by_seed in runs.items():
        for seed, run in by_seed.items():
            assert run["tokens_per_s"] > 0, (label, seed)
            assert run["tokens_per_s"] == pytest.approx(batch * seq * steps / run["seconds"]), (label, seed)


# ------------------------------------------------------------------------------------------ recipe_study.py


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """Shards of recipe_study.py (parts 1 and 2 over seeds 0 and 1; training of seed 0; of seed 1), their merge
    (the shards given out of order) and a single training run over both seeds: {name: result}, "dir": root."""
    root = tmp_path_factory.mktemp("gpt_shards")
    runs = {"parts12": COMMON + ["--skip-training", "--seeds", "2"],
            "seed1": COMMON + TRAIN_ONLY + ["--seed", "1"],
            "seed0": COMMON + TRAIN_ONLY + ["--seed", "0"],
            "single": COMMON + ["--skip-errors", "--skip-future", "--seeds", "2"]}
    out = {name: _quiet(rs.main, argv + ["--out-dir", str(root / name)]) for name, argv in runs.items()}
    out["merged"] = _quiet(rs.main, ["--merge"] + [out[n]["paths"]["json"] for n in ("parts12", "seed1", "seed0")]
                           + ["--out-dir", str(root / "merged")])
    out["dir"] = root
    return out


def test_gpt_shards_run_only_their_parts(gpt):
    assert "training" not in gpt["parts12"] and {"errors", "future"} <= set(gpt["parts12"])
    for name in ("seed0", "seed1"):
        assert "training" in gpt[name] and "errors" not in gpt[name] and "future" not in gpt[name]   # --skip-future
        md = open(gpt[name]["paths"]["md"]).read()
        assert "## 3. Training" in md and "## 1." not in md and "## 2." not in md
    assert all(gpt[name]["steps"] == 2 for name in ("parts12", "seed0", "seed1"))


def test_gpt_merge_unites_the_seeds_and_summarizes_them_as_one_run(gpt):
    merged = json.loads(open(gpt["merged"]["paths"]["json"]).read())
    training = merged["training"]
    assert training["seeds"] == [0, 1] and merged["seeds"] == [0, 1]
    assert list(training["runs"]) == LABELS
    assert all(list(by_seed) == ["0", "1"] for by_seed in training["runs"].values())
    for seed in ("0", "1"):
        assert training["runs"]["default"][seed] == gpt[f"seed{seed}"]["training"]["runs"]["default"][seed]
    _check_summary(training["runs"], training["summary"], rs.BF16, "bf16")
    cfg = training["config"]
    _check_throughput(training["runs"], cfg["batch"], cfg["seq"], cfg["steps"])
    # parts 1 and 2 as the shard that ran them wrote them
    assert merged["errors"] == gpt["parts12"]["errors"] and merged["future"] == gpt["parts12"]["future"]
    assert merged["part_seeds"] == {"errors": [0, 1], "future": [0, 1], "training": [0, 1]}
    assert merged["command"].startswith("python samples/recipe_study.py --merge ")
    assert merged["shard_commands"] == [gpt[n]["command"] for n in ("parts12", "seed1", "seed0")]


def test_gpt_merge_matches_a_single_run_over_both_seeds(gpt):
    """On the CPU a seed's training is the same bit for bit in a shard and in a run over both seeds: the merged
    losses and their summary equal the single run's (the timings differ)."""
    merged, single = gpt["merged"]["training"], gpt["single"]["training"]
    assert merged["config"] == single["config"] and merged["seeds"] == single["seeds"]
    for label, by_seed in single["runs"].items():
        for seed, run in by_seed.items():
            assert {k: run[k] for k in ("final", "val", "first")} == \
                {k: merged["runs"][label][seed][k] for k in ("final", "val", "first")}
    for label, row in single["summary"].items():
        assert {k: v for k, v in row.items() if k not in ("seconds", "tokens_per_s")} == \
            {k: v for k, v in merged["summary"][label].items() if k not in ("seconds", "tokens_per_s")}


def test_gpt_merged_markdown_holds_both_seeds_every_part_and_tokens_per_s(gpt):
    md = open(gpt["merged"]["paths"]["md"]).read()
    lines = md.splitlines()
    assert lines[2] == f"Command: `{gpt['merged']['command']}`"
    assert "| attention | seed 0 | seed 1 |" in md
    assert all(f"- `{gpt[n]['command']}`" in md for n in ("parts12", "seed0", "seed1"))
    assert "## 1. Error" in md and "## 2. Future" in md and "## 3. Training" in md
    header = next(line for line in lines if line.startswith("| attention | final |"))
    assert header.endswith("| s / run | tokens/s |")
    row = next(line for line in lines if line.startswith("| default | ") and "(std" in line)
    assert float(row.rstrip(" |").rsplit("|", 1)[1]) > 0


def test_gpt_merge_refuses_a_run_or_a_part_in_two_shards_and_other_steps(gpt, tmp_path):
    seed0, parts12 = gpt["seed0"]["paths"]["json"], gpt["parts12"]["paths"]["json"]
    seed0_copy, parts12_copy = _copy(seed0, tmp_path / "seed0"), _copy(parts12, tmp_path / "parts12")
    out = ["--out-dir", str(tmp_path / "merged")]
    message = _refusal(rs.main, ["--merge", seed0, seed0_copy] + out)
    assert f"'{rs.BF16}' seed 0 ran in two shards" in message and seed0 in message and seed0_copy in message
    message = _refusal(rs.main, ["--merge", parts12, gpt["seed0"]["paths"]["json"], parts12_copy] + out)
    assert "part 'errors' is in two shards" in message and parts12 in message and parts12_copy in message
    other_steps = _quiet(rs.main, COMMON[:2] + ["--steps", "3"] + COMMON[4:] + TRAIN_ONLY
                         + ["--seed", "2", "--out-dir", str(tmp_path / "steps3")])["paths"]["json"]
    message = _refusal(rs.main, ["--merge", seed0, other_steps] + out)
    assert f"the shards differ in steps: 2 in {seed0} but 3 in {other_steps}" in message
    # a difference inside the training configuration is named by its key (the fields are checked before the runs)
    shard = json.loads(open(seed0).read())
    shard["training"]["config"]["lr"] = 0.5
    (tmp_path / "lr.json").write_text(json.dumps(shard))
    message = _refusal(rs.main, ["--merge", seed0, str(tmp_path / "lr.json")] + out)
    assert "the shards differ in training.config.lr: 0.002 in" in message and "but 0.5 in" in message
    assert not (tmp_path / "merged").exists()


def _without_tokens_per_s(path: str, out_path) -> str:
    """A copy of the shard at `path` as the studies wrote it before they recorded tokens/s (its runs lack the
    field, the summary too); returns its path."""
    shard = json.loads(open(path).read())
    runs = shard["training"]["runs"] if "training" in shard else shard["runs"]
    for by_seed in runs.values():
        for run in by_seed.values():
            del run["tokens_per_s"]
    for row in (shard["training"] if "training" in shard else shard)["summary"].values():
        row.pop("tokens_per_s")
    out_path.write_text(json.dumps(shard))
    return str(out_path)


def test_gpt_merge_takes_a_shard_written_before_tokens_per_s(gpt, tmp_path):
    """A shard of an older study (no tokens/s in its runs) merges with a new one: tokens/s computed from its
    seconds, the losses unchanged."""
    old = _without_tokens_per_s(gpt["seed1"]["paths"]["json"], tmp_path / "old_seed1.json")
    merged = _quiet(rs.main, ["--merge", gpt["parts12"]["paths"]["json"], old, gpt["seed0"]["paths"]["json"],
                              "--out-dir", str(tmp_path / "merged")])["training"]
    cfg = merged["config"]
    _check_throughput(merged["runs"], cfg["batch"], cfg["seq"], cfg["steps"])
    assert merged["summary"] == gpt["merged"]["training"]["summary"]


def test_merge_runs_nothing_else(tmp_path):
    for argv in (["--merge", "a.json", "--steps", "3"], ["--merge", "a.json", "--size", "cpu"],
                 ["--merge", "a.json", "--skip-errors"]):
        err = io.StringIO()
        with pytest.raises(SystemExit), contextlib.redirect_stderr(err):
            rs.parse_args(argv)
        assert "--merge runs nothing" in err.getvalue(), argv
    assert rs.parse_args(["--merge", "a.json", "b.json", "--out-dir", "x"]).merge == ["a.json", "b.json"]
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        rs.parse_args(["--skip-errors", "--skip-future", "--skip-training"])   # nothing to run
    assert "cannot read the shard" in _refusal(rs.main, ["--merge", str(tmp_path / "missing.json")])


# ------------------------------------------------------------------------------------------ recipe_study_hf.py


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """recipe_study_hf.py's module, its shards of seeds 1 and 0 and their merge: (module, {name: result}, root)."""
    pytest.importorskip("transformers")
    module = _load("recipe_study_hf")
    root = tmp_path_factory.mktemp("hf_shards")
    out = {f"seed{k}": _quiet(module.main, COMMON + ["--seeds", "1", "--seed", str(k), "--out-dir",
                                                     str(root / f"seed{k}")]) for k in (1, 0)}
    out["merged"] = _quiet(module.main, ["--merge", str(root / "seed1" / "recipe_study_hf.json"),
                                         str(root / "seed0" / "recipe_study_hf.json"), "--out-dir",
                                         str(root / "merged")])
    return module, out, root


def test_hf_merge_unites_the_seeds_and_summarizes_them_as_one_run(hf):
    module, out, root = hf
    merged = json.loads((root / "merged" / "recipe_study_hf.json").read_text())
    assert merged["seeds"] == [0, 1] and merged["recipes"] == ["default", "p_quant=none"]
    assert list(merged["runs"]) == ["sdpa", "default", "p_quant=none"]
    assert all(list(by_seed) == ["0", "1"] for by_seed in merged["runs"].values())
    assert merged["runs"]["default"]["1"] == out["seed1"]["runs"]["default"]["1"]
    _check_summary(merged["runs"], merged["summary"], module.SDPA, "sdpa")
    _check_throughput(merged["runs"], merged["batch"], merged["seq"], merged["steps"])
    assert merged["shard_commands"] == [out["seed1"]["command"], out["seed0"]["command"]]
    md = (root / "merged" / "recipe_study_hf.md").read_text()
    assert "seeds [0, 1]" in md and all(f"`{out[n]['command']}`" in md for n in ("seed0", "seed1"))
    assert "| seconds per run | tokens/s |" in md
    row = next(line for line in md.splitlines() if line.startswith("| default |"))
    assert float(row.rstrip(" |").rsplit("|", 1)[1]) > 0


def test_hf_merge_refuses_a_run_in_two_shards_and_other_steps(hf, tmp_path):
    module, out, root = hf
    seed0 = str(root / "seed0" / "recipe_study_hf.json")
    copy = _copy(seed0, tmp_path / "seed0")
    message = _refusal(module.main, ["--merge", seed0, copy, "--out-dir", str(tmp_path / "m")])
    assert "'sdpa' seed 0 ran in two shards" in message and seed0 in message and copy in message
    shard = json.loads(open(seed0).read())
    shard["steps"] = 3
    for by_seed in shard["runs"].values():
        by_seed["2"] = by_seed.pop("0")
    (tmp_path / "steps3.json").write_text(json.dumps(shard))
    message = _refusal(module.main, ["--merge", seed0, str(tmp_path / "steps3.json"), "--out-dir", str(tmp_path)])
    assert f"the shards differ in steps: 2 in {seed0} but 3 in {tmp_path / 'steps3.json'}" in message
    err = io.StringIO()
    with pytest.raises(SystemExit), contextlib.redirect_stderr(err):
        module.parse_args(["--merge", seed0, "--seed", "2"])
    assert "--merge runs nothing" in err.getvalue()


def test_hf_merge_takes_a_shard_written_before_tokens_per_s(hf, tmp_path):
    module, out, root = hf
    old = _without_tokens_per_s(str(root / "seed0" / "recipe_study_hf.json"), tmp_path / "old_seed0.json")
    merged = _quiet(module.main, ["--merge", str(root / "seed1" / "recipe_study_hf.json"), old, "--out-dir",
                                  str(tmp_path / "merged")])
    _check_throughput(merged["runs"], merged["batch"], merged["seq"], merged["steps"])
    assert merged["summary"] == json.loads((root / "merged" / "recipe_study_hf.json").read_text())["summary"]


# ------------------------------------------------------------------------------------------ the GPU script


def test_gpu_script_parses():
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    script = os.path.join(ROOT, "benchmarks", "recipe_study_gpu.sh")
    result = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
