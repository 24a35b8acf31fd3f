"""flash_tile: flash attention for PyTorch, with kernels hand-written in NVIDIA cuTile.

``flash_attn_func`` takes flash-attn's [B, L, H, D] layout and bottom-right causal alignment;
``scaled_dot_product_attention`` takes torch's [..., L, D] layout and top-left alignment;
``flash_attn_varlen_func`` (and its packed forms) attends over packed sequences of different
lengths; ``flash_attn_with_kvcache`` attends against a contiguous or paged KV cache (decode).
With float8_e4m3fn inputs and descale factors ``flash_attn_func`` and
``flash_attn_varlen_func`` run the FP8 forward (sm_90+); ``quantize_fp8`` and
``hadamard_rotate`` prepare such inputs.
"""

from flash_tile.api import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                            scaled_dot_product_attention)
from flash_tile.fp8 import hadamard_rotate, quantize_fp8
from flash_tile.kvcache import flash_attn_with_kvcache
from flash_tile.varlen import (flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                               flash_attn_varlen_qkvpacked_func)

__version__ = "0.1.0"

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache", "hadamard_rotate",
           "quantize_fp8", "scaled_dot_product_attention", "__version__"]
