"""Host cost of calling mxattn's forward through its torch custom op, against the op's body alone, on a CPU with
the Triton launches stubbed (benchmarks/cpu_host_harness.py): what torch.compile'd models pay per attention
call on top of the body (the compiled graph calls the custom op), and how much of it is the autograd layer.
B16 H8 S512 D64 causal, bf16; medians of 300 calls after warm-up (launch plans replay in every row).
Usage: python benchmarks/custom_op_overhead.py"""
import torch

import cpu_host_harness as harness
from mxattn import ops
from mxattn.mask import MaskSpec
from mxattn.op_args import FwdArgs


def main():
    harness.install_stubs({})
    q, k, v = (torch.randn(16, 8, 512, 64, dtype=torch.bfloat16) for _ in range(3))
    args = FwdArgs.encode(q, k, v, softmax_scale=0.125, mask=MaskSpec(causal=True), out_dtype=torch.bfloat16,
                          qkv_format="bhsd", backend="triton", seq=None, sink=None)
    op = torch.ops.mxattn.attention_fwd.default
    body = harness.per_call_us(lambda: ops._fwd_impl(args))
    wrapper = harness.per_call_us(lambda: ops.attention_fwd._init_fn(*args))
    through_op = harness.per_call_us(lambda: op(*args))
    from torch._C import DispatchKey, DispatchKeySet, _ExcludeDispatchKeyGuard
    with _ExcludeDispatchKeyGuard(DispatchKeySet(DispatchKey.AutogradCPU)):
        below_autograd = harness.per_call_us(lambda: op(*args))
    print(f"op body (_fwd_impl)                        {body:7.1f} us")
    print(f"the op's Python function (body + layouts)  {wrapper:7.1f} us")
    print(f"torch.ops.mxattn.attention_fwd             {through_op:7.1f} us")
    print(f"  the same below the autograd key          {below_autograd:7.1f} us")
    print(f"dispatch overhead: {through_op - wrapper:.1f} us per call ({below_autograd - wrapper:.1f} us of it "
          "without the autograd layer)")


if __name__ == "__main__":
    main()
