"""Varlen benchmark: packed batches of sequences of random lengths, forward and
forward+backward TFLOP/s.

Each row packs sequences of log-uniform random lengths (64 to 8192, seeded; the last one cut
to fit) into a fixed number of tokens (16k and 64k), H * D = 2048, Lq = Lk per sequence, and
times, in the same run:

- ``flash_tile``: ``flash_attn_varlen_func`` (the kernels' VARLEN switch);
- ``fa2_varlen``: FlashAttention-2's varlen kernel as torch ships it
  (``torch.ops.aten._flash_attention_forward`` / ``_backward`` with ``cum_seq_q/k``);
- ``sdpa_cudnn_padded``: SDPA's cuDNN backend on the sequences padded to the longest, as a
  user without varlen calls it (causal: ``is_causal``, the padded keys lie past every valid
  row; else a key-padding mask). The padding and unpadding copies are not timed;
- ``flash_tile_dense``: ``flash_attn_func`` on an equal-length batch of the same token count,
  its length the power of two nearest the packing's FLOP-weighted mean length: the
  per-token ceiling.

Every backend's output and gradients are checked against an fp32 reference run on each
sequence alone (flash-attn's 2x / 3x rules over the packed tensors) before it is timed.
TFLOP/s counts each sequence's own FLOPs (``_timing.flops``; the padded backend gets the
same count, so its padding shows as lost speed). Times are GPU time per call with the calls
queued behind a sleep (``bench_attention.device_ms``).

    python bench/bench_varlen.py                       # bench/results/varlen-<gpu>.*
    python bench/bench_varlen.py --tokens 16384 --head-dims 128 --out /tmp/v

Writes <out>.json (rows with ``tflops`` and ``fwd_bwd_tflops`` per backend,
``ratio_vs_fa2_varlen`` and ``ratio_vs_dense``, with ``fwd_bwd_`` the same for
forward+backward, and the tile variants flash_tile's varlen forward and backward launched,
``variant`` and ``bwd_variant``, with the tuner's timings), <out>.md and <out>.png.
"""

import argparse
import math
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

import flash_tile
from bench_attention import (chosen_variant, device_ms, failure, machine_info, md_table,
                             results_path, save_json, write_report)
from flash_tile import reference
from flash_tile._timing import DTYPES, GRID_WIDTH, flops

BACKENDS = ("flash_tile", "fa2_varlen", "sdpa_cudnn_padded", "flash_tile_dense")


def random_lengths(tokens, gen, low=64, high=8192):
    """Log-uniform lengths in [low, high] summing to ``tokens`` (the last one cut to fit)."""
    lengths = []
    while sum(lengths) < tokens:
        u = torch.rand((), generator=gen).item()
        lengths.append(min(int(low * (high / low) ** u), tokens - sum(lengths)))
    return lengths


def packing(tokens):
    """The lengths of a row of ``tokens`` tokens: ``random_lengths`` seeded by the count, so
    every row of a token count (and ``bench_variants.py --varlen``) packs alike."""
    return random_lengths(tokens, torch.Generator().manual_seed(tokens))


def cu_seqlens(lengths):
    """The cumulative offsets of ``lengths``: int32 [B + 1] on the GPU, from 0."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")


def _fa2(q, k, v, cu, max_len, causal):
    """FA2's varlen forward and forward+backward on packed [total, H, D] tensors."""
    def forward():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0,
                                                       causal, False)

    def backward(dout):
        out, lse, rng, unused, _ = forward()
        return torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, cu, cu,
                                                        max_len, max_len, 0.0, causal, rng,
                                                        unused)
    return (lambda: forward()[0]), backward


def _pad(t, lengths, max_len):
    """Packed [total, H, D] as [B, H, max_len, D], zero past each sequence."""
    padded = t.new_zeros(len(lengths), max_len, *t.shape[1:])
    for b, piece in enumerate(t.split(lengths)):
        padded[b, :piece.shape[0]] = piece
    return padded.transpose(1, 2)


def _unpad(t, lengths):
    """[B, H, max_len, D] back to packed [total, H, D]."""
    return torch.cat([t[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])


def _autograd(run, leaves, dout):
    """(forward, forward+backward) of ``run`` on ``leaves``, as zero-argument calls; each
    step clears the gradients first, so no accumulation is timed."""
    def fwd_bwd():
        for t in leaves:
            t.grad = None
        run().backward(dout)
        return tuple(t.grad for t in leaves)
    return run, fwd_bwd


def runners(q, k, v, dout, lengths, causal):
    """{backend: (forward, forward+backward, to_packed)}: the calls on this row's inputs and
    the map of their results back to packed tensors (None for the dense ceiling, which
    computes another problem)."""
    total, heads, dim = q.shape
    cu = cu_seqlens(lengths)
    max_len = max(lengths)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    calls = {"flash_tile": (*_autograd(lambda: flash_tile.flash_attn_varlen_func(
        *leaves, cu, cu, max_len, max_len, causal=causal), leaves, dout), lambda x: x)}
    fa2_forward, fa2_backward = _fa2(q, k, v, cu, max_len, causal)
    calls["fa2_varlen"] = (fa2_forward, lambda: fa2_backward(dout), lambda x: x)

    padded = [_pad(t, lengths, max_len).requires_grad_() for t in (q, k, v)]
    dout_padded = _pad(dout, lengths, max_len)
    keys = torch.arange(max_len, device="cuda")[None, :] < torch.tensor(lengths,
                                                                        device="cuda")[:, None]
    mask = None if causal else keys[:, None, None, :]

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(*padded, attn_mask=mask, is_causal=causal)

    calls["sdpa_cudnn_padded"] = (*_autograd(sdpa, padded, dout_padded),
                                  lambda x: _unpad(x, lengths))

    length = 2 ** round(math.log2(sum(n * n for n in lengths) / total))
    dense = [torch.randn(total // length, length, heads, dim, device="cuda",
                         dtype=q.dtype).requires_grad_() for _ in range(3)]
    dense_dout = torch.randn_like(dense[0])
    calls["flash_tile_dense"] = (*_autograd(lambda: flash_tile.flash_attn_func(
        *dense, causal=causal), dense, dense_dout), None)
    return calls, length


def reference_grads(q, k, v, dout, lengths, causal, dtype):
    """Packed (out, dq, dk, dv) of attention on each sequence alone, in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    outs = []
    for piece_q, piece_k, piece_v, piece_dout in zip(*(t.split(lengths)
                                                       for t in (*leaves, dout))):
        seq = [t.transpose(0, 1)[None] for t in (piece_q, piece_k, piece_v)]
        out = reference.attention_dense(*seq, window=(-1, 0) if causal else (-1, -1))
        out = out[0].transpose(0, 1)
        out.backward(piece_dout.to(dtype))
        outs.append(out.detach())
    return (torch.cat(outs), *(t.grad for t in leaves))


def check(results, ref, low):
    """The worst report of (out, dq, dk, dv) against the references, under the 2x/3x rules."""
    for name, got, r, lo, factor in zip(("out", "dq", "dk", "dv"), results, ref, low,
                                        (2, 3, 3, 3)):
        report = reference.check_error(got, r, lo, factor)
        if not report["ok"]:
            return f"wrong {name}: {report}"
    return None


def bench_row(tokens, head_dim, causal, dtype):
    lengths = packing(tokens)
    heads = GRID_WIDTH // head_dim
    q, k, v, dout = (torch.randn(tokens, heads, head_dim, device="cuda", dtype=dtype)
                     for _ in range(4))
    row = {"tokens": tokens, "sequences": len(lengths), "max_seqlen": max(lengths),
           "heads": heads, "head_dim": head_dim, "causal": causal,
           "dtype": {v: k for k, v in DTYPES.items()}[dtype], "tflops": {},
           "fwd_bwd_tflops": {}, "skipped": {}}
    ref = reference_grads(q, k, v, dout, lengths, causal, torch.float32)
    low = reference_grads(q, k, v, dout, lengths, causal, dtype)
    calls, dense_len = runners(q, k, v, dout, lengths, causal)
    row["dense_seqlen"] = dense_len
    f_fwd = sum(flops(1, heads, n, n, head_dim, causal) for n in lengths)
    f_dense = flops(tokens // dense_len, heads, dense_len, dense_len, head_dim, causal)
    for name, (forward, fwd_bwd, to_packed) in calls.items():
        try:
            if to_packed is not None:
                out, grads = forward(), fwd_bwd()
                wrong = check((to_packed(out.detach()), *map(to_packed, grads)), ref, low)
                if wrong:
                    row["skipped"][name] = wrong
                    continue
            f = f_fwd if to_packed is not None else f_dense
            row["tflops"][name] = round(f / device_ms(forward) / 1e9, 1)
            row["fwd_bwd_tflops"][name] = round(3.5 * f / device_ms(fwd_bwd) / 1e9, 1)
        except Exception as e:  # noqa: BLE001 - a backend that cannot run this row
            row["skipped"][name] = failure(e)
    for pass_, backward in (("variant", False), ("bwd_variant", True)):
        row[pass_], row[pass_ + "_ms"] = chosen_variant(q, causal, backward, len(lengths))
    for key, prefix in (("tflops", ""), ("fwd_bwd_tflops", "fwd_bwd_")):
        ours = row[key].get("flash_tile")
        for peer, ratio in (("fa2_varlen", "ratio_vs_fa2_varlen"),
                            ("flash_tile_dense", "ratio_vs_dense")):
            theirs = row[key].get(peer)
            row[prefix + ratio] = round(ours / theirs, 3) if ours and theirs else None
    return row


def misses(row, prefix):
    """The targets this row's pass misses: >= 1.3x FA2's varlen kernel, >= 0.9x the dense
    kernel per token."""
    out = []
    for ratio, target, label in (("ratio_vs_fa2_varlen", 1.3, "FA2"),
                                 ("ratio_vs_dense", 0.9, "dense")):
        value = row[prefix + ratio]
        if value is not None and value < target:
            out.append(f"vs {label} < {target}")
    return ", ".join(out) or "met"


def table(rows):
    head = ["dtype", "tokens", "seqs", "max L", "D", "causal", "pass",
            *BACKENDS, "vs FA2 varlen", "vs dense", "targets"]
    lines = []
    for r in rows:
        for key, label, prefix in (("tflops", "fwd", ""), ("fwd_bwd_tflops", "fwd+bwd",
                                                          "fwd_bwd_")):
            lines.append([r["dtype"], r["tokens"], r["sequences"], r["max_seqlen"],
                          r["head_dim"], r["causal"], label,
                          *(r[key].get(n, "-") for n in BACKENDS),
                          *(f"{r[prefix + ratio]:.3f}x" if r[prefix + ratio] else "-"
                            for ratio in ("ratio_vs_fa2_varlen", "ratio_vs_dense")),
                          misses(r, prefix)])
    skipped = sorted({f"{n}: {why}" for r in rows for n, why in r["skipped"].items()})
    note = ("\n\nNot timed: " + "; ".join(skipped)) if skipped else ""
    return ("TFLOP/s (each sequence's own FLOPs); `flash_tile_dense` is an equal-length batch "
            "of the same token count (length in the JSON's `dense_seqlen`). Targets: varlen "
            ">= 1.3x FA2's varlen kernel and >= 0.9x flash_tile's dense kernel.\n\n"
            + md_table(head, lines) + note)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    labels = [f"{r['dtype']} {r['tokens'] // 1024}k D{r['head_dim']}"
              f"{' causal' if r['causal'] else ''}" for r in rows]
    width = 0.8 / len(BACKENDS)
    for ax, key, title in zip(axes, ("tflops", "fwd_bwd_tflops"), ("forward", "fwd+bwd")):
        for i, name in enumerate(BACKENDS):
            ax.bar([x + i * width for x in range(len(rows))],
                   [r[key].get(name, 0) for r in rows], width, label=name)
        ax.set_xticks([x + 0.4 for x in range(len(rows))], labels, rotation=45, ha="right",
                      fontsize=7)
        ax.set_title(f"varlen {title}")
    axes[0].set_ylabel("TFLOP/s")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[16384, 65536])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=DTYPES)
    parser.add_argument("--causal", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--out", help="output path prefix (default: bench/results/varlen-<gpu>)")
    args = parser.parse_args()
    args.out = args.out or results_path("varlen")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    info = machine_info()
    grid = [(t, d, bool(c), DTYPES[dt]) for dt in args.dtypes for t in args.tokens
            for d in args.head_dims for c in args.causal]
    rows = []
    for tokens, dim, causal, dtype in tqdm(grid, desc="varlen grid", unit="row"):
        rows.append(bench_row(tokens, dim, causal, dtype))
        tqdm.write(f"{rows[-1]['dtype']} T={tokens} D={dim} causal={causal}: "
                   f"{rows[-1]['tflops']} {rows[-1]['fwd_bwd_tflops']} "
                   f"{rows[-1]['skipped'] or ''}")
        save_json(args.out, info, rows=rows)
        torch.cuda.empty_cache()
    write_report(args.out, "Varlen, packed random lengths (log-uniform 64-8192)", info,
                 table(rows))
    plot(rows, args.out + ".png")
    print(table(rows))


if __name__ == "__main__":
    main()
