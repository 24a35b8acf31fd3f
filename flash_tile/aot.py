"""Compile the kernels for any architecture without a GPU, disassemble, summarise.

``compile_forward`` exports a cubin through ``cuda.tile.compilation.export_kernel`` with the
constants ``flash_tile._launch`` would launch, for arrays laid out as the torch side passes them
(unit last stride, 16-byte aligned rows and base). ``disassemble`` runs cuobjdump from the
``nvidia-cuda-cuobjdump`` wheel; ``summarize`` counts the instructions that tell whether the
kernel runs on tensor cores, loads through TMA (and reduce-adds through it: the one-pass
backward's dQ), and how many exp2 and barriers it issues.
"""

import dataclasses
import io
import math
import re
import struct
import subprocess
import tempfile
from collections import Counter

import cuda.tile as ct
import torch
from cuda.tile.compilation import (ArrayConstraint, CallingConvention, KernelSignature,
                                   ScalarConstraint, export_kernel)

from flash_tile import decode_variants, variants
from flash_tile._launch import (KEYS_MAJOR_TILE_N, MASK_KINDS, forward_spec,
                                hinted_backward_kernels, hinted_kernel, kernel_mask, varlen_spec)
from flash_tile._launch_decode import DecodeSpec, decode_tiles
from flash_tile.kernels.attention_decode import (attention_decode, attention_decode_int64,
                                                 cache_append, cache_append_int64,
                                                 decode_combine)
from flash_tile.kernels.attention_fwd import keys_major_copy, keys_major_copy_int64
from flash_tile._validate import find_cuda_tool

DTYPES = {"float16": ct.float16, "bfloat16": ct.bfloat16, "float8_e4m3fn": ct.float8_e4m3fn}
#: An array parameter that the instance's switches leave unread: the launchers pass the int
#: ``_launch.ABSENT`` there.
ABSENT = ScalarConstraint(ct.int32)

# The tensor-core matmul instruction each architecture family should use.
TENSOR_CORE_OP = {"sm_80": "HMMA", "sm_86": "HMMA", "sm_89": "HMMA", "sm_90": "HGMMA",
                  "sm_100": "UTCHMMA", "sm_103": "UTCHMMA", "sm_120": "HMMA", "sm_121": "HMMA"}
# The same for e4m3 operands (the FP8 forward; tileiras 13.4 compiles none for sm_8x).
FP8_TENSOR_CORE_OP = {"sm_90": "QGMMA", "sm_100": "UTCQMMA", "sm_103": "UTCQMMA",
                      "sm_120": "QMMA", "sm_121": "QMMA"}
# Architectures with the tensor memory accelerator: their tile loads should be UTMALDG.
TMA_ARCHS = ("sm_90", "sm_100", "sm_103", "sm_120", "sm_121")

_COUNTED = {
    "tensor_core": re.compile(r"\b(HGMMA|HMMA|QGMMA|QMMA|UTC\w*MMA)\b"),
    "tma_load": re.compile(r"\bUTMALDG\b"),
    "tma_store": re.compile(r"\bUTMASTG\b"),
    "tma_reduce": re.compile(r"\bUTMAREDG\b"),
    "exp2": re.compile(r"\bMUFU\.EX2\b"),
    "barrier": re.compile(r"\bBAR\.\w+"),
    "global_load": re.compile(r"\bLDG\.\S+"),
    "local_memory": re.compile(r"\b(LDL|STL)\b"),
}
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.M)


def _array(dtype, ndim: int, row: int = 8, index_dtype=ct.int32,
           length: int = 1) -> ArrayConstraint:
    """An array as torch allocates it and the JIT sees it: unit last stride, 16-byte aligned
    base, outer strides that are multiples of the row length ``row`` (so of gcd(row, 16
    bytes)), and, as the JIT specialises, the last two extents (``length`` rows of ``row``)
    marked divisible by 16 where they are."""
    elems_16b = 16 // (1 if dtype == ct.float8_e4m3fn else
                       2 if dtype in (ct.float16, ct.bfloat16) else 4)
    divisor = math.gcd(row, elems_16b)
    shape_div = (1,) * (ndim - 2) + tuple(16 if n % 16 == 0 else 1 for n in (length, row))
    return ArrayConstraint(dtype, ndim, index_dtype=index_dtype, stride_lower_bound_incl=0,
                           alias_groups=(), may_alias_internally=False,
                           stride_constant=(None,) * (ndim - 1) + (1,),
                           stride_divisible_by=(divisor,) * (ndim - 1) + (1,),
                           shape_divisible_by=shape_div, base_addr_divisible_by=16)


def _signature_parts(dtype, head_dim, v_head_dim, window, softcap, alibi, attn_mask, even_n,
                     store_lse, config, index, dropout=False, aligned=False, fp8=False):
    """(spec, constraint of Q/K, of V/Out, of fp32 [B, H, L] rows, of Slopes, of Mask,
    scalar constraints) shared by the forward and backward signatures."""
    # Even instances get a key length that is a multiple of the tiles (so of 16); ragged ones
    # one that is not, and, when ``aligned``, still a multiple of 16.
    k_len = config.tile_n * 4 + (0 if even_n else 16 if aligned else 1)
    rows_aligned = k_len % 16 == 0  # 16-byte aligned key rows, as the JIT would see them
    kind = MASK_KINDS[attn_mask]
    if DTYPES[dtype] == ct.float8_e4m3fn and not fp8:
        raise ValueError("float8_e4m3fn inputs compile only the FP8 forward: pass fp8=True")
    spec = forward_spec(config, head_dim, v_head_dim, k_len % config.tile_n == 0, window,
                        softcap, alibi, kind, store_lse, dropout, fp8=fp8)
    length = k_len if rows_aligned else 1
    qk = _array(DTYPES[dtype], 4, head_dim, index, length)
    vo = _array(DTYPES[dtype], 4, v_head_dim, index, length)
    if fp8:  # e4m3 Q/K and V^T, bf16 Out (the dtype says the inputs')
        qk = _array(ct.float8_e4m3fn, 4, head_dim, index, length)
        vo = (_keys_major(v_head_dim, k_len, index), _array(ct.bfloat16, 4, v_head_dim, index))
    rows = _array(ct.float32, 3, index_dtype=index)
    # A mask broadcast over batch, heads or query rows has zero strides (which every divisor
    # divides); its rows are as long as the keys, so aligned lengths get the JIT's 16-byte
    # alignment, with which it may load through TMA. A bool mask is typed as the launcher
    # passes it (_launch.kernel_mask: its uint8 view where TMA can read its rows), asked of a
    # meta mask with these rows.
    mask_dtype = DTYPES[dtype]
    if attn_mask == "bool":
        rows_of_keys = torch.empty((1, 1, 1, k_len), dtype=torch.bool, device="meta")
        mask_dtype = ct.uint8 if kernel_mask(rows_of_keys).dtype == torch.uint8 else ct.bool_
    mask_div = (16 if attn_mask == "bool" else 8) if rows_aligned else 1  # 16 B, in elements
    mask = ArrayConstraint(mask_dtype, 4, index_dtype=index, stride_lower_bound_incl=0,
                           alias_groups=(), may_alias_internally=True,
                           stride_constant=(None, None, None, 1),
                           stride_divisible_by=(mask_div, mask_div, mask_div, 1),
                           shape_divisible_by=(1, 1, 1, 16 if rows_aligned else 1),
                           base_addr_divisible_by=16)
    # scale, softcap, diag_offset, window_left, window_right, then dropout's seed, threshold
    # and scale.
    scalars = [ScalarConstraint(ct.float32), ScalarConstraint(ct.float32),
               ScalarConstraint(ct.int32), ScalarConstraint(ct.int32), ScalarConstraint(ct.int32),
               ScalarConstraint(ct.int32), ScalarConstraint(ct.int32), ScalarConstraint(ct.float32)]
    return spec, qk, vo, rows, _array(ct.float32, 2), mask, scalars


def forward_signature(dtype: str, head_dim: int, v_head_dim: int, window: tuple[int, int],
                      softcap: bool, alibi: bool, attn_mask: str | None, even_n: bool,
                      store_lse: bool, config: variants.TileConfig,
                      int64_index: bool = False, dropout: bool = False,
                      aligned: bool = False, varlen: bool = False,
                      sinks: bool = False, seqused_k: bool = False,
                      fp8: bool = False, page_size: int | None = None,
                      kv_dtype: str | None = None) -> KernelSignature:
    """The signature of ``attention_fwd`` (or ``attention_fwd_int64``) for one variant;
    ``even_n`` picks a key length that is (or is not) a multiple of the config's TILE_N, and
    ``aligned`` a ragged one that is a multiple of 16 (rows TMA can read); ``varlen`` the
    VARLEN switch (packed sequences, as ``_launch.forward_launch`` sets it) and ``seqused_k``
    its SEQUSED_K; ``sinks`` the SINKS switch; ``fp8`` the FP8 switch (``dtype`` is then
    not read: e4m3 Q, K and V^T, a bf16 Out); ``page_size`` (with ``varlen``) the PAGED
    switch, K and V pages of that many keys with a block table (with ``seqused_k``, FA3's
    form: the key counts alone, no cu_seqlens_k), in ``kv_dtype`` where given
    ("float8_e4m3fn": an FP8 cache, its k and v descale factors [B, H_kv] arrays)."""
    index = ct.int64 if int64_index else ct.int32
    spec, qk, vo, rows, slopes, mask, scalars = _signature_parts(
        dtype, head_dim, v_head_dim, window, softcap, alibi, attn_mask, even_n, store_lse, config,
        index, dropout, aligned, fp8)
    v, out = vo if fp8 else (vo, vo)
    k, table = qk, ABSENT
    if kv_dtype not in (None, "float8_e4m3fn") or (kv_dtype and page_size is None):
        raise ValueError(f"kv_dtype {kv_dtype!r}: pages in q's dtype (None) or an FP8 cache's "
                         "float8_e4m3fn, with page_size")
    if page_size is not None and (not varlen or fp8):
        raise ValueError("page_size: paged keys are a switch of the varlen forward, not of the "
                         "dense or the FP8 one")
    if varlen:  # the launcher's spec of the call's sequences (and pages)
        spec = varlen_spec(spec, seqused_k, page_size)
    spec = dataclasses.replace(spec, sinks=sinks)
    if page_size is not None:  # pages [num_blocks, page_size, H_kv, D] as flash-attn's
        table = _index_array(2)
        k, v = (_array(DTYPES[kv_dtype or dtype], 4, d, index) for d in (head_dim, v_head_dim))
    fp8_cache = kv_dtype is not None
    factors = _array(ct.float32, 2)  # (q, k, v) descales: q's under FP8, k's and v's caches' too
    descales = (factors if fp8 else ABSENT, *[factors if fp8 or fp8_cache else ABSENT] * 2)
    cu = cu_k = _index_array(1) if varlen else ABSENT
    if page_size is not None and seqused_k:  # FA3's paged form: no cumulative key lengths
        cu_k = ABSENT
    # The 64-bit entry point types Lse and Mask as 64-bit indexed: arrays there always.
    params = [qk, k, v, out, rows if store_lse or int64_index else ABSENT,
              slopes if alibi else ABSENT, mask if attn_mask or int64_index else ABSENT, cu,
              cu_k,
              _sinks() if sinks else ABSENT, _index_array(1) if varlen and seqused_k else ABSENT,
              *descales, table, *scalars,
              *spec.constants()]
    return KernelSignature(params, CallingConvention.cutile_python_v1())


def backward_signatures(dtype: str, head_dim: int, v_head_dim: int, window: tuple[int, int],
                        softcap: bool, alibi: bool, attn_mask: str | None, even_n: bool,
                        config: variants.TileConfig, group: int = 1,
                        lse_grad: bool = False, dropout: bool = False,
                        aligned: bool = False, varlen: bool = False, sinks: bool = False,
                        seqused_k: bool = False,
                        int64_index: bool = False) -> tuple[KernelSignature, ...]:
    """Signatures of the backward's kernels for one variant, in ``launch_backward``'s order:
    (dQ, dK/dV), or (preprocess, dK/dV, convert) for a ``config.one_pass`` variant (dK/dV on
    ``config``'s tiles, the others on ``config.dq_kernel()``'s);
    ``group`` query heads per key/value head; ``lse_grad`` when a gradient reaches the LSE;
    ``varlen`` the VARLEN switch and ``seqused_k`` its SEQUSED_K; ``sinks`` the dQ kernel's
    SINKS switch; ``int64_index`` the 64-bit entry points' signatures."""
    index = ct.int64 if int64_index else ct.int32
    (spec, qk, vo, rows, slopes, mask, scalars), (dq_spec, dq_qk, dq_vo, *_) = (
        _signature_parts(dtype, head_dim, v_head_dim, window, softcap, alibi, attn_mask,
                         even_n, True, c, index, dropout, aligned)
        for c in (config, config.dq_kernel()))
    if varlen:
        spec, dq_spec = (dataclasses.replace(s, even_n=False, varlen=True, seqused_k=seqused_k)
                         for s in (spec, dq_spec))
    dq_spec = dataclasses.replace(dq_spec, sinks=sinks)
    cc = CallingConvention.cutile_python_v1()
    cu = (_index_array(1),) * 2 if varlen else (ABSENT,) * 2
    used_k = _index_array(1) if varlen and seqused_k else ABSENT
    # The 64-bit entry points type dLse, Mask and dQacc as 64-bit indexed: arrays there always.
    slopes, mask = slopes if alibi else ABSENT, mask if attn_mask or int64_index else ABSENT
    dlse = rows if lse_grad or int64_index else ABSENT
    sink_arrays = (_sinks(), _array(ct.float32, 3)) if sinks else (ABSENT, ABSENT)
    # The one-pass form's fp32 dQ sums, rows padded to 16 bytes (_launch.dq_accumulator): the
    # strides of the padded rows, the extents of the head dim.
    acc = dataclasses.replace(_array(ct.float32, 4, -(-head_dim // 4) * 4, index),
                              shape_divisible_by=_array(ct.float32, 4,
                                                        row=head_dim).shape_divisible_by)
    dkdv = KernelSignature([qk, qk, vo, vo, rows, rows, qk, vo,
                            acc if config.one_pass or int64_index else ABSENT, slopes, mask,
                            *cu, used_k,
                            *scalars,
                            *spec.dkdv_constants(group, config.group_inner, config.one_pass)],
                           cc)
    if config.one_pass:
        return (KernelSignature([dq_vo, dq_vo, rows, dlse, rows, cu[0], *sink_arrays,
                                 *dq_spec.preprocess_constants(lse_grad)], cc),
                dkdv,
                KernelSignature([acc, dq_qk, cu[0], ScalarConstraint(ct.float32),
                                 *dq_spec.convert_constants()], cc))
    return (KernelSignature([dq_qk, dq_qk, dq_vo, dq_vo, dq_vo, rows, dlse, rows, dq_qk, slopes,
                             mask, *cu, *sink_arrays, used_k, *scalars,
                             *dq_spec.dq_constants(lse_grad)], cc),
            dkdv)


#: The backward's kernel names in launch order, by ``TileConfig.one_pass``.
BACKWARD_KERNELS = {False: ("dq", "dkdv"), True: ("preprocess", "dkdv", "convert")}


def _keys_major(v_head_dim: int, k_len: int, index) -> ArrayConstraint:
    """The FP8 forward's e4m3 V^T [B, H_kv, Dv, Lk] as ``_launch.keys_major`` makes it: unit
    last stride, every other stride a multiple of 16 (its key rows are padded to that)."""
    return ArrayConstraint(ct.float8_e4m3fn, 4, index_dtype=index, stride_lower_bound_incl=0,
                           alias_groups=(), may_alias_internally=False,
                           stride_constant=(None, None, None, 1),
                           stride_divisible_by=(16, 16, 16, 1),
                           shape_divisible_by=(1, 1, 16 if v_head_dim % 16 == 0 else 1,
                                               16 if k_len % 16 == 0 else 1),
                           base_addr_divisible_by=16)


def _default_config(arch, head_dim, v_head_dim, backward=False, plain=False, fp8=False,
                    causal=False, paged=False):
    """The variant a launch of this class gets with tuning off (``_ops._choose``; the FP8
    forward's, ``variants.fp8_config``, is never tuned: this is a long call's, where dense
    calls of at most ``variants.FP8_SHORT_KEYS`` keys may run another; pass ``config``; nor
    is the paged forward's, ``variants.paged_config``)."""
    capability, width = variants.capability_of(arch), max(head_dim, v_head_dim or 0)
    if backward:
        return variants.default_backward_config(capability, width, plain)
    if fp8:
        return variants.fp8_config(capability, width, causal)
    if paged:
        return variants.paged_config(capability, width)
    return variants.default_config(capability, width)


def _export(kernel, signature, arch, output_format="cubin") -> bytes:
    buffer = io.BytesIO()
    export_kernel(kernel, [signature], buffer, gpu_code=arch, output_format=output_format)
    return buffer.getvalue()


def compile_forward(arch: str, dtype: str = "float16", head_dim: int = 128,
                    v_head_dim: int | None = None, causal: bool = True,
                    window: tuple[int, int] = (-1, -1), softcap: bool = False,
                    alibi: bool = False, attn_mask: str | None = None, even_n: bool = False,
                    store_lse: bool = True, config: variants.TileConfig | None = None,
                    int64_index: bool = False, dropout: bool = False,
                    output_format: str = "cubin", aligned: bool = False,
                    varlen: bool = False, sinks: bool = False, seqused_k: bool = False,
                    fp8: bool = False, page_size: int | None = None,
                    kv_dtype: str | None = None) -> bytes:
    """A cubin of the forward for ``arch`` (e.g. "sm_90"); the config defaults to the one that
    architecture launches. ``causal`` sets the window's right bound to 0; ``attn_mask`` is
    None, "bool" or "additive"; ``int64_index`` compiles the 64-bit-index entry point used for
    tensors of 2**31 elements or more; ``dropout`` the DROPOUT switch; ``aligned`` makes a
    ragged key length a multiple of 16 (rows TMA can read); ``fp8`` the FP8 switch (e4m3
    inputs, ``dtype`` not read); ``page_size`` (with ``varlen``) keys in pages of that size,
    in ``kv_dtype`` where given (an FP8 cache: "float8_e4m3fn");
    ``output_format="tileir_bytecode"`` stops before tileiras and returns the Tile IR
    (``disassemble_tile_ir`` prints it)."""
    window = (window[0], 0) if causal else tuple(window)
    config = config or _default_config(arch, head_dim, v_head_dim, fp8=fp8,
                                       causal=window[1] >= 0, paged=page_size is not None)
    sig = forward_signature(dtype, head_dim, v_head_dim or head_dim, window, softcap, alibi,
                            attn_mask, even_n, store_lse, config, int64_index, dropout, aligned,
                            varlen, sinks, seqused_k, fp8, page_size, kv_dtype)
    return _export(hinted_kernel(config, int64_index), sig, arch, output_format)


def keys_major_signature(v_head_dim: int = 128, k_len: int = 1000,
                         int64_index: bool = False) -> KernelSignature:
    """The signature of ``keys_major_copy`` (``_int64`` with ``int64_index``), the FP8
    forward's V^T copy (``_launch.keys_major``), for an e4m3 V [B, H_kv, ``k_len``, Dv] laid
    out as flash-attn's [B, L, H, D] view."""
    index = ct.int64 if int64_index else ct.int32
    padded = -(-k_len // 16) * 16  # the copy writes V^T's padded rows whole
    return KernelSignature([_array(ct.float8_e4m3fn, 4, v_head_dim, index, k_len),
                            _keys_major(v_head_dim, padded, index), KEYS_MAJOR_TILE_N,
                            variants.tile_width(v_head_dim)],
                           CallingConvention.cutile_python_v1())


def compile_keys_major(arch: str, v_head_dim: int = 128, k_len: int = 1000,
                       int64_index: bool = False) -> bytes:
    """A cubin of the FP8 forward's V^T copy, arguments as ``keys_major_signature``."""
    return _export(keys_major_copy_int64 if int64_index else keys_major_copy,
                   keys_major_signature(v_head_dim, k_len, int64_index), arch)


def compile_backward(arch: str, dtype: str = "float16", head_dim: int = 128,
                     v_head_dim: int | None = None, causal: bool = True,
                     window: tuple[int, int] = (-1, -1), softcap: bool = False,
                     alibi: bool = False, attn_mask: str | None = None, even_n: bool = False,
                     config: variants.TileConfig | None = None, group: int = 1,
                     lse_grad: bool = False, dropout: bool = False,
                     aligned: bool = False, varlen: bool = False,
                     sinks: bool = False, seqused_k: bool = False,
                     int64_index: bool = False) -> dict[str, bytes]:
    """Cubins of the backward kernels ("dq", "dkdv"; one-pass variants "preprocess", "dkdv",
    "convert": ``BACKWARD_KERNELS``) for ``arch``, arguments as
    ``compile_forward`` (``int64_index``: the 64-bit entry points) plus ``group`` (query
    heads per key/value head) and ``lse_grad`` (a gradient reaches the LSE); the config
    defaults to the architecture's backward default for the class
    (``variants.default_backward_config``: plain without dropout and score features)."""
    plain = variants.is_plain(softcap, alibi, attn_mask, dropout)
    config = config or _default_config(arch, head_dim, v_head_dim, True, plain)
    window = (window[0], 0) if causal else tuple(window)
    sigs = backward_signatures(dtype, head_dim, v_head_dim or head_dim, window, softcap, alibi,
                               attn_mask, even_n, config, group, lse_grad, dropout, aligned,
                               varlen, sinks, seqused_k, int64_index)
    return {name: _export(kernel, sig, arch) for name, kernel, sig in
            zip(BACKWARD_KERNELS[config.one_pass], hinted_backward_kernels(config, int64_index),
                sigs, strict=True)}


def _sinks() -> ArrayConstraint:
    """The sinks' fp32 [H] vector (contiguous, as the entry points pass it)."""
    return ArrayConstraint(ct.float32, 1, index_dtype=ct.int32, stride_lower_bound_incl=0,
                           alias_groups=(), may_alias_internally=False, stride_constant=(1,),
                           stride_divisible_by=(1,), shape_divisible_by=(1,),
                           base_addr_divisible_by=16)


def _index_array(ndim: int) -> ArrayConstraint:
    """An int32 array of sequence lengths, cache rows or a block table (any strides)."""
    return ArrayConstraint(ct.int32, ndim, index_dtype=ct.int32, stride_lower_bound_incl=0,
                           alias_groups=(), may_alias_internally=False,
                           stride_constant=(None,) * ndim, stride_divisible_by=(1,) * ndim,
                           shape_divisible_by=(1,) * ndim, base_addr_divisible_by=4)


def decode_signatures(config: decode_variants.DecodeConfig, dtype: str = "bfloat16",
                      head_dim: int = 128, v_head_dim: int | None = None, group: int = 8,
                      q_len: int = 1, page_size: int | None = None, causal: bool = True,
                      window: tuple[int, int] = (-1, -1), softcap: bool = False,
                      alibi: bool = False, batch_idx: bool = False, splits: int = 4,
                      store_lse: bool = True, int64_index: bool = False,
                      sinks: bool = False, leftpad: bool = False,
                      rotary: str | None = None, fp8_cache: bool = False,
                      attn_mask: bool = False) -> dict[str, tuple]:
    """{name: (kernel, signature)} of the decode path on ``config``'s tiles, in
    ``_launch_decode.launch_decode``'s order; arguments as ``compile_decode``."""
    v_head_dim = v_head_dim or head_dim
    window = (window[0], 0) if causal else tuple(window)
    tile_lq, tile_g, tile_n, page_n, gather = decode_tiles(q_len, group, page_size, config,
                                                           int64_index)
    spec = DecodeSpec(splits, tile_lq, tile_g, tile_n, variants.tile_width(head_dim),
                      variants.tile_width(v_head_dim), window[0] >= 0, window[1] >= 0, softcap,
                      alibi, page_size is not None, page_n, gather, batch_idx, store_lse,
                      sinks, leftpad, attn_mask)
    qk, vo = (_array(DTYPES[dtype], n, d) for n, d in ((5, head_dim), (5, v_head_dim)))
    index = ct.int64 if int64_index else ct.int32
    cache = ct.float8_e4m3fn if fp8_cache else DTYPES[dtype]
    k, v = (_array(cache, 4, d, index) for d in (head_dim, v_head_dim))
    new_k, new_v = (_array(DTYPES[dtype], 4, d) for d in (head_dim, v_head_dim))
    descales = [_array(ct.float32, 2) if fp8_cache else ABSENT] * 2
    # A mask over a capacity of 16-byte rows comes as its uint8 view (_launch.kernel_mask).
    mask = _array(ct.uint8, 4, 1024) if attn_mask else ABSENT
    split = splits > 1
    decode, append = ((attention_decode_int64, cache_append_int64) if int64_index else
                      (attention_decode, cache_append))
    scalars = [ScalarConstraint(ct.float32), ScalarConstraint(ct.float32)] + \
        [ScalarConstraint(ct.int32)] * 3
    cc = CallingConvention.cutile_python_v1()
    outputs = ((ABSENT, ABSENT, _array(ct.float32, 6), _array(ct.float32, 5)) if split else
               (vo, _array(ct.float32, 4) if store_lse else ABSENT, ABSENT, ABSENT))
    batch_rows, table = (_index_array(1) if batch_idx else ABSENT,
                         ABSENT if page_size is None else _index_array(2))
    kernels = {"decode": (decode.replace_hints(**config.hints()), KernelSignature(
        [qk, k, v, *outputs, _index_array(1), batch_rows, table,
         _array(ct.float32, 3) if alibi else ABSENT, _array(ct.float32, 2) if sinks else ABSENT,
         _index_array(1) if leftpad else ABSENT, mask, *descales, *scalars,
         *spec.constants()], cc))}
    if split:
        kernels["combine"] = (decode_combine, KernelSignature(
            [_array(ct.float32, 5, v_head_dim), _array(ct.float32, 4),
             _array(DTYPES[dtype], 4, v_head_dim),
             _array(ct.float32, 3) if store_lse else ABSENT, variants.tile_width(splits, 1),
             variants.tile_width(v_head_dim), store_lse], cc))
    rotated = (_array(DTYPES[dtype], 5, head_dim), _array(DTYPES[dtype], 5, head_dim),
               _array(DTYPES[dtype], 2, head_dim // 2), _array(DTYPES[dtype], 2, head_dim // 2))
    if rotary is None:
        rotated = (ABSENT,) * 4
    kernels["append"] = (append, KernelSignature(
        [new_k, new_v, k, v, _index_array(1), batch_rows, table, *rotated, *descales,
         *[ScalarConstraint(ct.int32)] * 3, variants.tile_width(head_dim),
         variants.tile_width(v_head_dim), variants.tile_width(group, 1) if rotary else 1,
         page_size is not None, batch_idx, rotary is not None, rotary == "interleaved"], cc))
    return kernels


def compile_decode(arch: str, dtype: str = "bfloat16", head_dim: int = 128,
                   v_head_dim: int | None = None, group: int = 8, q_len: int = 1,
                   page_size: int | None = None, causal: bool = True,
                   window: tuple[int, int] = (-1, -1), softcap: bool = False,
                   alibi: bool = False, batch_idx: bool = False, splits: int = 4,
                   store_lse: bool = True, config: decode_variants.DecodeConfig | None = None,
                   int64_index: bool = False, sinks: bool = False, leftpad: bool = False,
                   rotary: str | None = None, fp8_cache: bool = False,
                   attn_mask: bool = False) -> dict[str, bytes]:
    """Cubins of the decode path ("decode", and "combine" when ``splits`` > 1, "append") for
    ``arch``: ``group`` query heads per key/value head, ``q_len`` query rows, a paged cache of
    ``page_size`` (None: contiguous), ``int64_index`` the entry points for caches of 2**31
    elements or more, ``sinks`` the SINKS switch, ``leftpad`` LEFTPAD, ``rotary`` the append's
    rotary embedding ("interleaved", "neox" or None), ``fp8_cache`` float8_e4m3fn caches
    (``dtype`` is q's, and the appended rows'), ``attn_mask`` ATTN_MASK (a mask over 16-byte
    rows, as its uint8 view); other arguments as ``compile_forward``."""
    config = config or decode_variants.default_decode_config(
        variants.capability_of(arch), max(head_dim, v_head_dim or head_dim))
    kernels = decode_signatures(config, dtype, head_dim, v_head_dim, group, q_len, page_size,
                                causal, window, softcap, alibi, batch_idx, splits, store_lse,
                                int64_index, sinks, leftpad, rotary, fp8_cache, attn_mask)
    return {name: _export(kernel, sig, arch) for name, (kernel, sig) in kernels.items()}


def _cuda_tool(name: str) -> str:
    found = find_cuda_tool(name)
    if found is None:
        wheel = "cuda-tile[tileiras]" if name == "tileirdisasm" else f"nvidia-cuda-{name}"
        raise RuntimeError(f"{name} was not found; install it with `pip install {wheel}` "
                           "(flash-tile's dev extra has them all)")
    return found


def _run_on_cubin(tool: str, args: list[str], cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile() as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([_cuda_tool(tool), *args, f.name], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{tool} failed: {done.stderr.strip()}")
    return done.stdout


# nvdisasm (13.4 and 13.5) stops at a NOP that tileiras 13.4 encodes with an extended-opcode
# value its tables lack ("Opclass 'nop_', undefined value 0x10 for table 'TABLES_opex_1'"); seen
# once, in the sm_90 dK/dV kernel at D=128 with a bool mask TMA reads. A NOP has no operands,
# so the listing is taken with each such NOP written as the plain NOP (its scheduling bits
# too), and says so in a first comment line: no count that ``summarize`` takes changes.
# Anything else nvdisasm cannot read is raised as it is.
_UNDECODABLE_NOP = re.compile(r"Opclass 'nop_', undefined value 0x[0-9a-f]+ for table "
                              r"'\w+' at address (0x[0-9a-f]+)", re.I)
_NOP_OPCODE, _NOP_MASK = 0x918, 0xFFF
PLAIN_NOP = (0x7918).to_bytes(8, "little") + (0x000FC00000000000).to_bytes(8, "little")


def disassemble(cubin: bytes) -> str:
    """The SASS listing of a cubin (cuobjdump -sass); see ``_UNDECODABLE_NOP``."""
    rewritten = []
    while True:
        try:
            sass = _run_on_cubin("cuobjdump", ["-sass"], cubin)
        except RuntimeError as error:
            cubin, address = _with_plain_nop(cubin, error)
            rewritten.append(f"{address:#x}")
            continue
        if rewritten:
            sass = (f"// flash_tile.aot: NOPs nvdisasm could not decode, listed as plain NOPs, "
                    f"at {', '.join(rewritten)}\n{sass}")
        return sass


def _with_plain_nop(cubin: bytes, error: RuntimeError) -> tuple[bytes, int]:
    """``cubin`` with the NOP nvdisasm could not decode written plainly, and its address;
    ``error`` is raised again unless it names such a NOP, 16-byte aligned, in the code of a
    cubin of one kernel."""
    found = _UNDECODABLE_NOP.search(str(error))
    texts = _text_sections(cubin) if found else None
    if not texts or len(texts) != 1:
        raise error
    (text, size), address = texts[0], int(found.group(1), 16)
    at = text + address
    if (address % 16 or address + 16 > size
            or int.from_bytes(cubin[at:at + 8], "little") & _NOP_MASK != _NOP_OPCODE
            or cubin[at:at + 16] == PLAIN_NOP):  # nvdisasm rejects the plain NOP too
        raise error
    return cubin[:at] + PLAIN_NOP + cubin[at + 16:], address


def _text_sections(cubin: bytes) -> list[tuple[int, int]] | None:
    """(file offset, size) of each ``.text.*`` section (one per kernel) of a little-endian
    ELF64 cubin; None for anything else, or a header that does not parse."""
    if cubin[:6] != b"\x7fELF\x02\x01":
        return None
    try:
        section_table, = struct.unpack_from("<Q", cubin, 0x28)
        entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)

        def section(index):  # (name offset, file offset, size) of a section header
            fields = struct.unpack_from("<IIQQQQ", cubin, section_table + index * entry_size)
            return fields[0], fields[4], fields[5]

        names = section(names_index)[1]
        found = []
        for index in range(count):
            name, offset, size = section(index)
            start = names + name
            if cubin[start:cubin.index(b"\0", start)].startswith(b".text."):
                found.append((offset, size))
        return found
    except (struct.error, ValueError):
        return None


def disassemble_tile_ir(bytecode: bytes) -> str:
    """The Tile IR text of a bytecode file (tileirdisasm, shipped beside tileiras)."""
    return _run_on_cubin("tileirdisasm", [], bytecode)


def tile_ir_ops(text: str, top: int = 12) -> list[tuple[str, int]]:
    """The ``top`` most frequent operations of a Tile IR listing."""
    ops = re.findall(r"=\s+([a-z_][a-z0-9_.]*)", text)
    return Counter(ops).most_common(top)


def resource_usage(cubin: bytes) -> dict:
    """Registers per thread and static shared memory in bytes, as the cubin records them."""
    text = _run_on_cubin("cuobjdump", ["-res-usage"], cubin)
    regs = re.search(r"REG:(\d+)", text)
    shared = re.search(r"SHARED:(\d+)", text)
    return {"registers": int(regs.group(1)) if regs else None,
            "shared_bytes": int(shared.group(1)) if shared else None}


def summarize(sass: str) -> dict:
    """Instruction counts of a SASS listing: total, and the classes in ``_COUNTED``."""
    counts = {name: len(pattern.findall(sass)) for name, pattern in _COUNTED.items()}
    counts["instructions"] = len(_INSTRUCTION.findall(sass))
    return counts


# A tensor-core instruction, then its operands, whose first source (the A operand) says where
# A is read from: HGMMA and QGMMA name their destination registers first, UTC*MMA (accumulating
# in tensor memory) A first.
_TENSOR_CORE_OPERANDS = re.compile(r"\b(HGMMA|HMMA|QGMMA|QMMA|UTC\w*MMA)\b(?:\.\S+)?\s+([^;]*)")


def tensor_core_sites(sass: str) -> dict[tuple[str, str], int]:
    """{(opcode, where its A operand is read from): count} of a SASS listing: "shared" (a
    shared-memory descriptor), "tensor memory" or "registers" (HMMA and QMMA always). On
    HGMMA, QGMMA and UTC*MMA the forward's Q K^T reads shared memory and its P V registers or
    tensor memory, which tells its two matmuls apart."""
    sites = Counter()
    for op, operands in _TENSOR_CORE_OPERANDS.findall(sass):
        a = operands.split(",")[0 if op.startswith("UTC") else 1].strip()
        sites[op, ("shared" if a.startswith("gdesc") else
                   "tensor memory" if a.startswith("tmem") else "registers")] += 1
    return dict(sites)


def opcode_histogram(sass: str, top: int = 12) -> list[tuple[str, int]]:
    """The ``top`` most frequent opcodes (with their modifiers) of a SASS listing."""
    return Counter(m.group(2) for m in _INSTRUCTION.finditer(sass)).most_common(top)
