"""bench_launch.py --baseline: another tree's flash_tile imported beside this one under its
own name, and the public calls it times on both (the timing runs on a GPU; what the copy
and the calls are is checked here)."""

import pathlib
import shutil
import sys
import types

import pytest
import torch

import flash_tile

ROOT = pathlib.Path(__file__).parent.parent


@pytest.fixture
def bench_launch(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import bench_launch
    return bench_launch


def test_a_baseline_tree_imports_beside_this_one(bench_launch, tmp_path, monkeypatch):
    """The copy is its own package: its modules, kernels and custom ops (under its name's
    namespace) are not this tree's, and its sources are the baseline's (a change there is
    seen)."""
    tree = tmp_path / "base"
    for part in ("flash_tile", "kernels"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    marker = tree / "flash_tile" / "_launch.py"
    marker.write_text(marker.read_text() + "\nBASELINE_MARK = 'flash_tile'\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_package prepends the copy
    name = "flash_tile_launch_test"
    base = bench_launch.load_package(str(tree), name)
    assert base is not flash_tile and base.__name__ == name
    assert base._launch is not flash_tile._launch and not hasattr(flash_tile._launch,
                                                                  "BASELINE_MARK")
    assert base._launch.BASELINE_MARK == name  # the baseline's source, renamed
    assert base._launch.attention_fwd is not flash_tile._launch.attention_fwd
    assert pathlib.Path(base.kernels.__file__).parent.parent.name == name
    assert callable(getattr(torch.ops, name).attention_forward)
    assert base.flash_attn_func is not flash_tile.flash_attn_func


def test_public_layers_call_each_public_function_as_named(bench_launch):
    """Each layer calls the package's function on the shared arrays with its own arguments:
    the decode with the chosen split count, one split, and the append of the new row at the
    shorter length; the varlen call packed and paged (the cache as 16-key pages)."""
    calls = []

    def record(name):
        return lambda *args, **kwargs: calls.append((name, args, kwargs))

    package = types.SimpleNamespace(**{n: record(n) for n in (
        "flash_attn_func", "scaled_dot_product_attention", "flash_attn_with_kvcache",
        "flash_attn_varlen_func")})
    arrays = tuple(torch.randn(1, 32, 2, 4) for _ in range(14))
    (q, k, v, step_q, k_cache, v_cache, k_new, v_new, full, filled, cu_packed, cu_step,
     cu_cache, table) = arrays
    for fn in bench_launch.public_layers(package, arrays).values():
        fn()
    names = [name for name, _, _ in calls]
    assert names == ["flash_attn_func", "scaled_dot_product_attention"] + [
        "flash_attn_with_kvcache"] * 3 + ["flash_attn_varlen_func"] * 2
    packed, paged = calls[5:]
    assert [t.data_ptr() for t in packed[1][:3]] == [t.data_ptr() for t in (q, k, v)]
    assert packed[1][3:] == (cu_packed, cu_packed, 128, 128)
    assert paged[1][0].data_ptr() == step_q.data_ptr()
    assert [(t.data_ptr(), t.shape) for t in paged[1][1:3]] == [
        (t.data_ptr(), (2, 16, 2, 4)) for t in (k_cache, v_cache)]
    assert paged[1][3:] == (cu_step, cu_cache, 1, 1024)
    assert paged[2] == {"causal": True, "block_table": table}
    assert calls[0][1] == (q, k, v) and calls[0][2] == {"causal": True}
    assert [t.data_ptr() for t in calls[1][1]] == [t.data_ptr() for t in (q, k, v)]
    decode = calls[2:5]
    assert all(c[1][:3] == (step_q, k_cache, v_cache) for c in decode)
    assert decode[0][2] == {"causal": True, "cache_seqlens": full}
    assert decode[1][2] == {"causal": True, "cache_seqlens": full, "num_splits": 1}
    assert decode[2][1][3:] == (k_new, v_new) and decode[2][2] == {"causal": True,
                                                                   "cache_seqlens": filled}


def test_host_cost_on_a_cpu_times_both_trees_and_restores_what_it_stubs(monkeypatch,
                                                                          tmp_path):
    """bench_host_cpu.py's rows on this tree against a copy of it (an A/A): each call timed
    on both sides with a positive ratio, and every stub undone afterwards (torch's device
    query, cuTile's launch, the decode's SM count)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_package prepends the copy
    monkeypatch.setattr(flash_tile.autotune, "plans", {})  # the plans its calls make
    monkeypatch.setattr(flash_tile.autotune, "sighted", set())
    import bench_host_cpu

    for part in ("flash_tile", "kernels"):
        shutil.copytree(ROOT / part, tmp_path / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    get_device, launch = torch.Tensor.get_device, flash_tile._launch.ct.launch
    sm_count = flash_tile._launch_decode._sm_count
    rows = bench_host_cpu.measure(str(tmp_path), rounds=2, iters=2)
    assert [r["call"] for r in rows] == ["flash_attn_func", "flash_attn_func, FP8",
                                         "flash_attn_varlen_func",
                                         "flash_attn_varlen_func, paged",
                                         "flash_attn_varlen_func, paged FP8 cache",
                                         "flash_attn_with_kvcache",
                                         "flash_attn_with_kvcache, one split",
                                         "flash_attn_with_kvcache, append"]
    assert all(r["host_us"] > 0 and r["baseline_host_us"] > 0 and r["ratio"] > 0
               for r in rows)
    assert torch.Tensor.get_device is get_device and flash_tile._launch.ct.launch is launch
    assert flash_tile._launch_decode._sm_count is sm_count
    assert torch.randn(2).get_device() == -1
