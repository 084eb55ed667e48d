"""Shared harness of the multi-process CPU tests: each spawned rank runs a list of named jobs once and rank 0
writes their records to a JSON file; the tests read one record each (one spawn per module and world size)."""

import json
import os
import time
import traceback

import pytest
import torch.distributed as dist


def run_jobs(rank: int, jobs, out: str) -> None:
    """Run each (name, job) of this rank; a job's exception becomes its record {"crash": traceback}. Rank 0
    writes {name: record + its seconds} to out. Ends the process group."""
    results = {}
    try:
        for name, job in jobs:
            start = time.perf_counter()
            try:
                results[name] = job()
            except Exception:
                results[name] = {"crash": traceback.format_exc()}
            if rank == 0:
                results[name] = dict(results[name] or {}, seconds=round(time.perf_counter() - start, 2))
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
        dist.barrier()  # no rank tears its connections down while a peer may still use them
    finally:
        dist.destroy_process_group()


_RUNS: dict = {}


def spawned_results(worker, world: int, tmp_path_factory, timeout_s: int) -> dict:
    """The records of worker(rank, world, init_file, out) run in `world` spawned processes (cached per worker and
    world size); fails the test when the ranks have not finished within timeout_s (a collective left waiting)."""
    key = (worker.__module__, worker.__name__, world)
    if key not in _RUNS:
        import torch.multiprocessing as mp
        from repo_paths import ROOT
        tmp = tmp_path_factory.mktemp(f"ranks{world}")
        out = tmp / "results.json"
        with pytest.MonkeyPatch.context() as mp_env:  # the spawned ranks import the test module by name
            mp_env.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                                         os.environ.get("PYTHONPATH", "")]))
            ctx = mp.start_processes(worker, args=(world, str(tmp / "init"), str(out)), nprocs=world, join=False,
                                     start_method="spawn")
            deadline = time.monotonic() + timeout_s
            while not ctx.join(timeout=2):
                if time.monotonic() > deadline:  # end the ranks this test started
                    for process in ctx.processes:
                        process.kill()
                    pytest.fail(f"the {world} ranks did not finish within {timeout_s} s (a collective left waiting?)")
        _RUNS[key] = json.loads(out.read_text())
    return _RUNS[key]


def record_of(worker, world: int, name: str, tmp_path_factory, timeout_s: int) -> dict:
    """One job's record; fails the test with the rank's traceback when the job raised."""
    record = spawned_results(worker, world, tmp_path_factory, timeout_s)[name]
    assert "crash" not in record, record["crash"]
    return record
