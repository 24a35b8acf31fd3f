"""The timing and grid helpers shared by the benchmarks and the autotuner, and the forward
benchmark's per-row bookkeeping, on the CPU: timings are stand-ins, the checks are real."""

import sys
from pathlib import Path

import pytest
import torch

from flash_tile import _timing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_attention  # noqa: E402  (bench/ is a folder of scripts, not a package)


def test_interleaved_rounds_take_every_fn_once_per_round_alternating_and_keep_the_median():
    order = []
    samples = {"a": iter([1.0, 9.0, 2.0]), "b": iter([3.0, 3.0, 4.0])}

    def time_ms(fn):
        order.append(fn())
        return next(samples[order[-1]])

    got = _timing.interleaved_ms({"a": lambda: "a", "b": lambda: "b"}, 3, time_ms)
    assert order == ["a", "b", "b", "a", "a", "b"]  # odd rounds reversed
    assert got == {"a": 2.0, "b": 3.0}


def test_a_fn_that_raises_is_dropped_with_its_exception():
    calls = []

    def boom():
        calls.append("boom")
        raise RuntimeError("out of memory")

    got = _timing.interleaved_ms({"ok": lambda: None, "boom": boom}, 3,
                                 lambda fn: (fn(), 1.0)[1])
    assert got["ok"] == 1.0 and isinstance(got["boom"], RuntimeError)
    assert calls == ["boom"]  # not timed again after it raised


@pytest.mark.parametrize("length,head_dim,expected", [(1024, 64, (16, 32)), (16384, 128, (1, 16)),
                                                      (32768, 256, (1, 8))])
def test_grid_shape(length, head_dim, expected):
    assert _timing.grid_shape(length, head_dim) == expected


def test_measure_checks_before_timing_and_times_the_right_ones_together(monkeypatch):
    ref = torch.randn(4, 8)
    order = []
    runners = {"right": lambda: ref.clone(), "also_right": lambda: ref.clone(),
               "wrong": lambda: ref + 1.0, "broken": lambda: 1 / 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench_attention, "_peak_bytes", lambda fn: 2**20)

    def time_ms(fn, warmup, iters):
        order.append(next(name for name, run in runners.items() if run is fn))
        return 2.0

    monkeypatch.setattr(bench_attention, "cuda_time_ms", time_ms)
    row = {"tflops": {}, "peak_mib": {}, "max_err": {}, "skipped": {}}
    bench_attention.measure(row, runners, ref, ref, 4e9)
    assert row["tflops"] == {"right": 2.0, "also_right": 2.0}  # 4e9 FLOPs in 2 ms
    assert row["skipped"]["wrong"].startswith("wrong result")
    assert row["skipped"]["broken"].startswith("failed: division by zero")
    pair = ["right", "also_right"]
    assert order == [name for r in range(bench_attention.ROUNDS)
                     for name in (pair if r % 2 == 0 else pair[::-1])]


def test_paired_rounds_alternate_neighbours_and_take_the_median_ratio(monkeypatch):
    """Each round: both calls once untimed, then A B B A ... between events; the cost is the
    round's B time over its A time, and the medians are over calls and rounds."""
    clock, calls = [0.0], []
    durations = {"a": iter([1.0] * 4 + [1.0] * 4 + [1.0] * 4),
                 "b": iter([1.1] * 4 + [1.5] * 4 + [1.2] * 4)}

    class Event:
        def __init__(self, enable_timing):
            self.t = None

        def record(self):
            self.t = clock[0]

        def elapsed_time(self, end):
            return end.t - self.t

    def call(name):
        def fn():
            calls.append(name)
            if timed[0]:
                clock[0] += next(durations[name])
        return fn

    timed = [False]
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: timed.__setitem__(0, False))
    monkeypatch.setattr(_timing, "spin", lambda cycles: timed.__setitem__(0, True))
    a_ms, b_ms, cost = _timing.paired_ms(call("a"), call("b"), 3, 4, 1)
    assert calls[:10] == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert len(calls) == 3 * 10
    assert (a_ms, b_ms, cost) == pytest.approx((1.0, 1.2, 0.2))  # medians, not means
    with pytest.raises(ValueError, match="even"):
        _timing.paired_ms(call("a"), call("b"), 1, 3, 1)


def test_hidden_fraction_counts_the_covered_share_of_communication():
    # 10 units of communication: 0-4 half covered by 2-6, 10-16 covered by 9-12 and 11-14
    # (merged to 9-14): 2 + 4 = 6 of 10.
    assert _timing.hidden_fraction([(0, 4), (10, 16)], [(11, 14), (2, 6), (9, 12)]) == 0.6
    assert _timing.hidden_fraction([(0, 4)], []) == 0.0
    assert _timing.hidden_fraction([(0, 4)], [(-1, 9)]) == 1.0
    assert _timing.hidden_fraction([], [(0, 1)]) is None
