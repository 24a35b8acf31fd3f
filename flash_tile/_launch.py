"""Builds the grid and argument tuple of the forward kernel and launches it.

This is the one place that knows the kernel's parameter order: the JIT launch here and the
ahead-of-time compile in ``flash_tile.aot`` both take their compile-time constants from
``ForwardSpec.constants``. It knows nothing of validation: callers pass checked tensors.
"""

import functools
from dataclasses import dataclass

import cuda.tile as ct
import torch

from flash_tile.kernels.attention_fwd import attention_fwd
from flash_tile.variants import TileConfig


@dataclass(frozen=True)
class ForwardSpec:
    """The compile-time constants of one forward kernel instance, in the kernel's order."""

    tile_m: int
    tile_n: int
    tile_d: int
    causal: bool
    even_n: bool
    store_lse: bool

    def constants(self) -> tuple:
        return (self.tile_m, self.tile_n, self.tile_d, self.causal, self.even_n, self.store_lse)


def forward_spec(config: TileConfig, head_dim: int, k_len: int, causal: bool,
                 store_lse: bool) -> ForwardSpec:
    """The kernel instance ``config`` gives for this head dim, key length and flags."""
    tile_d = 1 << max(head_dim - 1, 0).bit_length()  # tiles are powers of two
    return ForwardSpec(config.tile_m, config.tile_n, tile_d, causal,
                       k_len % config.tile_n == 0, store_lse)


@functools.cache
def hinted_kernel(config: TileConfig):
    """``attention_fwd`` with ``config``'s compiler hints, made once per config.

    ``replace_hints`` returns a kernel with its own JIT cache, so making one per call would
    recompile (or reload from disk) on every launch.
    """
    hints = config.hints()
    return attention_fwd.replace_hints(**hints) if hints else attention_fwd


def forward_grid(q_len: int, heads: int, batch: int, config: TileConfig) -> tuple:
    """One program per (query tile, head, batch); query tiles of a head are neighbours in
    launch order, so they read the same K/V while it is still in L2."""
    return (ct.cdiv(q_len, config.tile_m), heads, batch)


def launch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor | None, scale: float, causal: bool, causal_offset: int,
                   config: TileConfig) -> None:
    """Launch the forward on the current stream of ``q``'s device.

    q [B, H, Lq, D], k and v [B, H, Lk, D], out [B, H, Lq, D] in q's dtype, lse [B, H, Lq]
    fp32 or None; any strides with a unit last stride. Row i sees key j iff
    j <= i + causal_offset when ``causal``.
    """
    batch, heads, q_len, head_dim = q.shape
    spec = forward_spec(config, head_dim, k.shape[2], causal, lse is not None)
    if lse is None:
        # The kernel never touches Lse without STORE_LSE, but the parameter needs an array.
        lse = torch.empty((1, 1, 1), dtype=torch.float32, device=q.device)
    args = (q, k, v, out, lse, float(scale), int(causal_offset), *spec.constants())
    grid = forward_grid(q_len, heads, batch, config)
    with torch.cuda.device(q.device):
        ct.launch(torch.cuda.current_stream(q.device), grid, hinted_kernel(config), args)
