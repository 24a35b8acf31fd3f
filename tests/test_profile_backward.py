"""bench/profile_backward.py: what Nsight Compute's window (``--profile-from-start off``) holds
is one warm backward of each backend, in the printed order (the launches themselves run on a
GPU; the window is checked here with them stubbed)."""

import pathlib
import sys

import pytest

from flash_tile import variants

BENCH = pathlib.Path(__file__).parent.parent / "bench"


@pytest.fixture
def profiled(monkeypatch):
    """``run(head_dim)``: the script's main on sm_90 with each backend's call, the profiler's
    start and stop recorded in order (a backend by its config, cuDNN as "cudnn")."""
    monkeypatch.syspath_prepend(str(BENCH))
    import profile_backward

    cuda = profile_backward.torch.cuda
    events = []
    monkeypatch.setattr(profile_backward, "runner",
                        lambda *row, backward: lambda config: events.append(config))
    monkeypatch.setattr(profile_backward, "_cudnn_backward",
                        lambda *row: lambda: events.append("cudnn"))
    monkeypatch.setattr(cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(cuda, "synchronize", lambda: None)
    monkeypatch.setattr(cuda.profiler, "start", lambda: events.append("start"))
    monkeypatch.setattr(cuda.profiler, "stop", lambda: events.append("stop"))

    def run(head_dim):
        monkeypatch.setattr(sys, "argv", ["profile_backward.py", "--head-dim", str(head_dim)])
        profile_backward.main()
        return events
    return run


def test_the_profiler_window_holds_one_warm_call_of_each_backend(profiled, capsys):
    events = profiled(128)
    calls = [variants.default_backward_config((9, 0), 128, plain=True), variants.SM90_ONE_PASS,
             "cudnn"]
    start = events.index("start")
    assert events[:start] == [c for c in calls for _ in range(3)]  # compiled and warm first
    assert events[start:] == ["start", *calls, "stop"]
    printed = capsys.readouterr().out.split("\n")
    assert printed[0].startswith("B=4 H=16 L=4096 D=128")
    assert [line.strip() for line in printed[1:4]] == [
        "flash_tile default", "flash_tile one pass", "sdpa_cudnn"]


@pytest.mark.parametrize("head_dim", [64, 256])
def test_the_one_pass_tile_follows_the_head_dim(profiled, head_dim):
    events = profiled(head_dim)
    assert events[-3] == (variants.SM90_ONE_PASS if head_dim <= 128 else
                          variants.SM90_ONE_PASS_WIDE)
