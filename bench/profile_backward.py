"""One backward of each kind at one shape, inside a profiler window, for Nsight Compute.

The backward's gap to cuDNN is read from a profile of both at the same shape: how busy each
kernel keeps the tensor cores, what its warps stall on, its registers and occupancy. This
script compiles and warms every backend first, then runs one backward of each between
``torch.cuda.profiler.start()`` and ``stop()``, so that ``--profile-from-start off`` gets only
those launches:

    ncu --profile-from-start off --set full -o /tmp/bwd \\
        python bench/profile_backward.py --length 4096 --head-dim 128
    ncu --import /tmp/bwd.ncu-rep --page details

The backends, in launch order (the script prints it): flash_tile's default backward for
plain scores (``variants.default_backward_config(..., plain=True)``), the one-pass form
(``variants.SM90_ONE_PASS`` at D <= 128, ``SM90_ONE_PASS_WIDE`` above) and SDPA's cuDNN
backward. q, k, v and dO are fresh bf16 (or ``--dtype``) values, [B, H, L, D].
"""

import argparse

import torch
from torch.nn.attention import SDPBackend

from bench_attention import _sdpa
from bench_backward import _backward_only
from bench_variants import runner
from flash_tile import variants
from flash_tile._timing import DTYPES, grid_shape


def _cudnn_backward(batch, heads, length, head_dim, causal, dtype):
    """SDPA cuDNN's backward of one stored forward, as a zero-argument call (as
    ``bench_backward`` times it on the device)."""
    q, k, v, dout = (torch.randn(batch, heads, length, head_dim, device="cuda", dtype=dtype)
                     for _ in range(4))
    sdpa = _sdpa(SDPBackend.CUDNN_ATTENTION)
    return _backward_only(lambda *qkv: sdpa(*qkv, causal), q, k, v, dout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    batch, heads = grid_shape(args.length, args.head_dim)
    capability = torch.cuda.get_device_capability()
    row = (batch, heads, args.length, args.head_dim, args.causal, dtype)

    run = runner(*row, backward=True)
    one_pass = variants.SM90_ONE_PASS if args.head_dim <= 128 else variants.SM90_ONE_PASS_WIDE
    calls = {
        "flash_tile default": lambda: run(variants.default_backward_config(
            capability, args.head_dim, plain=True)),
        "flash_tile one pass": lambda: run(one_pass),
        "sdpa_cudnn": _cudnn_backward(*row),
    }
    for call in calls.values():  # compile and warm outside the profiler's window
        for _ in range(3):
            call()
    torch.cuda.synchronize()
    print(f"B={batch} H={heads} L={args.length} D={args.head_dim} causal={args.causal} "
          f"{args.dtype}; profiled in this order:")
    torch.cuda.profiler.start()
    for name, call in calls.items():
        call()
        torch.cuda.synchronize()
        print(f"  {name}")
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
