"""benchmarks/peak_memory_breakdown.py's trace replay (the part that runs without a GPU): the peak of a synthetic
allocator trace and the blocks alive there, labelled by the innermost frame that allocated them."""

import sys

from repo_paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from peak_memory_breakdown import replay  # noqa: E402


def _frames(*files):
    return [{"filename": f, "name": f.rsplit("/", 1)[-1].split(".")[0] + "_fn", "line": 1} for f in files]


def test_replay_finds_the_peak_and_labels_the_blocks_alive_there():
    lib = "/site/mxattn/kernels/"
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frames(lib + "triton_quantize.py", "/x/bench.py")},
        {"action": "alloc", "addr": 2, "size": 50, "frames": _frames(lib + "launch_plan.py", lib + "prep.py")},
        {"action": "segment_alloc", "addr": 9, "size": 4096},  # (not a block: ignored)
        {"action": "free_requested", "addr": 2, "size": 50},
        {"action": "free_completed", "addr": 2, "size": 50},
        {"action": "alloc", "addr": 3, "size": 70, "frames": _frames(lib + "triton_quantize.py")},
        {"action": "alloc", "addr": 4, "size": 10, "frames": []},  # no Python frame (autograd's thread)
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_requested", "addr": 7, "size": 999},  # allocated before the trace: outside
        {"action": "alloc", "addr": 5, "size": 30, "frames": _frames("/y/other.py")},
    ]
    peak, groups = replay(trace, "/mxattn/")
    assert peak == 180  # blocks 1, 3 and 4 (block 2 was freed before; block 5 came after block 1's free)
    assert groups == {"triton_quantize.py:triton_quantize_fn": [170, 2],
                      "(no Python frame: autograd's backward thread)": [10, 1]}
    # launch-plan frames are passed through to the function that asked for the block
    peak2, groups2 = replay(trace[:2], "/mxattn/")
    assert peak2 == 150 and groups2["prep.py:prep_fn"] == [50, 1]
    # a marker no frame holds labels framed blocks "(other)"
    assert replay(trace[:1], "/nowhere/")[1] == {"(other)": [100, 1]}
