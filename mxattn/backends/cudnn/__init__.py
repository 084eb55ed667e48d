"""The `cudnn` backend: cuDNN's fused MXFP8 attention graphs (Blackwell, SM 10.x, cuDNN >= 9.21).

Modules, each with one job (imports go downwards in this list, never back up):
  * `support`  -- can cuDNN's MXFP8 attention run here (`cudnn_support`; imports no cuDNN);
  * `config`   -- `GraphConfig`, the variant-pack uids and the dims/strides helpers;
  * `graphs`   -- the graph builders, `graph_json`, planning and the cache of planned graphs;
  * `buffers`  -- the F8_128x4 scale buffers, the variable-length tensors, variant packs and operands;
  * `run`      -- per-device state, plan lookup and launch, and the typed interface on quantized tensors
                  (`cudnn_forward` / `cudnn_backward`);
  * `refusals` -- deciding up front: `known_refusal`, `problem_config`, `check_problem`;
  * `backend`  -- the `AttentionBackend` (`CudnnBackend`): quantization, the saved format, the support cache.

This package's `__init__` imports nothing, so `support` loads without the cuDNN frontend.
"""
