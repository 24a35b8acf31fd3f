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


def spin(cycles: int) -> None:
    """Keep the current stream's GPU busy for about ``cycles`` clock cycles (a kernel that
    spins), so that launches issued meanwhile queue up and then run back to back."""
    torch.cuda._sleep(cycles)


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


def paired_ms(a: Callable[[], object], b: Callable[[], object], rounds: int, pairs: int,
              sleep_cycles: int) -> tuple[float, float, float]:
    """(median ms of a call of ``a``, of a call of ``b``, median cost of b over a) over
    ``rounds`` rounds: for an A/B cost too small for ``interleaved_ms``. A round queues
    2 * ``pairs`` calls behind a GPU sleep of ``sleep_cycles``, in the order A B B A A B B A
    ..., each between CUDA events: neighbours share the GPU's clocks, and the cost is the
    round's time in b over its time in a, minus 1. Calls timed in blocks of their own drifted
    apart: on the H200 20 back-to-back 8k causal forwards ran 8% slower after the first
    block, whichever of two calls it was
    (``docs/experiments/evidence/2026-12-03-timing-order-h200.md``). An even ``pairs`` gives a
    and b the same mean position, so a linear drift cancels; every round opens and closes
    with a, so a fast start after the sleep favours a and the cost errs high, not low."""
    if pairs % 2:
        raise ValueError(f"pairs must be even (A B B A blocks), got {pairs}")
    fns, times, costs = (a, b), ([], []), []
    order = [(i // 2 + i) % 2 for i in range(2 * pairs)]  # 0 1 1 0 0 1 1 0 ...
    for _ in range(rounds):
        for fn in fns:
            fn()  # nothing left to compile or allocate; then the GPU idles
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in order]
        spin(sleep_cycles)
        for which, (start, end) in zip(order, events):
            start.record()
            fns[which]()
            end.record()
        torch.cuda.synchronize()
        round_ms = ([], [])
        for which, (start, end) in zip(order, events):
            round_ms[which].append(start.elapsed_time(end))
        for which in (0, 1):
            times[which].extend(round_ms[which])
        costs.append(sum(round_ms[1]) / sum(round_ms[0]) - 1)
    return statistics.median(times[0]), statistics.median(times[1]), statistics.median(costs)


def hidden_fraction(communication: list[tuple[float, float]],
                    compute: list[tuple[float, float]]) -> float | None:
    """The share of the communication intervals' total length that some compute interval
    covers (intervals as (start, end) on one clock, e.g. a profile's GPU kernels); None
    without communication."""
    total = sum(end - start for start, end in communication)
    if total <= 0:
        return None
    merged: list[list[float]] = []  # the compute intervals' union, sorted and disjoint
    for start, end in sorted(compute):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    covered = sum(max(0.0, min(end, m_end) - max(start, m_start))
                  for start, end in communication for m_start, m_end in merged)
    return covered / total


def profiled_overlap(fn: Callable[[], object], is_communication: Callable[[str], bool]
                     ) -> float | None:
    """``hidden_fraction`` of one profiled call of ``fn`` on the current CUDA device: its GPU
    kernels named as communication by ``is_communication`` against all its other kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    # CPU activity too: the GPU kernels' events are correlated through their launches.
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in kernels]
    return hidden_fraction([(s, t) for n, s, t in spans if is_communication(n)],
                           [(s, t) for n, s, t in spans if not is_communication(n)])
