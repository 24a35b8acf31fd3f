"""FLOP counts, GPU timing and the benchmark grid, shared by bench/ and the ``flash-tile``
command (demo, tune)."""

import statistics

import torch

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# The benchmark grid, as flash-attention's: batch * seqlen tokens and heads * head dim fixed.
GRID_TOKENS = 16384
GRID_WIDTH = 2048
GRID_LENGTHS = (1024, 2048, 4096, 8192, 16384)


def flops(batch: int, heads: int, q_len: int, k_len: int, head_dim: int, causal: bool,
          mode: str = "fwd") -> float:
    """FLOPs as flash-attention counts them: forward 4 B H Lq Lk D (two matmuls of 2 FLOPs a
    multiply-add), halved when causal; backward 2.5x the forward."""
    f = 4.0 * batch * heads * q_len * k_len * head_dim / (2 if causal else 1)
    return {"fwd": f, "bwd": 2.5 * f, "fwd_bwd": 3.5 * f}[mode]


def cuda_time_ms(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds of ``fn()`` on the current stream, by CUDA events, after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)
