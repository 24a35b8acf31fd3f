"""Context-parallel benchmark: one sequence sharded over W GPUs against one GPU.

Each row is one causal sequence of L tokens (bf16, D = 128, GQA 32/8): ``flash_attn_func`` on
one GPU, then ``flash_tile.distributed.ring_flash_attn_func`` on W GPUs (W processes, NCCL,
zigzag shards, ``--communication``: the ring of point-to-point passes or the all-gather),
forward and forward+backward. The sharded run's output is checked against
the one-GPU output (the largest difference is recorded: bf16 rounding apart, both run the
same kernels). TFLOP/s count the whole sequence's
FLOPs (``_timing.flops``) over the slowest rank's median time; ``speedup_vs_1gpu`` is the
W-GPU rate over the one-GPU rate. ``communication_hidden`` is the share of the NCCL kernels'
time that other kernels overlap in one profiled forward and forward+backward (torch.profiler;
the least of the ranks). ``gather_ms`` times the K all-gather alone: the all-gather
form gathers K and V before its kernels, so none of it is hidden; the ring passes the same
bytes in W - 1 steps beside its kernels.

    python bench/bench_context_parallel.py            # bench/results/context-parallel-<gpu>x2.*
    python bench/bench_context_parallel.py --communication all_gather --out /tmp/cp-gather

The kernels run their shipped tiles (``FLASH_TILE_AUTOTUNE=0`` unless the environment says
otherwise). Needs W GPUs on one host. NVLink multicast stays off (flash_tile.distributed sets
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
Writes <out>.json (rows with ``seqlen``, ``tflops`` {"1gpu", "2gpu"} and
``fwd_bwd_tflops`` likewise, ``speedup_vs_1gpu``, ``fwd_bwd_speedup_vs_1gpu``, ``gather_ms``,
``communication``, ``communication_hidden``),
<out>.md and <out>.png.
"""

import argparse
import math
import os
import statistics
import tempfile

# The shipped tiles, untuned: tuning each new class on its first call would take minutes of
# each rank's time (the ring's chunk shapes and the whole sequence's), and its picks would
# differ between the two sides.
os.environ.setdefault("FLASH_TILE_AUTOTUNE", "0")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flash_tile
from bench_attention import (machine_info, md_table, pass_bars, results_path, save_json,
                             write_report)
from flash_tile import distributed
from flash_tile._timing import cuda_time_ms, flops, profiled_overlap

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
ROUNDS = 3


def _inputs(length, device):
    gen = torch.Generator(device=device).manual_seed(length)
    return [torch.randn(1, length, h, HEAD_DIM, generator=gen, device=device,
                        dtype=torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)]


def _steps(attention, q, k, v, dout):
    """(forward, forward+backward) of ``attention`` as zero-argument calls on leaves."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        attention(*leaves).backward(dout)
    return (lambda: attention(*leaves)), fwd_bwd


def _median_ms(fn):
    return statistics.median(cuda_time_ms(fn, warmup=1, iters=3) for _ in range(ROUNDS))


def _hidden(fn) -> float:
    """The share of one call's NCCL kernel time that other kernels overlap (a profile; NaN
    without communication kernels)."""
    share = profiled_overlap(fn, lambda name: "nccl" in name.lower())
    return math.nan if share is None else share


def _worker(rank, world, path, lengths, communication, results):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        for length in lengths:
            whole = _inputs(length, f"cuda:{rank}")
            q, k, v, dout = (distributed.zigzag_shard(t, rank, world) for t in whole)
            forward, fwd_bwd = _steps(
                lambda *t: distributed.ring_flash_attn_func(*t, causal=True,
                                                            communication=communication),
                q, k, v, dout)
            mine = forward().detach()
            times = torch.tensor([_median_ms(forward), _median_ms(fwd_bwd),
                                  _median_ms(lambda k=k: distributed.gather_shards(k))],
                                 device=f"cuda:{rank}")
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            shares = []
            for step in (forward, fwd_bwd):
                dist.barrier()  # the ranks start each profile together
                shares.append(_hidden(step))
            hidden = torch.tensor(shares, device=f"cuda:{rank}")
            dist.all_reduce(hidden, op=dist.ReduceOp.MIN)  # the least hidden rank's share
            if rank == 0:  # one GPU on the whole sequence, and rank 0's rows against it
                one_fwd, one_fwd_bwd = _steps(
                    lambda *t: flash_tile.flash_attn_func(*t, causal=True), *whole[:3],
                    whole[3])
                expect = distributed.zigzag_shard(one_fwd().detach(), 0, world)
                results[length] = (*times.tolist(), _median_ms(one_fwd),
                                   _median_ms(one_fwd_bwd),
                                   (mine.float() - expect.float()).abs().max().item(),
                                   *hidden.tolist())
            del whole, q, k, v, dout, mine
            torch.cuda.empty_cache()
            dist.barrier()
    finally:
        dist.destroy_process_group()


def bench(lengths, world, communication):
    rows = []
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        results = manager.dict()
        mp.spawn(_worker, args=(world, os.path.join(tmp, "rendezvous"), lengths, communication,
                                results), nprocs=world, join=True)
        for length in lengths:
            (fwd_ms, fwd_bwd_ms, gather_ms, one_fwd, one_fwd_bwd, err, hidden_fwd,
             hidden_fwd_bwd) = results[length]
            f = flops(1, HEADS, length, length, HEAD_DIM, True)
            sharded = _sharded_key(world)
            rows.append({
                "seqlen": length, "gpus": world, "communication": communication,
                "max_abs_diff_vs_1gpu": err,
                "tflops": {"1gpu": round(f / one_fwd / 1e9, 1),
                           sharded: round(f / fwd_ms / 1e9, 1)},
                "fwd_bwd_tflops": {"1gpu": round(3.5 * f / one_fwd_bwd / 1e9, 1),
                                   sharded: round(3.5 * f / fwd_bwd_ms / 1e9, 1)},
                "speedup_vs_1gpu": round(one_fwd / fwd_ms, 3),
                "fwd_bwd_speedup_vs_1gpu": round(one_fwd_bwd / fwd_bwd_ms, 3),
                "gather_ms": round(gather_ms, 3),
                "communication_hidden": {"fwd": _share(hidden_fwd),
                                         "fwd_bwd": _share(hidden_fwd_bwd)}})
    return rows


def _sharded_key(world: int) -> str:
    """The sharded run's key in the rows' dicts: "2gpu" beside "1gpu" (one rank, a smoke
    run on one GPU: "1gpu_ring")."""
    return f"{world}gpu" if world > 1 else "1gpu_ring"


def _share(value: float) -> float | None:
    """A hidden share for the JSON: None where the profile showed no NCCL kernel (NaN is not
    JSON)."""
    return None if math.isnan(value) else round(value, 3)


def table(rows):
    head = ["L", "GPUs", "fwd TFLOP/s 1 GPU", "fwd W GPUs", "speedup", "fwd+bwd 1 GPU",
            "fwd+bwd W GPUs", "speedup", "NCCL time hidden fwd / fwd+bwd", "K gather ms",
            "target (>= 1.8x at L >= 64k)"]
    lines = []
    for r in rows:
        w = _sharded_key(r["gpus"])
        met = r["seqlen"] < 65536 or min(r["speedup_vs_1gpu"],
                                          r["fwd_bwd_speedup_vs_1gpu"]) >= 1.8
        lines.append([r["seqlen"], r["gpus"], r["tflops"]["1gpu"], r["tflops"][w],
                      f"{r['speedup_vs_1gpu']:.2f}x", r["fwd_bwd_tflops"]["1gpu"],
                      r["fwd_bwd_tflops"][w], f"{r['fwd_bwd_speedup_vs_1gpu']:.2f}x",
                      " / ".join("n/a" if x is None else f"{x:.0%}"
                                 for x in r["communication_hidden"].values()),
                      r["gather_ms"], "met" if met else "missed"])
    return (f"Causal, bf16, D = {HEAD_DIM}, GQA {HEADS}/{KV_HEADS}, batch 1, "
            f"communication {rows[0]['communication']}; the slowest rank's median GPU "
            "time.\n\n" + md_table(head, lines))


def plot(rows, path):
    pass_bars(path, [f"{r['seqlen'] // 1024}k" for r in rows],
              [r["speedup_vs_1gpu"] for r in rows], [r["fwd_bwd_speedup_vs_1gpu"] for r in rows],
              1.8, "1.8x target", "speedup over one GPU")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", nargs="+", type=int,
                        default=[32768, 65536, 131072, 262144])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--communication", default="ring", choices=distributed.COMMUNICATIONS)
    parser.add_argument("--out", help="output path prefix (default: "
                                      "bench/results/context-parallel-<gpu>x<W>)")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"needs {args.gpus} GPUs, {torch.cuda.device_count()} visible")
    args.out = args.out or results_path("context-parallel") + f"x{args.gpus}"
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    info = machine_info()
    rows = []
    for length in args.lengths:  # a process group a length: a run cut short keeps its rows
        rows += bench([length], args.gpus, args.communication)
        save_json(args.out, info, rows=rows)
    write_report(args.out, f"Context parallelism, {args.gpus} GPUs against one", info,
                 table(rows))
    plot(rows, args.out + ".png")
    print(table(rows))


if __name__ == "__main__":
    main()
