"""mxattn.tensor_cache: results from tensors' values, reused while the tensors are unchanged."""

import threading

import torch

from mxattn.tensor_cache import TensorValueCache


def test_hits_misses_and_eviction():
    cache, builds = TensorValueCache(size=2), []
    a, b = torch.arange(3), torch.arange(4)

    def build(x):
        return lambda: builds.append(x) or int(x.sum())

    assert cache.get((a,), "k", build(a)) == 3 and cache.get((a,), "k", build(a)) == 3 and len(builds) == 1
    assert cache.get((a,), "other", build(a)) == 3 and len(builds) == 2          # extra is part of the key
    a.add_(1)                                                                   # in place: a new version
    assert cache.get((a,), "k", build(a)) == 6 and len(builds) == 3
    cache.get((b,), "k", build(b))                                              # evicts the oldest
    cache.get((a,), "other", build(a))
    assert len(builds) == 5
    assert cache.get((None, a), 1, lambda: "none ok") == "none ok"
    with torch.inference_mode():
        c = torch.ones(2)
    assert cache.get((c,), "k", lambda: 1) == 1 and cache.get((c,), "k", lambda: 2) == 2   # never cached


def test_a_dead_tensor_reusing_an_id_is_a_miss():
    """An entry whose tensor died is never served to a new tensor, even one at the same address with the same
    version (the weak reference is checked)."""
    cache = TensorValueCache()
    for _ in range(20):                                       # addresses are reused often within 20 rounds
        t = torch.zeros(2)
        cache.get((t,), None, lambda: "old")
        del t
        u = torch.zeros(2)
        assert cache.get((u,), None, lambda: "new") == "new"
        del u


def test_threads_share_the_cache():
    cache, t = TensorValueCache(), torch.arange(5)
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get((t,), 0, lambda: int(t.sum()))))
               for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results == [10] * 8
