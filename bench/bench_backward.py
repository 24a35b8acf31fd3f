"""Backward benchmark: forward+backward and backward-only TFLOP/s against SDPA's backends, and
peak memory of a forward+backward against naive attention.

Every backend's gradients are first checked against an fp32 reference with flash-attn's 3x
rule (SDPA cuDNN as PyTorch's own low-precision error). Backward FLOPs are 2.5x the forward's
(``flash_tile._timing.flops``); backward-only time is forward+backward minus forward, both
measured in the same run.

    python bench/bench_backward.py --out bench/out/backward
"""

import argparse
import functools
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_tile
from bench_attention import (SDPA_BACKENDS, TOKENS, WIDTH, _naive, _peak_bytes, _sdpa,
                             machine_info, save_json)
from flash_tile._timing import cuda_time_ms, flops
from flash_tile.reference import check_error


def _runners(causal):
    """Runners taking (q, k, v): flash_tile, each SDPA backend and naive attention."""
    runners = {"flash_tile": lambda q, k, v: flash_tile.scaled_dot_product_attention(
        q, k, v, is_causal=causal)}
    runners.update({name: functools.partial(_sdpa(b), causal=causal)
                    for name, b in SDPA_BACKENDS.items()})
    runners["naive"] = functools.partial(_naive, causal=causal)
    return runners


def _grads(run, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    run(q, k, v).backward(dout)
    return q.grad, k.grad, v.grad


def bench_row(batch, heads, length, head_dim, causal, dtype):
    q, k, v = (torch.randn(batch, heads, length, head_dim, device="cuda", dtype=dtype)
               for _ in range(3))
    dout = torch.randn_like(q)
    runners = _runners(causal)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        ref = _grads(lambda *t: F.scaled_dot_product_attention(*t, is_causal=causal),
                     q.float(), k.float(), v.float(), dout.float())
    low = _grads(runners["sdpa_cudnn"], q, k, v, dout)
    row = {"batch": batch, "heads": heads, "seqlen": length, "head_dim": head_dim,
           "causal": causal, "dtype": str(dtype).removeprefix("torch."), "fwd_bwd_tflops": {},
           "bwd_tflops": {}, "peak_mib": {}, "skipped": {}}
    f_fwd_bwd, f_bwd = (flops(batch, heads, length, length, head_dim, causal, mode)
                        for mode in ("fwd_bwd", "bwd"))
    for name, run in runners.items():
        try:
            got = _grads(run, q, k, v, dout)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            row["skipped"][name] = f"failed: {str(e).splitlines()[0][:120]}"
            continue
        reports = [check_error(g, r, p, 3.0) for g, r, p in zip(got, ref, low)]
        if not all(r["ok"] for r in reports):
            row["skipped"][name] = f"wrong gradients: {reports}"
            continue
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))

        def fwd_bwd():
            run(q_, k_, v_).backward(dout)

        total = cuda_time_ms(fwd_bwd)
        forward = cuda_time_ms(lambda: run(q, k, v))
        row["fwd_bwd_tflops"][name] = round(f_fwd_bwd / total / 1e9, 1)
        row["bwd_tflops"][name] = round(f_bwd / max(total - forward, 1e-6) / 1e9, 1)
        row["peak_mib"][name] = round(_peak_bytes(fwd_bwd) / 2**20, 1)
    for key in ("fwd_bwd", "bwd"):
        ours, cudnn = row[f"{key}_tflops"].get("flash_tile"), row[f"{key}_tflops"].get(
            "sdpa_cudnn")
        row[f"{key}_ratio_vs_cudnn"] = round(ours / cudnn, 3) if ours and cudnn else None
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bf16", choices=["fp16", "bf16"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--out", default="bench/out/backward", help="output path prefix")
    args = parser.parse_args()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    info = machine_info()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    rows = []
    for head_dim in args.head_dims:
        for length in args.lengths:
            for causal in (False, True):
                rows.append(bench_row(TOKENS // length, WIDTH // head_dim, length, head_dim,
                                      causal, dtype))
                r = rows[-1]
                print(f"L={length} D={head_dim} causal={causal}: fwd+bwd {r['fwd_bwd_tflops']} "
                      f"bwd {r['bwd_tflops']} peak MiB {r['peak_mib']} {r['skipped'] or ''}",
                      flush=True)
                save_json(rows, info, args.out)


if __name__ == "__main__":
    main()
