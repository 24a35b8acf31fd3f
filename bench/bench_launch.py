"""Host cost of one forward call and one backward call, layer by layer, beside SDPA's.

On short problems the host can take longer to issue a call than the GPU takes to run it; the
forward benchmark's 1k rows then measure the host, not the kernel. This script splits a call
into the layers it passes through and times each on its own, with the default variant
(``FLASH_TILE_AUTOTUNE=0``: no tuning inside the timed calls):

  flash_attn_func   the public call: after a signature's first call, an inference call runs
                    the plan that call left (``flash_tile._plans``: fresh outputs and one
                    launch); a call that records autograd takes the full path (validation,
                    layout, the eager path and everything below)
  scaled_dot_product_attention
                    flash_tile's SDPA drop-in on torch's [B, H, L, D] layout, planned alike
  eager path        ``_ops.attention_forward`` in eager mode: the op's body (``_choose``, the
                    output allocation and the launch), through an autograd.Function when an
                    input needs its gradient (the "with grad" column) and alone otherwise;
                    what the public call adds to it is validation and layout
  custom op         ``torch.ops.flash_tile.attention_forward``, the same body behind torch's
                    dispatcher (what torch.compile's graphs call)
  launch_forward    the output allocation and ``_launch.launch_forward``: the autotuner's path
  ct.launch         cuTile's launch of a prebuilt argument tuple alone
  sdpa              ``torch.nn.functional.scaled_dot_product_attention`` (torch's backend choice)

and the backward's:

  autograd          ``torch.autograd.grad`` through ``flash_attn_func``'s output: the autograd
                    engine, the eager path's backward (dout's layout, ``_choose``, the gradient
                    allocations) and everything below
  backward op       ``torch.ops.flash_tile.attention_backward`` behind torch's dispatcher
  launch_backward   the gradient allocations and ``_launch.launch_backward`` (two launches:
                    dQ with Delta, then dK/dV): the autotuner's path
  sdpa              ``torch.autograd.grad`` through SDPA's output

For each layer, ``host us`` is the host's time per call to issue ITERS calls back to back
(B=1, H=1, L=128), the GPU's work not waited for (``back_to_back_us``): where a call's kernels take
longer than its host path (a one-split decode of a 1k cache runs 8 programs), a wall time
would be the GPU's; ITERS queued launches stay far below the depth at which the launch queue
blocks the host. The median of ROUNDS rounds that visit the layers in turn (so that a slow
stretch of the host falls on every layer alike); ``with grad`` is the same with q, k and v
needing their gradients (a training step's forward: autograd records the call). At the
benchmark grid's row for ``--length`` and ``--head-dim``, ``ms per call`` is the wall time
per call of back-to-back calls (synchronised at the end) and ``device ms`` the GPU's time
per call with the calls queued behind a sleep kernel, so that no launch gap is counted (CUDA
events around single calls, as the benchmarks take them, count the gap when the host is
slower than the GPU). Where ``ms per call`` exceeds ``device ms``, the host sets the pace.
The backward's layers have no "with grad" column: every one of them is a training step's.

A third table takes a decode step (``flash_attn_with_kvcache``) apart the same way
(``decode_layers``), each layer's synchronised wall time beside its issue time. With
``--baseline DIR`` (a tree's ``flash_tile/`` and ``kernels/``, as ``git archive <commit>
flash_tile kernels | tar -x -C DIR`` unpacks them) a fourth table times the public calls a
host-path change moves (``public_layers``) on this tree and on DIR's, imported side by side
in this process (``load_package``), in the same interleaved rounds, with each pair's outputs
compared first: the one-command A/B of such a change.

    python bench/bench_launch.py --length 1024 --head-dim 64 --out /tmp/launch
    mkdir -p ab/base && git archive HEAD~1 flash_tile kernels | tar -x -C ab/base
    python bench/bench_launch.py --baseline ab/base --out /tmp/launch-ab

Writes <out>.json and <out>.md.
"""

import argparse
import functools
import importlib
import os
import pathlib
import re
import shutil
import statistics
import sys
import tempfile
import time

import cuda.tile as ct
import torch
import torch.nn.functional as F

import flash_tile
from flash_tile import _launch, _launch_decode, _ops, _ops_decode, decode_variants, variants
from flash_tile._timing import grid_shape
from bench_attention import device_ms, machine_info, md_table, save_json, write_report

ITERS = 100
ROUNDS = 7


def _op_arguments(q: torch.Tensor, k: torch.Tensor, causal: bool) -> tuple[float, int, int]:
    """(scale, diag_offset, window_right) of the op for flash-attn's [B, L, H, D] q and k."""
    return q.shape[-1] ** -0.5, k.shape[1] - q.shape[1], 0 if causal else -1


def layers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> dict:
    """Zero-argument callables, one per layer, for q, k, v in flash-attn's [B, L, H, D]."""
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
    scale, offset, right = _op_arguments(q, k, causal)
    config = variants.default_config(torch.cuda.get_device_capability(q.device), q.shape[-1])
    # The layers below autograd see plain tensors, as the op's body does.
    qd, kd, vd = (t.detach() for t in (qb, kb, vb))
    tuner_path = functools.partial(
        _ops.forward_runner(qd, kd, vd, None, None, scale, 0.0, offset, (-1, right), False),
        config)
    out, _ = _ops._forward_outputs(qd, vd, False)
    grid, kernel, args = _launch.forward_launch(qd, kd, vd, out, None, None, None, scale, 0.0,
                                                offset, (-1, right), config)
    stream = torch.cuda.current_stream(q.device)
    return {
        "flash_attn_func": lambda: flash_tile.flash_attn_func(q, k, v, causal=causal),
        "scaled_dot_product_attention": lambda: flash_tile.scaled_dot_product_attention(
            qb, kb, vb, is_causal=causal),
        "eager path": lambda: _ops.attention_forward(
            qb, kb, vb, None, None, scale, 0.0, offset, -1, right, False),
        "custom op": lambda: torch.ops.flash_tile.attention_forward(
            qb, kb, vb, None, None, scale, 0.0, offset, -1, right, False),
        "launch_forward": tuner_path,
        "ct.launch": lambda: ct.launch(stream, grid, kernel, args),
        "sdpa": lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal),
    }


def backward_layers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> dict:
    """Zero-argument callables, one per backward layer, for q, k, v in flash-attn's
    [B, L, H, D] (they must need their gradients). Each runs the same backward again: the
    forward's graph is kept."""
    qb, kb, vb = (t.detach().transpose(1, 2) for t in (q, k, v))
    scale, offset, right = _op_arguments(q, k, causal)
    out = flash_tile.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    sdpa_out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                              is_causal=causal)
    out_b, lse = _ops._forward_impl(qb, kb, vb, None, None, scale, 0.0, offset, -1, right, True)
    dout_b = dout.transpose(1, 2)
    config = variants.default_backward_config(torch.cuda.get_device_capability(q.device),
                                              q.shape[-1], plain=True)
    tuner_path = functools.partial(
        _ops.backward_runner(dout_b, qb, kb, vb, out_b, lse, None, None, None, scale, 0.0,
                             offset, (-1, right)), config)
    return {
        "autograd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
        "backward op": lambda: torch.ops.flash_tile.attention_backward(
            dout_b, qb, kb, vb, out_b, lse, None, None, None, scale, 0.0, offset, -1, right),
        "launch_backward": tuner_path,
        "sdpa": lambda: torch.autograd.grad(sdpa_out, (q, k, v), dout.transpose(1, 2),
                                            retain_graph=True),
    }


def graph_replay(call):
    """A zero-argument replay of ``call`` captured once in a CUDA graph (after a warm-up call
    outside the capture): what a serving loop that captures its decode step pays a call."""
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def decode_layers(heads: int, kv_heads: int, head_dim: int, length: int = 1024) -> dict:
    """Zero-argument callables, one per layer of a decode step (B = 1, Lq = 1, a cache of
    ``length`` keys, bf16, causal), beside SDPA's with ``enable_gqa``:

      flash_attn_with_kvcache     the public call, the chosen split count (two launches when
                                  it splits), then with num_splits=1 (one launch); after
                                  the first call of its signature it runs that call's plan
                                  (``flash_tile._plans``: no checks, the decode planned)
      op body                     ``_ops_decode._kvcache_impl``: the op's body, the full path
                                  without the checks
      launch_decode               the output allocation and ``_launch_decode.launch_decode``
      ct.launch                   cuTile's launch of the decode kernel's prebuilt arguments
                                  (with programmatic dependent launch where the config
                                  asks for it, as the call does), then without it
      graph replay                the public call captured in a CUDA graph, replayed
      sdpa, sdpa graph replay     SDPA (torch's backend choice), plain and replayed
    """
    q = torch.randn(1, 1, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, length, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    lens = torch.full((1,), length, dtype=torch.int32, device="cuda")
    scale = head_dim ** -0.5
    config = decode_variants.default_decode_config(torch.cuda.get_device_capability(), head_dim)
    out = torch.empty_like(q)
    prebuilt = []
    real_launch = _launch.ct.launch

    def record(*args, **kwargs):  # the launch_decode's own arguments, kept once
        prebuilt.append((args, kwargs))
        return real_launch(*args, **kwargs)

    _launch.ct.launch = record
    try:
        _launch_decode.launch_decode(q, k, v, out, None, lens, None, None, None, scale, 0.0,
                                     (-1, 0), 0, 1, config)
    finally:
        _launch.ct.launch = real_launch
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def public(splits=0):
        return flash_tile.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True,
                                                  num_splits=splits)

    def sdpa():
        return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

    return {
        "flash_attn_with_kvcache": public,
        "flash_attn_with_kvcache, one split": functools.partial(public, 1),
        "op body": functools.partial(_ops_decode._kvcache_impl, q, k, v, None, None, lens,
                                     None, None, None, scale, 0.0, -1, 0, 0, False),
        "launch_decode, one split": lambda: _launch_decode.launch_decode(
            q, k, v, torch.empty_like(q), None, lens, None, None, None, scale, 0.0, (-1, 0), 0,
            1, config),
        "ct.launch": functools.partial(ct.launch, *prebuilt[0][0], **prebuilt[0][1]),
        "ct.launch, no PDL": functools.partial(ct.launch, *prebuilt[0][0],
                                               programmatic_dependent_launch=False),
        "graph replay": graph_replay(public),
        "sdpa": sdpa,
        "sdpa graph replay": graph_replay(sdpa),
    }


def load_package(directory: str, name: str = "flash_tile_baseline"):
    """The flash_tile package of the tree at ``directory`` (its ``flash_tile/`` and
    ``kernels/``), imported beside this tree's as ``name``: a copy in a temporary directory
    with every ``flash_tile`` name in its sources renamed, so that its custom ops, kernels,
    caches and plans are its own. (An editable install of this tree wins over PYTHONPATH, so
    a second tree cannot be imported under the same name.)"""
    copy = pathlib.Path(tempfile.mkdtemp(prefix="bench-launch-")) / name
    shutil.copytree(pathlib.Path(directory) / "flash_tile", copy,
                    ignore=shutil.ignore_patterns("__pycache__", "kernels"))
    shutil.copytree(pathlib.Path(directory) / "kernels", copy / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for source in copy.rglob("*.py"):
        source.write_text(re.sub(r"\bflash_tile\b", name, source.read_text()))
    sys.path.insert(0, str(copy.parent))
    return importlib.import_module(name)


def public_inputs() -> tuple:
    """The arrays of ``public_layers``: q, k, v [1, 128, 1, 64] bf16 (flash-attn's layout),
    a decode step's q [1, 1, 32, 128], its caches [1, 1024, 8, 128], a new row of k and v,
    the cache lengths 1024 (full) and 1000, then for the varlen layers the int32 offsets
    [0, 128] (q, k, v packed as one sequence), [0, 1] and [0, 1024] (the step's query
    against the cache) and the block table [1, 64] of the cache read as 16-key pages."""
    def offsets(*values):
        return torch.tensor(values, dtype=torch.int32, device="cuda")
    return (*inputs(1, 1, 128, 64, torch.bfloat16),
            torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16),
            *inputs(1, 8, 1024, 128, torch.bfloat16)[:2], *inputs(1, 8, 1, 128, torch.bfloat16)[:2],
            *(torch.full((1,), n, dtype=torch.int32, device="cuda") for n in (1024, 1000)),
            offsets(0, 128), offsets(0, 1), offsets(0, 1024),
            torch.arange(64, dtype=torch.int32, device="cuda")[None])


def public_layers(package, arrays: tuple) -> dict:
    """Zero-argument calls of ``package``'s (flash_tile, or a baseline's copy) public
    functions that a host-path change moves, on ``public_inputs``' arrays, each a repeated
    (planned) call: flash_attn_func and the SDPA drop-in (causal) and decode steps on
    ``decode_layers``' shapes: the chosen split count, one split, and the append of one row
    at position 1000 (the same row each call); flash_attn_varlen_func on q, k, v packed as
    one sequence, and on the step's query against the cache read as 16-key pages (vLLM's
    paged call for a decode row)."""
    (q, k, v, step_q, k_cache, v_cache, k_new, v_new, full, filled, cu_packed, cu_step,
     cu_cache, table) = arrays
    pages = [t.view(-1, 16, *t.shape[2:]) for t in (k_cache, v_cache)]
    qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
    step = functools.partial(package.flash_attn_with_kvcache, step_q, k_cache, v_cache,
                             causal=True)
    return {
        "flash_attn_func": lambda: package.flash_attn_func(q, k, v, causal=True),
        "scaled_dot_product_attention": lambda: package.scaled_dot_product_attention(
            qb, kb, vb, is_causal=True),
        "flash_attn_with_kvcache": lambda: step(cache_seqlens=full),
        "flash_attn_with_kvcache, one split": lambda: step(cache_seqlens=full, num_splits=1),
        "flash_attn_with_kvcache, append of a row": lambda: step(k_new, v_new,
                                                                 cache_seqlens=filled),
        "flash_attn_varlen_func": lambda: package.flash_attn_varlen_func(
            q[0], k[0], v[0], cu_packed, cu_packed, 128, 128, causal=True),
        "flash_attn_varlen_func, paged": lambda: package.flash_attn_varlen_func(
            step_q[0], *pages, cu_step, cu_cache, 1, 1024, causal=True, block_table=table),
    }


def against_baseline(directory: str) -> list[dict]:
    """Rows of ``public_layers`` on this tree and on ``directory``'s (``load_package``):
    host us of each side in the same interleaved rounds (``host_us``), their ratio, and the
    largest difference between the sides' outputs (0 for a host-path change)."""
    arrays = public_inputs()
    sides = {"tree": public_layers(flash_tile, arrays),
             "baseline": public_layers(load_package(directory), arrays)}
    diffs = {name: float((sides["tree"][name]().float() - sides["baseline"][name]().float())
                         .abs().max()) for name in sides["tree"]}
    times = host_us({(side, name): fn for side, calls in sides.items()
                     for name, fn in calls.items()})
    return [{"layer": name, "host_us": round(times[("tree", name)], 1),
             "baseline_host_us": round(times[("baseline", name)], 1),
             "ratio": round(times[("tree", name)] / times[("baseline", name)], 3),
             "max_diff": diff} for name, diff in diffs.items()]


def back_to_back_us(fn, iters: int = ITERS) -> tuple[float, float]:
    """(issued, wall): microseconds per call of ``iters`` back-to-back calls from a quiet GPU,
    to issue them (the clock stopped before the GPU's work is waited for: the host's cost
    whether or not the GPU keeps up) and to finish them (synchronised at the end)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return issued / iters * 1e6, wall / iters * 1e6


def wall_us(fn, iters: int = ITERS) -> float:
    """Wall microseconds per call of ``iters`` back-to-back calls, synchronised at the end."""
    return back_to_back_us(fn, iters)[1]


def inputs(batch: int, heads: int, length: int, head_dim: int, dtype,
           requires_grad: bool = False) -> list:
    return [torch.randn(batch, length, heads, head_dim, device="cuda", dtype=dtype,
                        requires_grad=requires_grad) for _ in range(3)]


def issue_and_wall_us(calls: dict) -> tuple[dict, dict]:
    """Medians over ROUNDS interleaved rounds of ``back_to_back_us`` for each of ``calls``:
    ({name: issue us}, {name: wall us})."""
    times = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, fn in calls.items():
            times[name].append(back_to_back_us(fn))
    return ({name: statistics.median(t[0] for t in ts) for name, ts in times.items()},
            {name: statistics.median(t[1] for t in ts) for name, ts in times.items()})


def host_us(calls: dict) -> dict:
    """Median over ROUNDS interleaved rounds of the issue time (``back_to_back_us``) for each
    of ``calls``."""
    return issue_and_wall_us(calls)[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", default="bench/out/launch", help="output path prefix")
    parser.add_argument("--baseline", metavar="DIR",
                        help="a tree's flash_tile/ and kernels/ to time the public calls "
                             "against (git archive <commit> flash_tile kernels)")
    args = parser.parse_args()
    os.environ["FLASH_TILE_AUTOTUNE"] = "0"
    baseline_rows = against_baseline(args.baseline) if args.baseline else []

    tiny = host_us(layers(*inputs(1, 1, 128, args.head_dim, torch.bfloat16), args.causal))
    tiny_grad = host_us(layers(*inputs(1, 1, 128, args.head_dim, torch.bfloat16, True),
                               args.causal))
    tiny_bwd = host_us(backward_layers(*inputs(1, 1, 128, args.head_dim, torch.bfloat16,
                                               True), args.causal))
    decode, decode_wall = issue_and_wall_us(decode_layers(32, 8, 128))
    batch, heads = grid_shape(args.length, args.head_dim)
    problem = (batch, heads, args.length, args.head_dim, torch.bfloat16)
    row = layers(*inputs(*problem), args.causal)
    row_bwd = backward_layers(*inputs(*problem, True), args.causal)
    rows, bwd_rows = [], []
    for name in tiny:
        rows.append({"layer": name, "host_us": round(tiny[name], 1),
                     "host_us_grad": round(tiny_grad[name], 1),
                     "ms_per_call": round(wall_us(row[name]) / 1e3, 4),
                     "device_ms": round(device_ms(row[name]), 4)})
        print(rows[-1], flush=True)
    for name in tiny_bwd:
        bwd_rows.append({"layer": name, "host_us": round(tiny_bwd[name], 1),
                         "ms_per_call": round(wall_us(row_bwd[name]) / 1e3, 4),
                         "device_ms": round(device_ms(row_bwd[name]), 4)})
        print("backward", bwd_rows[-1], flush=True)

    info = machine_info()
    shape = (f"bf16, B={batch}, H={heads}, L={args.length}, D={args.head_dim}, "
             f"causal={args.causal}")
    body = md_table(["layer", "host us (B=1, H=1, L=128)", "with grad",
                     f"ms per call ({shape})", "device ms (queued)"],
                    [[r["layer"], r["host_us"], r["host_us_grad"], r["ms_per_call"],
                      r["device_ms"]]
                     for r in rows])
    body += "\n\nThe backward (same shapes):\n\n" + md_table(
        ["layer", "host us (B=1, H=1, L=128)", f"ms per call ({shape})", "device ms (queued)"],
        [[r["layer"], r["host_us"], r["ms_per_call"], r["device_ms"]] for r in bwd_rows])
    decode_rows = [{"layer": name, "host_us": round(us, 1),
                    "wall_us": round(decode_wall[name], 1)} for name, us in decode.items()]
    body += ("\n\nA decode step (B=1, Lq=1, H=32, H_kv=8, D=128, a 1k cache, bf16); the "
             "wall time waits for the GPU too: where it exceeds the host's, the GPU sets the "
             "pace:\n\n" +
             md_table(["layer", "host us", "wall us"],
                      [[r["layer"], r["host_us"], r["wall_us"]] for r in decode_rows]))
    if baseline_rows:
        body += (f"\n\nPlanned public calls against {args.baseline} (same rounds):\n\n" +
                 md_table(["layer", "host us", "baseline host us", "ratio", "max |diff|"],
                          [[r["layer"], r["host_us"], r["baseline_host_us"], r["ratio"],
                            r["max_diff"]] for r in baseline_rows]))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    save_json(args.out, info, shape=shape, rows=rows, backward_rows=bwd_rows,
              decode_rows=decode_rows, baseline=args.baseline, baseline_rows=baseline_rows)
    print(write_report(args.out, "Host cost per forward and backward call, layer by layer,",
                       info, body))


if __name__ == "__main__":
    main()
