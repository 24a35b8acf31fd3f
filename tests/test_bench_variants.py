"""bench_variants.py --baseline: another kernels/ directory loaded beside this tree's, and the
launcher pointed at it for a block and back (what runs on the GPU is timed there; what the
swap does is checked here)."""

import pathlib
import shutil
import sys

import pytest

from flash_tile import _launch, variants

BENCH = pathlib.Path(__file__).parent.parent / "bench"
KERNELS = pathlib.Path(__file__).parent.parent / "kernels"


@pytest.fixture
def bench_variants(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_variants
    return bench_variants


def _origin(kernel) -> pathlib.Path:
    return pathlib.Path(kernel._pyfunc.__code__.co_filename).resolve()


def test_baseline_kernels_load_from_their_own_directory(bench_variants, tmp_path):
    base = tmp_path / "kernels"
    shutil.copytree(KERNELS, base, ignore=shutil.ignore_patterns("__pycache__"))
    loaded = bench_variants.load_kernels(str(base))
    assert sorted(loaded) == sorted(bench_variants.KERNELS)
    for name, kernel in loaded.items():
        assert kernel is not getattr(_launch, name), name
        assert _origin(kernel).parent == base.resolve(), name
    # Its helpers are its own too: a change to _tiles.py in the baseline stays there.
    assert sys.modules["flash_tile_baseline_kernels._tiles"].__file__.startswith(str(base))


def test_launching_swaps_the_launchers_kernels_and_restores_them(bench_variants, tmp_path):
    base = tmp_path / "kernels"
    shutil.copytree(KERNELS, base, ignore=shutil.ignore_patterns("__pycache__"))
    loaded = bench_variants.load_kernels(str(base))
    config = variants.default_backward_config((9, 0), 64)
    ours = _launch.hinted_backward_kernels(config)
    with bench_variants.launching(loaded):
        inside = _launch.hinted_backward_kernels(config)
        assert [_origin(k).parent for k in inside] == [base.resolve()] * 2
        assert _origin(_launch.hinted_kernel(config)).parent == base.resolve()
    after = _launch.hinted_backward_kernels(config)
    assert [_origin(k) for k in after] == [_origin(k) for k in ours]
    assert all(_origin(k).parent == KERNELS.resolve() for k in after)
    with pytest.raises(RuntimeError), bench_variants.launching(loaded):
        raise RuntimeError("a failing launch inside the block")
    assert _launch.attention_bwd_dq is not loaded["attention_bwd_dq"]
