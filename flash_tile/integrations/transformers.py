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
mask. Attention sinks (``s_aux``, gpt-oss) run in the kernels' SINKS switch on every path.
Packed variable-length batches run ``flash_attn_varlen_func``: with ``cu_seq_lens_q/k`` and
``max_length_q/k`` (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), or from
``position_ids`` that restart within one row (the collator's default), as flash-attn's path
in transformers reads them; a mask built beside them is checked against the packing (one
sync a forward), never ignored. (A packed row whose model keeps a cache gets no mask from
transformers; without reading its position ids it would run causal attention across its
sequences.) Left- or right-padded batches whose mask is causal attention over each row's
tokens (the common case) run as packed sequences too, the padding's outputs 0; other masks
take the masked path. A 2-D mask is flash-attn's [B, Lk] key padding mask, which models
that branch on "flash" in the name pass (gpt_bigcode's cross-attention). Attention dropout
(``dropout``, which models pass only while training) runs in the kernels; a model's
``deterministic`` keyword (or, as transformers' flash-attn path reads it,
``FLASH_ATTENTION_DETERMINISTIC=1``) picks the deterministic backward. A decode step (one
query row, nothing to differentiate) runs ``flash_attn_with_kvcache``'s
decode kernel on the cache transformers passes in, with its boolean [B, 1, 1, Lk] mask (a
static cache's unwritten slots, a left-padded batch's pad, a sliding window) read by the
kernel on the device: no sync, so it runs the same way under torch.compile.

Two names, and why. transformers 5 treats every implementation whose name contains "flash" as
flash-attn (``is_flash_attention_requested`` tests ``"flash" in name``) for loading, chunked
masks and generation (the masks and the keyword arguments an attention function receives are
the same for both names), and it makes ``modeling_utils`` preload flash-attn's functions
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
import os
import weakref
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
    if kwargs.get("block_table") is not None:
        # Continuous batching's decode fast path (new rows appended into a paged cache by
        # the attention call): transformers takes it for flash_attention_2/3 alone, and
        # turns it off for other implementations (max_blocks_per_request = 0).
        raise NotImplementedError("flash_tile takes no block_table from transformers "
                                  "(continuous batching's decode fast path); run continuous "
                                  "batching with max_blocks_per_request=0")
    # gpt-oss's sinks, in the model's dtype: the kernels take them as fp32 (a differentiable
    # cast, so their gradient flows back to the parameter).
    sinks = kwargs.get("s_aux")
    sinks = None if sinks is None else sinks.float()
    deterministic = _deterministic(kwargs.get("deterministic"))
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is not None and attention_mask.dim() == 2:
        attention_mask = _key_padding_mask(attention_mask, query.shape[2], bool(is_causal))
    packing = _packing(query, key, attention_mask, bool(is_causal), kwargs)
    if packing is not None:
        return _packed_forward(query, key, value, dropout, scaling, bool(is_causal), softcap,
                               sinks, packing, deterministic), None
    padding = _padding(query, key, attention_mask, bool(is_causal), kwargs.get("sliding_window"))
    if padding is not None:
        return _unpadded_forward(query, key, value, dropout, scaling, softcap, sinks,
                                 kwargs.get("sliding_window"), *padding, deterministic), None
    q_len = query.shape[2]
    if q_len == 1 and dropout == 0.0 and _decode_mask(attention_mask, key.shape[2]) and \
            query.dtype == key.dtype == value.dtype in (torch.float16, torch.bfloat16) and \
            not _needs_grad(query, key, value, sinks):
        # A decode step: the decode kernel, which packs the GQA group into one tile and
        # splits long caches over the SMs, the mask (if any) hiding keys on the device. Mixed
        # dtypes (fp32 weights under autocast) take the SDPA path below, which casts as torch
        # does; so does a step that needs gradients (the decode kernel has no backward).
        out = flash_tile.flash_attn_with_kvcache(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
            cache_seqlens=key.shape[2], softmax_scale=scaling, softcap=softcap or 0.0,
            sinks=sinks, attn_mask=attention_mask)
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
                                         softcap=softcap, deterministic=deterministic,
                                         sinks=sinks)
        return out, None
    sdpa_args = dict(attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal,
                     scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    if sinks is None and not deterministic:
        out = flash_tile.scaled_dot_product_attention(query, key, value, **sdpa_args)
    else:  # torch's SDPA has neither: its body in flash_tile takes them
        out = flash_tile.api._sdpa(query, key, value, **sdpa_args, sinks=sinks,
                                   deterministic=deterministic)
    return out.transpose(1, 2), None  # [B, Lq, H, Dv]: contiguous, as flash_tile lays it out


def _key_padding_mask(mask: torch.Tensor, q_len: int, is_causal: bool) -> torch.Tensor:
    """The boolean [B, 1, Lq, Lk] mask of flash-attn's [B, Lk] padding mask (nonzero: a
    token), which models that branch on "flash" in the implementation's name pass (e.g.
    gpt_bigcode's cross-attention): its keys, and causal (bottom-right, as flash-attn)
    where the call is, since the mask then replaces the kernel's causal switch."""
    keep = mask.bool()[:, None, None, :]
    if not is_causal or q_len == 1:
        return keep
    k_len = mask.shape[1]
    band = torch.ones(q_len, k_len, dtype=torch.bool, device=mask.device).tril(k_len - q_len)
    return keep & band


def _window(sliding: int | None) -> tuple[int, int]:
    """flash-attn's window_size of transformers' ``sliding_window`` w, as its flash-attn
    path passes it: (w - 1, w - 1), the right side 0 under causal; (-1, -1) without one."""
    return (sliding - 1, sliding - 1) if sliding else (-1, -1)


def _deterministic(requested: bool | None) -> bool:
    """The backward's form as transformers' flash-attn path asks for it: the model's
    ``deterministic`` keyword, or where it gives none ``FLASH_ATTENTION_DETERMINISTIC=1``
    (``torch.use_deterministic_algorithms(True)`` has the same effect in flash_tile)."""
    if requested is not None:
        return bool(requested)
    return os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records this call: grad mode on and a tensor that requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _decode_mask(attention_mask: torch.Tensor | None, k_len: int) -> bool:
    """Whether a decode step's mask is one the decode kernel reads: none, or the boolean
    [B or 1, 1, 1, Lk] mask transformers builds for every head."""
    return attention_mask is None or (
        attention_mask.dtype == torch.bool and attention_mask.dim() == 4 and
        tuple(attention_mask.shape[1:]) == (1, 1, k_len))


def _packing(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
             is_causal: bool, kwargs: dict) -> dict | None:
    """The packed sequences of this call, as ``_packed_forward`` takes them, or None.

    Either the caller's ``cu_seq_lens_q/k`` with ``max_length_q/k`` (``DataCollatorWithFlattening
    (return_flash_attn_kwargs=True)``), or one row whose ``position_ids`` restart (the
    collator's default): a new sequence wherever a position is not the one before plus 1
    (flash-attn's path in transformers splits where a position equals the row's least; the
    two agree on the collator's ids, which count up by 1 from 0). A mask transformers built
    beside them is checked, not ignored: the packing is used where the mask lets every pair it
    attends through (the block-diagonal mask, or the causal or sliding one over the whole row
    that a model with a cache gets: the packing then keeps the sequences apart, as
    flash-attn's path does); a mask that hides a pair within a sequence (padding) raises with
    cu_seq_lens and leaves position ids alone to the masked path. Reading position ids and
    checking masks needs the data (a device sync): under torch.compile or a CUDA graph
    capture (``_traced``) packing comes from cu_seq_lens alone, unchecked, as flash-attn's
    path takes them."""
    given = kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None
    sliding = kwargs.get("sliding_window")
    if given:
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        if cu_q is None or cu_k is None or max_q is None or max_k is None:
            raise ValueError("packed sequences need cu_seq_lens_q, cu_seq_lens_k, "
                             "max_length_q and max_length_k together")
        if query.shape[0] != 1:
            raise ValueError(f"packed sequences come as one row of tokens (batch 1), got "
                             f"batch {query.shape[0]}")
        packing = dict(cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, sliding=sliding)
        if attention_mask is not None and not _traced(query) and \
                not _mask_allows(attention_mask, cu_q, cu_k, is_causal, sliding):
            raise ValueError("the attention mask hides keys within the sequences that "
                             "cu_seq_lens_q/k delimit (padding?): pass packed sequences "
                             "without padding, or a mask without cu_seq_lens")
        return packing
    position_ids = kwargs.get("position_ids")
    total = query.shape[2]
    if (not isinstance(position_ids, torch.Tensor) or query.shape[0] != 1 or total < 2 or
            key.shape[2] != total or tuple(position_ids.shape) != (1, total) or
            _traced(query)):
        return None
    cu = _restarts(position_ids)
    if cu is None:
        return None
    if attention_mask is not None and not _mask_allows(attention_mask, cu[0], cu[0], is_causal,
                                                       sliding):
        return None
    return dict(cu_q=cu[0], cu_k=cu[0], max_q=cu[1], max_k=cu[1], sliding=sliding)


def _traced(query: torch.Tensor) -> bool:
    """Whether torch.compile traces this call or a CUDA graph captures it: no device sync."""
    return torch.compiler.is_compiling() or (
        query.is_cuda and torch.cuda.is_current_stream_capturing())


# The last answers of _restarts, _mask_allows and _padding: every layer of a forward passes
# the same position_ids and mask objects, so each costs one device sync a forward, not one a
# layer. Inference tensors keep no version counter: their answers are not kept.
_SEEN: dict = {}


def _remembered(key: str, tensors: tuple, compute):
    """compute() once for ``tensors`` as they are now (the objects and their versions)."""
    if any(t.is_inference() for t in tensors):
        return compute()
    ids = (key, *map(id, tensors))
    entry = _SEEN.get(ids)
    if entry is not None and all(ref() is t for ref, t in zip(entry[0], tensors)) and \
            entry[1] == tuple(t._version for t in tensors):
        return entry[2]
    value = compute()
    if len(_SEEN) > 16:
        _SEEN.clear()
    _SEEN[ids] = (tuple(map(weakref.ref, tensors)), tuple(t._version for t in tensors), value)
    return value


def _restarts(position_ids: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(cu_seqlens int32 [B + 1], the longest sequence) of the sequences packed in one row of
    position ids, or None when the row holds one sequence."""
    def compute():
        pos = position_ids[0]
        restart = torch.ones_like(pos, dtype=torch.bool)
        restart[1:] = pos[1:] != pos[:-1] + 1
        starts = restart.nonzero().flatten()
        if starts.numel() < 2:
            return None
        cu = torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)
        return cu, int((cu[1:] - cu[:-1]).max())
    return _remembered("restarts", (position_ids,), compute)


def _blocks_hold(mask: torch.Tensor, expected, contains: bool) -> bool:
    """Whether the boolean mask [B, Lq, Lk] equals (``contains``: includes) ``expected(rows)``
    ([B or 1, len(rows), Lk]) on every block of query rows: compared a few hundred MiB at a
    time, with one device sync."""
    bad = torch.zeros((), dtype=torch.bool, device=mask.device)
    step = max(1, 2**28 // (mask.shape[0] * mask.shape[2]))
    for start in range(0, mask.shape[1], step):
        rows = torch.arange(start, min(start + step, mask.shape[1]), device=mask.device)
        want, got = expected(rows), mask[:, start:start + step]
        bad |= (want & ~got).any() if contains else (want != got).any()
    return not bool(bad)


def _visible(rows: torch.Tensor, total: int, is_causal: bool, sliding: int | None
             ) -> torch.Tensor | bool:
    """[len(rows), total]: key j is within the causal (and sliding) band of query row i."""
    if not is_causal and not sliding:
        return True
    keys = torch.arange(total, device=rows.device)[None, :]
    band = keys <= rows[:, None] if is_causal else torch.ones_like(keys, dtype=torch.bool)
    if not sliding:
        return band
    # transformers' windows: the w most recent keys; without causality |i - j| < w.
    band = band & (keys > rows[:, None] - sliding)
    return band if is_causal else band & (keys < rows[:, None] + sliding)


def _mask_allows(mask: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, is_causal: bool,
                 sliding: int | None) -> bool:
    """Whether ``mask`` (transformers' [1, 1, Lq, Lk] boolean mask) lets query i see every key
    j that the varlen call lets it see: j in i's packed sequence (and j <= i when causal,
    i - j < ``sliding`` under a sliding window)."""
    def compute():
        if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[:2] != (1, 1) or \
                not torch.equal(cu_q, cu_k):
            return False
        total = mask.shape[-1]
        if mask.shape[-2] != total or int(cu_q[-1]) != total:
            return False
        starts = torch.zeros(total, dtype=torch.int32, device=mask.device)
        starts[cu_q[1:-1].long()] = 1
        seq = starts.cumsum(0)

        def expected(rows):
            same = seq[rows][:, None] == seq[None, :]
            return (same & _visible(rows, total, is_causal, sliding))[None]
        return _blocks_hold(mask[:, 0], expected, contains=True)
    return _remembered(f"mask {is_causal} {sliding}", (mask, cu_q, cu_k), compute)


def _padding(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
             is_causal: bool, sliding: int | None) -> tuple | None:
    """(token indices, cu_seqlens int32 [B + 1], the longest sequence) of a left- or
    right-padded batch, or None. Only a causal self-attention call (Lq = Lk) whose 4-D
    boolean mask is exactly causal (and sliding) attention over each row's tokens: its
    diagonal (a token sees itself, a pad nothing) is the padding mask, and the rest of the
    mask is checked against it (one sync a forward, remembered for the mask object); each
    row's tokens must be one run, so that their positions shift alike. Not while traced
    (``_traced``): the check needs the data."""
    if not is_causal or attention_mask is None or attention_mask.dtype != torch.bool or \
            attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or _traced(query):
        return None
    batch, _, q_len, k_len = attention_mask.shape
    if q_len != k_len or q_len < 2 or tuple(query.shape[::2]) != (batch, q_len) or \
            key.shape[2] != k_len:
        return None

    def compute():
        keep = attention_mask[:, 0].diagonal(dim1=-2, dim2=-1)  # [B, L]: who sees itself
        runs = keep[:, 0].int() + (keep[:, 1:] & ~keep[:, :-1]).sum(1)
        if bool(keep.all()) or not bool((runs <= 1).all()) or not _blocks_hold(
                attention_mask[:, 0],
                lambda rows: keep[:, None, :] & _visible(rows, q_len, True, sliding)[None],
                contains=False):
            return None
        lengths = keep.sum(1)
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        return keep.flatten().nonzero().flatten(), cu, int(lengths.max())
    return _remembered(f"padding {sliding}", (attention_mask,), compute)


def _unpadded_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      dropout: float, scaling: float | None, softcap: float | None,
                      sinks: torch.Tensor | None, sliding: int | None, indices: torch.Tensor,
                      cu: torch.Tensor, longest: int, deterministic: bool) -> torch.Tensor:
    """A padded batch (``_padding``) as packed sequences: each row's tokens gathered, run
    through ``flash_attn_varlen_func`` (causal, the sliding window as ``_packed_forward``),
    and scattered back, the padding's rows 0 (as flash-attn's path leaves them). Returns
    [B, L, H, Dv]."""
    batch, heads, length, _ = query.shape
    q, k, v = (t.transpose(1, 2).reshape(batch * length, *t.shape[1:2], t.shape[3])
               .index_select(0, indices) for t in (query, key, value))
    window = _window(sliding)
    out = flash_tile.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, dropout,
                                            scaling, True, window, softcap or 0.0, None,
                                            deterministic, sinks=sinks)
    full = out.new_zeros(batch * length, heads, out.shape[-1]).index_copy(0, indices, out)
    return full.view(batch, length, heads, out.shape[-1])


def _packed_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    dropout: float, scaling: float | None, is_causal: bool,
                    softcap: float | None, sinks: torch.Tensor | None,
                    packing: dict, deterministic: bool) -> torch.Tensor:
    """Packed sequences (padding-free training, ``DataCollatorWithFlattening``): query
    [1, H, total_q, D] and key/value [1, H_kv, total_k, D] holding the sequences one after
    another, ``packing`` from ``_packing`` (cu_seqlens int32 [B + 1] and the longest
    sequences), through ``flash_attn_varlen_func`` (causal bottom-right per sequence;
    ``sliding_window`` w sees the w most recent keys, as transformers' masks, and without
    causality the keys within w - 1 rows either side, as its flash-attn path). Returns
    [1, total_q, H, Dv]."""
    sliding = packing["sliding"]
    window = _window(sliding)
    # ints as the collator gives them; a tensor bound is read back (one sync), as flash-attn
    # does with it.
    out = flash_tile.flash_attn_varlen_func(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
        packing["cu_q"].to(torch.int32), packing["cu_k"].to(torch.int32),
        int(packing["max_q"]), int(packing["max_k"]), dropout, scaling, is_causal, window,
        softcap or 0.0, None, deterministic, sinks=sinks)
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
