"""Builds the grid and argument tuple of the forward kernel and launches it.

This is the one place that knows the kernel's parameter order: the JIT launch here and the
ahead-of-time compile in ``flash_tile.aot`` both take their compile-time constants from
``ForwardSpec.constants``. It knows nothing of validation: callers pass checked tensors.
"""

import functools
from dataclasses import dataclass

import cuda.tile as ct
import torch

from flash_tile.kernels.attention_fwd import (ADDITIVE_MASK, BOOL_MASK, NO_MASK, attention_fwd,
                                             attention_fwd_int64)
from flash_tile.variants import TileConfig


@dataclass(frozen=True)
class ForwardSpec:
    """The compile-time constants of one forward kernel instance, in the kernel's order."""

    tile_m: int
    tile_n: int
    tile_d: int
    tile_dv: int
    mask_left: bool
    mask_right: bool
    even_n: bool
    softcap: bool
    alibi: bool
    attn_mask: int  # NO_MASK, BOOL_MASK or ADDITIVE_MASK
    store_lse: bool

    def constants(self) -> tuple:
        return (self.tile_m, self.tile_n, self.tile_d, self.tile_dv, self.mask_left,
                self.mask_right, self.even_n, self.softcap, self.alibi, self.attn_mask,
                self.store_lse)


def _tile_width(dim: int) -> int:
    # Tiles are powers of two, and 16 is the smallest K of an fp16/bf16 tensor-core matmul.
    return max(16, 1 << max(dim - 1, 0).bit_length())


def mask_kind(attn_mask: torch.Tensor | None) -> int:
    """The kernel's ATTN_MASK switch for a mask tensor (or None)."""
    if attn_mask is None:
        return NO_MASK
    return BOOL_MASK if attn_mask.dtype == torch.bool else ADDITIVE_MASK


def forward_spec(config: TileConfig, head_dim: int, v_head_dim: int, k_len: int,
                 window: tuple[int, int], softcap: bool, alibi: bool, attn_mask: int,
                 store_lse: bool) -> ForwardSpec:
    """The kernel instance ``config`` gives for these dims, key length and features.

    ``window`` is (left, right) with -1 for unbounded; causal is a right bound of 0.
    ``attn_mask`` is the ATTN_MASK switch (``mask_kind``).
    """
    left, right = window
    return ForwardSpec(config.tile_m, config.tile_n, _tile_width(head_dim),
                       _tile_width(v_head_dim), left >= 0, right >= 0,
                       k_len % config.tile_n == 0, softcap, alibi, attn_mask, store_lse)


@functools.cache
def hinted_kernel(config: TileConfig, int64_index: bool = False):
    """The forward entry point (32- or 64-bit indexing) with ``config``'s compiler hints, made
    once per pair.

    ``replace_hints`` returns a kernel with its own JIT cache, so making one per call would
    recompile (or reload from disk) on every launch.
    """
    kernel = attention_fwd_int64 if int64_index else attention_fwd
    hints = config.hints()
    return kernel.replace_hints(**hints) if hints else kernel


def needs_int64_index(*tensors: torch.Tensor) -> bool:
    """Whether an element offset of any tensor reaches 2**31 (32-bit shapes and strides would
    overflow)."""
    return any(sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) >= 2**31 - 1
               for t in tensors)


def forward_grid(q_len: int, heads: int, batch: int, config: TileConfig) -> tuple:
    """One program per (query tile, head, batch); query tiles of a head are neighbours in
    launch order, so they read the same K/V while it is still in L2."""
    return (ct.cdiv(q_len, config.tile_m), heads, batch)


def launch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor | None, alibi_slopes: torch.Tensor | None,
                   attn_mask: torch.Tensor | None, scale: float, softcap: float,
                   diag_offset: int, window: tuple[int, int], config: TileConfig) -> None:
    """Launch the forward on the current stream of ``q``'s device.

    q [B, H, Lq, D], k [B, H_kv, Lk, D], v [B, H_kv, Lk, Dv] with H a multiple of H_kv;
    out [B, H, Lq, Dv] in q's dtype; lse [B, H, Lq] fp32 or None; alibi_slopes [B, H] fp32 or
    None; attn_mask [B, H, Lq, Lk] bool (True = attend) or additive float, stride-0 broadcast
    dims allowed, or None. Any strides with a unit last stride for q, k, v, out. softcap 0
    means none. Row i sees key j iff i + diag_offset - left <= j <= i + diag_offset + right
    for window = (left, right), -1 leaving that side unbounded (causal: right = 0).
    """
    batch, heads, q_len, head_dim = q.shape
    spec = forward_spec(config, head_dim, v.shape[3], k.shape[2], window, softcap > 0.0,
                        alibi_slopes is not None, mask_kind(attn_mask), lse is not None)
    # The kernel never touches Lse without STORE_LSE, Slopes without ALIBI nor Mask without
    # ATTN_MASK, but each parameter needs an array.
    unused = None
    if lse is None or alibi_slopes is None or attn_mask is None:
        unused = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
    lse = unused[0] if lse is None else lse
    slopes = unused[0, 0] if alibi_slopes is None else alibi_slopes
    attn_mask = unused if attn_mask is None else attn_mask
    args = (q, k, v, out, lse, slopes, attn_mask, float(scale), float(softcap),
            int(diag_offset), int(window[0]), int(window[1]), *spec.constants())
    grid = forward_grid(q_len, heads, batch, config)
    kernel = hinted_kernel(config, needs_int64_index(q, k, v, out, lse, attn_mask))
    with torch.cuda.device(q.device):
        ct.launch(torch.cuda.current_stream(q.device), grid, kernel, args)
