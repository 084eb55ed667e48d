"""Host runtime: the machinery between a backend and its kernels.

Modules (imports go down this list, never up; none imports a backend):
  recording      per-thread state of a launch-plan recording
  host_calls     non-Triton work (a cuDNN graph execution) kept in a recording and replayed
  plan_keys      the keys launch-plan caches use (what a body reads besides tensor contents)
  launch_plan    record a body of allocations, views and launches once; replay it per call
  plan_cache     `PlanCache`: plans by key, recorded on a key's second call, replayed from its third
  affine_plan    plans whose launch arguments are affine in one length (decode steps over growing caches)
  triton_launch  low-overhead launches of compiled Triton kernels (imports triton)
  recipe_flags   a `Recipe` as the constexpr bits the kernels specialise on
  saved_block    one uint8 block for what a compiled forward keeps for its backward
  paged_step     the KV-cache call's append and attention launches, replayed per signature (imports triton)
This package's __init__ imports nothing, so `import mxattn.runtime` works without triton or a GPU.
"""
