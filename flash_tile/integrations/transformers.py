"""flash_tile as a Hugging Face Transformers attention implementation.

    import flash_tile.integrations.transformers  # registers "flash_tile" (and "cutile")
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flash_tile")
    model.set_attn_implementation("flash_tile")  # or switch a loaded model

Importing this module registers ``attention_forward`` with ``AttentionInterface`` and torch
SDPA's mask builder with ``AttentionMaskInterface`` under both names, so models build the same
boolean [B, 1, Lq, Lk] masks for it as for "sdpa" (causal, padding, sliding window), which
flash_tile reads in place. Calls map as transformers' own SDPA path does: causal without a
mask runs the kernel's causal switch (top-left, as torch), GQA runs in the kernel
(``enable_gqa``), ``scaling`` is the softmax scale; ``softcap`` runs through
``flash_attn_func`` when there is no mask. What cannot be honoured raises instead of being
ignored: attention weights (``output_attentions``), position biases, softcap together with a
mask. Attention sinks (``s_aux``, gpt-oss) run in the kernels' SINKS switch on every path. Packed variable-length batches (``cu_seq_lens_q/k``
with ``max_length_q/k``, as ``DataCollatorWithFlattening`` passes them) run
``flash_attn_varlen_func``. Attention dropout (``dropout``, which models pass only while
training) runs in the kernels. A decode step (one query row, no mask: the whole cache is visible) runs
``flash_attn_with_kvcache``'s decode kernel on the cache transformers passes in.

Two names, and why. transformers 5 treats every implementation whose name contains "flash" as
flash-attn (``is_flash_attention_requested`` tests ``"flash" in name``). That is what flash_tile
wants for the packed and decode paths (transformers then passes ``cu_seq_lens_q/k`` instead of
building dense masks), but it also makes ``modeling_utils`` preload flash-attn's functions
through ``lazy_import_flash_attention`` when a model is loaded or switched to the name, and for a
name that is neither flash-attn nor a Hub kernel that preload fails. transformers offers no
public way to register a local kernel with that loader, so this module wraps the loader: the
wrapper returns at once for flash_tile's names and hands every other name, with all its
arguments, to the original. It is installed wherever transformers has that loader (4.56 calls
it only for names starting with "flash_attention", so there it never sees flash_tile's names;
tested on 4.56.2 and 5.24.0, both in CI). "cutile" needs no
wrapper and stays as the name that does not depend on it. A model class that lists
``_compatible_flash_implementations`` (a few in transformers 5.24, e.g. granite_swa) swaps any
"flash*" name for its own kernel, with a warning: use "cutile" there.
"""

import functools
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import flash_tile

NAMES = ("flash_tile", "cutile")


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, softcap: float | None = None,
                      position_bias: torch.Tensor | None = None,
                      output_attentions: bool = False, **kwargs) -> tuple[torch.Tensor, None]:
    """Transformers' attention signature: query [B, H, Lq, D], key/value [B, H_kv, Lk, D]
    (H a multiple of H_kv); returns ([B, Lq, H, Dv] output, None)."""
    if output_attentions:
        raise NotImplementedError("flash_tile does not return attention weights "
                                  "(output_attentions=True); use attn_implementation='eager'")
    if position_bias is not None:
        raise NotImplementedError("flash_tile does not take position biases (T5-style); use "
                                  "attn_implementation='sdpa' or 'eager'")
    # gpt-oss's sinks, in the model's dtype: the kernels take them as fp32 (a differentiable
    # cast, so their gradient flows back to the parameter).
    sinks = kwargs.get("s_aux")
    sinks = None if sinks is None else sinks.float()
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        return _packed_forward(query, key, value, dropout, scaling, bool(is_causal), softcap,
                               sinks, kwargs), None
    q_len = query.shape[2]
    if q_len == 1 and attention_mask is None and dropout == 0.0 and \
            query.dtype == key.dtype == value.dtype in (torch.float16, torch.bfloat16):
        # A decode step against the whole cache (no padding to mask): the decode kernel, which
        # packs the GQA group into one tile and splits long caches over the SMs. Mixed dtypes
        # (fp32 weights under autocast) take the SDPA path below, which casts as torch does.
        out = flash_tile.flash_attn_with_kvcache(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
            cache_seqlens=key.shape[2], softmax_scale=scaling, softcap=softcap or 0.0,
            sinks=sinks)
        return out, None
    is_causal = bool(is_causal) and q_len > 1 and attention_mask is None
    if is_causal and key.shape[2] > q_len:
        # transformers' SDPA path: a causal call without a mask covers the first Lq keys.
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if softcap is not None:
        if attention_mask is not None:
            raise NotImplementedError("softcap together with an attention mask is not "
                                      "supported by flash_tile")
        out = flash_tile.flash_attn_func(query.transpose(1, 2), key.transpose(1, 2),
                                         value.transpose(1, 2), dropout, scaling, is_causal,
                                         softcap=softcap, sinks=sinks)
        return out, None
    sdpa_args = dict(attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal,
                     scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    if sinks is None:
        out = flash_tile.scaled_dot_product_attention(query, key, value, **sdpa_args)
    else:  # torch's SDPA has no sinks: its body in flash_tile takes them
        out = flash_tile.api._sdpa(query, key, value, **sdpa_args, sinks=sinks)
    return out.transpose(1, 2), None  # [B, Lq, H, Dv]: contiguous, as flash_tile lays it out


def _packed_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    dropout: float, scaling: float | None, is_causal: bool,
                    softcap: float | None, sinks: torch.Tensor | None,
                    kwargs: dict) -> torch.Tensor:
    """Packed sequences (padding-free training, ``DataCollatorWithFlattening``): query
    [1, H, total_q, D] and key/value [1, H_kv, total_k, D] holding the sequences one after
    another, ``cu_seq_lens_q/k`` int32 [B + 1] and ``max_length_q/k`` as transformers passes
    them to flash-attn, through ``flash_attn_varlen_func`` (causal bottom-right per sequence;
    ``sliding_window`` w sees the w most recent keys, as transformers' masks). The mask
    transformers may also build for the packing is not read: the offsets say the same.
    Returns [1, total_q, H, Dv]."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is None or cu_k is None or max_q is None or max_k is None:
        raise ValueError("packed sequences need cu_seq_lens_q, cu_seq_lens_k, max_length_q "
                         "and max_length_k together")
    if query.shape[0] != 1:
        raise ValueError(f"packed sequences come as one row of tokens (batch 1), got batch "
                         f"{query.shape[0]}")
    sliding = kwargs.get("sliding_window")
    window = (sliding - 1, -1) if sliding else (-1, -1)
    # ints as the collator gives them; a tensor bound is read back (one sync), as flash-attn
    # does with it.
    out = flash_tile.flash_attn_varlen_func(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
        cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k), dropout, scaling,
        is_causal, window, softcap or 0.0, sinks=sinks)
    return out[None]


def skip_preload_for_flash_tile(loader: Callable) -> Callable:
    """``loader`` (transformers' ``lazy_import_flash_attention``) wrapped so that flash_tile's
    names return None at once (flash_tile's attention function does not use flash-attn's
    functions) and every other call reaches ``loader`` unchanged; a wrapper is not wrapped
    again."""
    if getattr(loader, "flash_tile_wrapper", False):
        return loader

    @functools.wraps(loader)
    def lazy_import_flash_attention(implementation, *args, **kwargs):
        if implementation in NAMES:
            return None
        return loader(implementation, *args, **kwargs)

    lazy_import_flash_attention.flash_tile_wrapper = True
    return lazy_import_flash_attention


def _install_preload_skip() -> None:
    """Wrap ``modeling_utils.lazy_import_flash_attention`` where this transformers has it."""
    from transformers import modeling_utils

    loader = getattr(modeling_utils, "lazy_import_flash_attention", None)
    if callable(loader):
        modeling_utils.lazy_import_flash_attention = skip_preload_for_flash_tile(loader)


for _name in NAMES:
    AttentionInterface.register(_name, attention_forward)
    AttentionMaskInterface.register(_name, sdpa_mask)
_install_preload_skip()
