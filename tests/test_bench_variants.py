"""bench_variants.py --baseline: another kernels/ directory loaded beside this tree's, and the
launcher pointed at it for a block and back (what runs on the GPU is timed there; what the
swap does is checked here)."""

import dataclasses
import pathlib
import shutil
import sys

import pytest
import torch

from flash_tile import _launch, variants

BENCH = pathlib.Path(__file__).parent.parent / "bench"
KERNELS = pathlib.Path(__file__).parent.parent / "kernels"


@pytest.fixture
def bench_variants(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_variants
    return bench_variants


def _origin(name: str, kernel) -> pathlib.Path:
    """The file of the baseline module whose entry point ``name`` is ``kernel``."""
    for module in ("attention_fwd", "attention_bwd"):
        module = sys.modules[f"flash_tile_baseline_kernels.{module}"]
        if getattr(module, name, None) is kernel:
            return pathlib.Path(module.__file__).resolve()
    raise AssertionError(f"{name} is no baseline module's")


def test_baseline_kernels_load_from_their_own_directory(bench_variants, tmp_path):
    base = tmp_path / "kernels"
    shutil.copytree(KERNELS, base, ignore=shutil.ignore_patterns("__pycache__"))
    loaded = bench_variants.load_kernels(str(base))
    assert sorted(loaded) == sorted(bench_variants.KERNELS)
    for name, kernel in loaded.items():
        assert kernel is not getattr(_launch, name), name
        assert _origin(name, kernel).parent == base.resolve(), name
    # Its helpers are its own too: a change to _tiles.py in the baseline stays there.
    assert sys.modules["flash_tile_baseline_kernels._tiles"].__file__.startswith(str(base))


def test_launching_swaps_the_launchers_kernels_and_restores_them(bench_variants, tmp_path,
                                                                monkeypatch):
    """Inside the block the launcher hints (and so launches) the baseline's entry points,
    after it its own again, also when the block raises."""
    base = tmp_path / "kernels"
    shutil.copytree(KERNELS, base, ignore=shutil.ignore_patterns("__pycache__"))
    loaded = bench_variants.load_kernels(str(base))
    ours = {name: getattr(_launch, name) for name in loaded}
    hinted = []
    with_hints = _launch._with_hints
    monkeypatch.setattr(_launch, "_with_hints", lambda kernel, hints: (
        hinted.append(kernel), with_hints(kernel, hints))[1])
    config = variants.default_backward_config((9, 0), 64)
    assert not config.one_pass  # the two passes: (dQ, dK/dV), each hinted
    with bench_variants.launching(loaded):
        _launch.hinted_backward_kernels(config)
        _launch.hinted_kernel(config)
        assert all(getattr(_launch, name) is kernel for name, kernel in loaded.items())
    assert hinted == [loaded["attention_bwd_dq"], loaded["attention_bwd_dkdv"],
                      loaded["attention_fwd"]]
    hinted.clear()
    _launch.hinted_backward_kernels(config)
    assert hinted == [ours["attention_bwd_dq"], ours["attention_bwd_dkdv"]]
    assert all(getattr(_launch, name) is kernel for name, kernel in ours.items())
    with pytest.raises(RuntimeError), bench_variants.launching(loaded):
        raise RuntimeError("a failing launch inside the block")
    assert all(getattr(_launch, name) is kernel for name, kernel in ours.items())


def test_a_baseline_tree_or_its_kernels_folder_loads(bench_variants, tmp_path):
    """DIR may be the baseline's kernels/ folder or the tree that holds it (what
    bench_launch's --baseline takes): the same entry points either way."""
    shutil.copytree(KERNELS, tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    from_tree = sorted(bench_variants.load_kernels(str(tmp_path)))
    assert from_tree == sorted(bench_variants.load_kernels(str(tmp_path / "kernels")))
    assert from_tree == sorted(bench_variants.KERNELS)


def test_the_table_marks_rows_whose_outputs_are_identical(bench_variants):
    """With --baseline, a row whose two sides gave bitwise-equal outputs says so: the same
    config on kernels that already have the change times an A/A, not the change."""
    def row(diff):
        name = "128x128 num_worker_warps=8"
        return {"head_dim": 256, "length": 4096, "causal": False, "variants": [name],
                "ms": {name: 0.51, f"{name} (baseline)": 0.54}, "ratio": {name: 0.944},
                "max_diff": {name: diff}}
    text = bench_variants.table([row(0.0), row(0.0147)], ['{"exp2_fma": 4}'], "baseline")
    lines = [line for line in text.splitlines() if line.startswith("| 256")]
    assert len(lines) == 2
    assert "max diff 0, identical outputs" in lines[0]
    assert "max diff 0.0147)" in lines[1] and "identical" not in lines[1]


def recording_paired_ms(seen: list, paired: list, result: tuple):
    """A stand-in for ``paired_ms`` that calls A then B once, appends what their runs put in
    ``seen`` (emptied first), the rounds and the pairs to ``paired``, and returns
    ``result``."""
    def paired_ms(a, b, rounds, pairs, sleep_cycles):
        seen.clear()
        a()
        b()
        paired.append((list(seen), rounds, pairs))
        return result
    return paired_ms


def test_paired_rounds_time_each_side_by_paired_ms(bench_variants, tmp_path, monkeypatch):
    """--paired: each config's two sides go to paired_ms, the baseline's as A, and the ratio
    is 1 + its median cost (not the quotient of the two medians); each side's calls run
    with its own kernels in the launcher."""
    shutil.copytree(KERNELS, tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    loaded = bench_variants.load_kernels(str(tmp_path / "kernels"))
    ours = {name: getattr(_launch, name) for name in loaded}
    seen, paired = [], []

    def run(config):
        seen.append(_launch.attention_fwd)
        return (torch.full((2,), 1.5 if _launch.attention_fwd is ours["attention_fwd"] else 1.0),)

    monkeypatch.setattr(bench_variants, "paired_ms", recording_paired_ms(seen, paired,
                                                                         (2.0, 1.9, -0.07)))
    config = variants.default_config((9, 0), 128)
    ms, diffs, ratios = bench_variants.against_baseline([config], run, loaded, paired_rounds=7)
    name = bench_variants.autotune.describe(config)
    assert paired == [([loaded["attention_fwd"], ours["attention_fwd"]], 7, bench_variants.PAIRS)]
    assert ms == {name: 1.9, f"{name} (baseline)": 2.0}
    assert ratios == {name: 0.93}  # 1 + cost, where 1.9 / 2.0 would say 0.95
    assert diffs[name] == 0.5
    assert _launch.attention_fwd is ours["attention_fwd"]


def test_paired_alone_times_each_config_against_the_default(bench_variants, monkeypatch):
    """--paired without --baseline: each overlaid config goes to paired_ms with the default
    as A, its difference measured from the default's outputs, its ratio 1 + the median cost;
    the table gives both times under the config's name."""
    default = variants.default_config((9, 0), 128)
    narrow = dataclasses.replace(default, tile_n=default.tile_n // 2)
    ran, paired = [], []

    def run(config):
        ran.append(config)
        return (torch.full((3,), 2.0 if config == default else 2.25),)

    monkeypatch.setattr(bench_variants, "paired_ms", recording_paired_ms(ran, paired,
                                                                         (1.0, 0.9, -0.12)))
    ms, diffs, ratios = bench_variants.against_default([default, narrow], run, 5)
    name = bench_variants.autotune.describe(narrow)
    assert paired == [([default, narrow], 5, bench_variants.PAIRS)]
    assert ms == {name: 0.9, f"{name} (default)": 1.0}
    assert ratios == {name: 0.88} and diffs == {name: 0.25}
    row = {"head_dim": 128, "length": 1024, "causal": True, "variants": [name], "ms": ms,
           "ratio": ratios, "max_diff": diffs}
    text = bench_variants.table([row], ['{"tile_n": 64}'], "default")
    assert "config / default (ratio)" in text
    assert f"{name}: 0.9 / 1.0 (0.88x; max diff 0.25)" in text
