"""FLOP counts, GPU timing and the benchmark grid, shared by bench/, the autotuner and the
``flash-tile`` command (demo, tune)."""

import statistics
from typing import Callable, Hashable

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


def grid_shape(length: int, head_dim: int, tokens: int = GRID_TOKENS,
               width: int = GRID_WIDTH) -> tuple[int, int]:
    """(batch, heads) of the grid's row at ``length``: ``tokens`` tokens in all (at least one
    sequence) and heads * head dim = ``width``."""
    return max(1, tokens // length), max(1, width // head_dim)


def interleaved_ms(fns: dict[Hashable, Callable[[], object]], rounds: int,
                   time_ms: Callable[[Callable[[], object]], float]) -> dict:
    """The median of ``time_ms(fn)`` over ``rounds`` rounds for each fn, every fn once per
    round, so that a drift of the GPU's clocks over the measurement weighs on all of them
    alike (timed one after another, the H200 ranked tile configs that do the same work 7-9%
    apart). Odd rounds run the fns in reverse order, so that no fn always runs after the same
    one: under sustained load the time per call drifts (an H200 ran 8k causal forwards 8%
    slower after the first 50 ms; ``docs/experiments/evidence/2026-12-03-timing-order-h200.md``).
    A fn that raises is not timed again; its value is the exception."""
    samples = {name: [] for name in fns}
    failed = {}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            if name not in failed:
                try:
                    samples[name].append(time_ms(fns[name]))
                except Exception as e:  # noqa: BLE001 - the caller reports it
                    failed[name] = e
    return {name: failed[name] if name in failed else statistics.median(samples[name])
            for name in fns}
