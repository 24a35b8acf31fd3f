"""Host cost of planned calls on a machine without a GPU: this tree against another tree's.

What flash_tile's own Python adds to a repeated inference call (the plan lookup, the
allocations, the argument tuple), measured where no GPU is: both trees imported in one process
(``bench_launch.load_package``), and in each ``ct.launch`` replaced by a function that
returns, so that cuTile's own host cost (3-7 us on the GPU hosts of
docs/experiments/evidence/2026-12-06-launch-cost-cpu.md) is in neither figure. The device
checks, the device's properties (sm_90, 132 SMs) and the variant choice (the sm_90 default
for the call's head dim, final) are stubbed, and CPU tensors stand for CUDA ones
(``torch.Tensor.get_device`` answers 0); everything is restored on exit. The calls (bf16,
causal): ``flash_attn_func`` (B 1, L 128, H 8 / 2, D 64; also in FP8: e4m3 q, k, v with a
descale per (batch, key/value head) for q and k and a 0-d one for v, the forward's two
launches); ``flash_attn_varlen_func`` on 8 sequences of 100 queries and keys (H 32 / 8,
D 128), packed and against 16-key pages, in bf16 and as an FP8 cache (e4m3 pages with
k_descale per (sequence, key/value head) and a 0-d v_descale); ``flash_attn_with_kvcache``
steps (B 1, Lq 1, H 32 / 8, D 128, 1,000 of a 1k cache's keys): the chosen split count (a
decode and its combine), ``num_splits=1`` (one launch) and the append of a row (three).
Rounds alternate which side goes first; a call's ratio is the median of the rounds' ratios
(this tree's time over the baseline's).

    mkdir -p ab/base && git archive HEAD~1 flash_tile kernels | tar -x -C ab/base
    python bench/bench_host_cpu.py --baseline ab/base --out /tmp/host-cpu

The baseline must have the paged varlen call with an FP8 cache (eabed3e or later). Writes
<out>.json and <out>.md. A GPU host's figures come from ``bench_launch.py --baseline``.
"""

import argparse
import contextlib
import importlib
import json
import os
import platform
import statistics
import time
from unittest import mock

import torch

import flash_tile
from bench_attention import md_table
from bench_launch import load_package


@contextlib.contextmanager
def stubbed(*packages):
    """``packages`` (flash_tile and baseline copies) callable on CPU tensors as on a GPU's,
    their launches doing nothing; undone on exit."""
    with contextlib.ExitStack() as stack:
        def patch(target, name, value):
            stack.enter_context(mock.patch.object(target, name, value))
        patch(torch.Tensor, "get_device", lambda self: 0)
        patch(torch.cuda, "is_current_stream_capturing", lambda: False)
        patch(torch.cuda, "device", lambda device: contextlib.nullcontext())
        for package in packages:
            def module(name, package=package):
                return importlib.import_module(f"{package.__name__}.{name}")
            launch, variants = module("_launch"), module("variants")
            patch(launch.ct, "launch", lambda stream, grid, kernel, args, **hints: None)
            patch(launch, "current_stream", lambda device: None)
            patch(module("_validate"), "check_device", lambda *tensors: tensors[0].device)
            for name in ("_validate", "_ops", "_ops_paged", "_ops_fp8", "_ops_decode"):
                patch(module(name), "device_properties", lambda device: ((9, 0), "H200"))
            patch(module("_launch_decode"), "_sm_count", lambda device: 132)
            ops = module("_ops")
            def final(backward, q, k, v, *args, variants=variants, **kwargs):
                return variants.default_config((9, 0), max(q.shape[-1], v.shape[-1])), True
            if hasattr(ops, "_choose_final"):  # (older trees choose without it)
                patch(ops, "_choose_final", final)
            patch(ops, "_choose", lambda *args, **kwargs: final(*args, **kwargs)[0])
            patch(ops, "choice_is_final", lambda q, k: True)
        yield


def calls(package) -> dict:
    """The timed calls of ``package``, each on arrays of its own signature."""
    q, k, v = (torch.randn(1, 128, h, 64, dtype=torch.bfloat16) for h in (8, 2, 2))
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    fp8_descales = {"q_descale": torch.rand(1, 2) + 0.5, "k_descale": torch.rand(1, 2) + 0.5,
                    "v_descale": torch.tensor(0.5)}
    cu = torch.tensor([100 * i for i in range(9)], dtype=torch.int32)
    pq = torch.randn(800, 32, 128, dtype=torch.bfloat16)
    pk, pv = (torch.randn(800, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    pages = [torch.randn(64, 16, 8, 128, dtype=torch.bfloat16) for _ in range(2)]
    pages8 = [p.to(torch.float8_e4m3fn) for p in pages]
    descales = {"k_descale": torch.rand(8, 8) + 0.5, "v_descale": torch.tensor(0.5)}
    table = torch.arange(64, dtype=torch.int32).reshape(8, 8)
    dq = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16)
    cache = [torch.randn(1, 1024, 8, 128, dtype=torch.bfloat16) for _ in range(2)]
    new = [torch.randn(1, 1, 8, 128, dtype=torch.bfloat16) for _ in range(2)]
    lens = torch.tensor([1000], dtype=torch.int32)
    varlen, decode = package.flash_attn_varlen_func, package.flash_attn_with_kvcache
    return {
        "flash_attn_func": lambda: package.flash_attn_func(q, k, v, causal=True),
        "flash_attn_func, FP8": lambda: package.flash_attn_func(q8, k8, v8, causal=True,
                                                                **fp8_descales),
        "flash_attn_varlen_func": lambda: varlen(pq, pk, pv, cu, cu, 100, 100, causal=True),
        "flash_attn_varlen_func, paged": lambda: varlen(pq, *pages, cu, cu, 100, 100,
                                                        causal=True, block_table=table),
        "flash_attn_varlen_func, paged FP8 cache": lambda: varlen(
            pq, *pages8, cu, cu, 100, 100, causal=True, block_table=table, **descales),
        "flash_attn_with_kvcache": lambda: decode(dq, *cache, cache_seqlens=lens, causal=True),
        "flash_attn_with_kvcache, one split": lambda: decode(
            dq, *cache, cache_seqlens=lens, causal=True, num_splits=1),
        "flash_attn_with_kvcache, append": lambda: decode(
            dq, *cache, *new, cache_seqlens=lens, causal=True),
    }


def measure(baseline: str, rounds: int, iters: int) -> list[dict]:
    """Rows of ``calls`` on this tree and on ``baseline``'s: median us a call and the median
    of the rounds' ratios."""
    sides = {"tree": flash_tile, "baseline": load_package(baseline)}
    with stubbed(*sides.values()), torch.no_grad():
        timed = {side: calls(package) for side, package in sides.items()}
        for fns in timed.values():
            for fn in fns.values():
                for _ in range(3):  # the full path, then the plan made and used
                    fn()
        rows = []
        for name in timed["tree"]:
            us = {"tree": [], "baseline": []}
            for r in range(rounds):
                for side in (("tree", "baseline") if r % 2 else ("baseline", "tree")):
                    fn, start = timed[side][name], time.perf_counter()
                    for _ in range(iters):
                        fn()
                    us[side].append((time.perf_counter() - start) / iters * 1e6)
            ratios = [t / b for t, b in zip(us["tree"], us["baseline"])]
            rows.append({"call": name, "host_us": round(statistics.median(us["tree"]), 1),
                         "baseline_host_us": round(statistics.median(us["baseline"]), 1),
                         "ratio": round(statistics.median(ratios), 3),
                         "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)]})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, metavar="DIR",
                        help="a tree's flash_tile/ and kernels/ (git archive REV flash_tile "
                             "kernels | tar -x -C DIR)")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--out", default="bench/out/host-cpu")
    args = parser.parse_args()
    rows = measure(args.baseline, args.rounds, args.iters)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    info = {"machine": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "baseline": args.baseline, "rounds": args.rounds,
            "iters": args.iters, "rows": rows}
    with open(args.out + ".json", "w") as f:
        json.dump(info, f, indent=1)
    table = md_table(["call", "tree us", "baseline us", "tree / baseline (rounds)"],
                     [[r["call"], r["host_us"], r["baseline_host_us"],
                       f'{r["ratio"]}x ({r["ratio_range"][0]}-{r["ratio_range"][1]})']
                      for r in rows])
    text = (f"# Host cost on a CPU, launches stubbed, against {args.baseline}\n\n"
            f"{platform.platform()}, Python {platform.python_version()}, torch "
            f"{torch.__version__}; {args.rounds} rounds of {args.iters} calls a side.\n\n"
            + table + "\n")
    with open(args.out + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
