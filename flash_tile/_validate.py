"""The input checks of the public functions, with their messages. ``api.py`` checks what
only it sees, where it takes it: ranks and batch sizes, the packed functions' shapes,
``return_attn_probs`` (with dropout), a mask together with causal, and dropout under graph capture.

All checks run before anything launches. Shape and dtype errors are ``ValueError``; arguments
or cases that are valid in flash-attn or torch but not supported here yet are
``NotImplementedError`` naming the argument; machine problems (no GPU, old GPU, no compiler) are
``RuntimeError`` saying how to fix them.
"""

import functools
import importlib.metadata
import math
import operator
import os
import shutil
import subprocess

import torch

from flash_tile._launch import needs_int64_index

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
MIN_CAPABILITY = (8, 0)

INSTALL_HINT = 'pip install "cuda-tile[tileiras]"'

# The FP8 forward: e4m3 inputs (FA3's), on sm_90 and newer (tileiras 13.4 compiles e4m3
# tensor-core matmuls for sm_90, sm_100 and sm_120, not for sm_89).
FP8_DTYPE = torch.float8_e4m3fn
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2,
              torch.float8_e5m2fnuz)
FP8_MIN_CAPABILITY = (9, 0)


def check_dtypes(*tensors: torch.Tensor) -> torch.dtype:
    """The one dtype of q, k and v: float16 or bfloat16."""
    dtype = tensors[0].dtype
    if any(t.dtype != dtype for t in tensors):
        raise ValueError("q, k and v must have the same dtype, got "
                         + ", ".join(str(t.dtype) for t in tensors))
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}: flash_tile supports torch.float16 and "
                         "torch.bfloat16 (under torch.autocast, float32 inputs are cast first)")
    return dtype


def check_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **descales) -> bool:
    """Whether this is an FP8 call: q, k and v all float8_e4m3fn. Another FP8 format, FP8
    mixed with other dtypes, or descale factors (``descales``: name -> tensor or None) given
    with non-FP8 inputs raise ValueError."""
    dtypes = [t.dtype for t in (q, k, v)]
    if any(d in FP8_DTYPES and d != FP8_DTYPE for d in dtypes):
        raise ValueError("the FP8 forward takes torch.float8_e4m3fn q, k and v, got "
                         + ", ".join(map(str, dtypes)))
    fp8 = [d == FP8_DTYPE for d in dtypes]
    if any(fp8) and not all(fp8):
        raise ValueError("q, k and v must all be torch.float8_e4m3fn (the FP8 forward) or "
                         "none of them, got " + ", ".join(map(str, dtypes)))
    given = [name for name, t in descales.items() if t is not None]
    if given and not all(fp8):
        raise ValueError(f"{', '.join(given)}: descale factors apply to float8_e4m3fn "
                         f"inputs only, got {dtypes[0]}")
    return all(fp8)


def check_kv_cache_dtypes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          new: tuple, k_descale, v_descale, batch: int | None = None,
                          entry: str = "flash_attn_with_kvcache"
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The dtypes of a KV-cache call (``entry``'s): q float16 or bfloat16; the caches in q's
    dtype, or both float8_e4m3fn (an FP8 cache); the new k/v (``new``: (k, v) or ()) in q's
    dtype or, into an FP8 cache, in e4m3. Returns an FP8 cache's (k, v) descale factors as
    [B, H_kv] fp32 (``descale_view``; None given is 1; B is ``batch``, by default q's first
    extent), None for a cache in q's dtype (where descale factors raise). FP8 queries raise
    NotImplementedError (the kernels run their matmuls in q's dtype)."""
    if q.dtype in FP8_DTYPES:
        raise NotImplementedError(f"{entry} takes float16 or bfloat16 q, got {q.dtype}: FP8 "
                                  f"is supported for the cache (float8_e4m3fn keys and values "
                                  f"with k_descale and v_descale)")
    caches = {k_cache.dtype, v_cache.dtype}
    if caches != {FP8_DTYPE}:
        check_dtypes(q, k_cache, v_cache, *new)
        given = [name for name, t in (("k_descale", k_descale), ("v_descale", v_descale))
                 if t is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: descale factors apply to float8_e4m3fn "
                             f"caches only, got {k_cache.dtype}")
        return None
    check_dtypes(q)
    if new and ({t.dtype for t in new} not in ({q.dtype}, {FP8_DTYPE})):
        raise ValueError(f"the new k and v must both be in q's dtype ({q.dtype}) or in "
                         f"torch.float8_e4m3fn for an FP8 cache, got {new[0].dtype} and "
                         f"{new[1].dtype}")
    return kv_descales(k_descale, v_descale, q.shape[0] if batch is None else batch,
                       k_cache.shape[2], q.device)


def kv_descales(k_descale, v_descale, batch: int, kv_heads: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 cache's (k, v) descale factors as [B, H_kv] fp32 views (``descale_view``)."""
    return (descale_view("k_descale", k_descale, batch, kv_heads, device),
            descale_view("v_descale", v_descale, batch, kv_heads, device))


def one_factor(device: torch.device) -> torch.Tensor:
    """The factor 1 on ``device``: made once (a call without descales launches no fill
    kernel), except while a CUDA graph is captured, where the fill is the graph's to replay
    (a tensor made then holds nothing until the graph runs)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.ones((), dtype=torch.float32, device=device)
    return _kept_one(device)


@functools.cache
def _kept_one(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def descale_view(name: str, t: torch.Tensor | None, batch: int, kv_heads: int,
                 device: torch.device) -> torch.Tensor:
    """An FP8 descale factor as a float32 [B, H_kv] tensor (a stride-0 view of one factor):
    ``t`` is [B, H_kv] (FA3's shape: per batch, or sequence, and key/value head), has one
    element (per-tensor scaling: 0-d, [1], [1, 1]), or is None (1)."""
    if t is None:
        return one_factor(device).expand(batch, kv_heads)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        raise ValueError(f"{name} must be a float32 tensor of shape [{batch}, {kv_heads}] "
                         f"(batch, key/value heads) or of one element, got "
                         f"{getattr(t, 'dtype', type(t).__name__)}")
    if t.numel() == 1:
        t = t.reshape(()).expand(batch, kv_heads)
    elif tuple(t.shape) != (batch, kv_heads):
        raise ValueError(f"{name} must have shape [{batch}, {kv_heads}] (batch, key/value "
                         f"heads) or one element, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} with q, got {t.device}")
    return t


def fp8_descales(batch: int, kv_heads: int, device: torch.device,
                 **descales) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 forward's descale factors (``descales``: q_descale, k_descale, v_descale in
    that order, each as ``descale_view`` takes it) as three fp32 [B, H_kv] views: the kernel
    reads each through its own strides, so nothing is copied or launched."""
    q_view, k_view, v_view = (descale_view(name, t, batch, kv_heads, device)
                              for name, t in descales.items())
    return q_view, k_view, v_view


def check_fp8_capability(device: torch.device, what: str) -> None:
    """RuntimeError on a GPU older than sm_90 for ``what`` (an FP8 path): the cuTile compiler
    (tileiras 13.4) takes float8_e4m3fn arrays for sm_90 and newer only (not sm_89, though
    Ada has FP8 tensor cores; sm_80 and sm_86 have none)."""
    capability, name = device_properties(device)
    if tuple(capability) < FP8_MIN_CAPABILITY:
        major, minor = capability
        raise RuntimeError(f"{name} has compute capability {major}.{minor}; {what} needs 9.0 "
                           "or newer (Hopper, Blackwell): the cuTile compiler (tileiras 13.4) "
                           "compiles no float8_e4m3fn code for sm_89 (Ada) and older GPUs")


def check_fp8_call(device: torch.device, dropout_p: float, *differentiable) -> None:
    """What the FP8 forward cannot do, before anything launches: a GPU older than sm_90
    (RuntimeError), dropout or a gradient (NotImplementedError: it is a forward for
    inference, as FA3's FP8 path)."""
    check_fp8_capability(device, "the FP8 forward")
    if dropout_p > 0.0:
        raise NotImplementedError("dropout_p > 0 with float8_e4m3fn inputs: the FP8 forward "
                                  "has no dropout (it is for inference); pass 0")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in differentiable):
        raise NotImplementedError("the FP8 forward has no backward (as FA3's): detach q, k, "
                                  "v (and sinks) or run under torch.no_grad(), or train in "
                                  "bfloat16")


def check_head_dims(q_dim: int, k_dim: int, v_dim: int) -> None:
    """q and k share a head dim; every head dim is 1 to MAX_HEAD_DIM (v may differ)."""
    if q_dim != k_dim:
        raise ValueError(f"q and k must have the same head dim, got {q_dim} and {k_dim}")
    for name, dim in (("query/key", q_dim), ("value", v_dim)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"unsupported {name} head dim {dim}: supported head dims are 1 "
                             f"to {MAX_HEAD_DIM}")


def check_heads(q_heads: int, kv_heads: int, v_heads: int, gqa_allowed: bool = True) -> None:
    """k and v share their heads, a whole number of query heads per key/value head (GQA);
    torch's SDPA wants ``enable_gqa`` for that, so its entry passes ``gqa_allowed``."""
    if kv_heads != v_heads:
        raise ValueError(f"k and v must have the same number of heads, got {kv_heads} and "
                         f"{v_heads}")
    if q_heads % kv_heads:
        raise ValueError(f"the number of query heads ({q_heads}) must be a multiple of the "
                         f"number of key/value heads ({kv_heads})")
    if q_heads != kv_heads and not gqa_allowed:
        raise ValueError(f"{q_heads} query heads and {kv_heads} key/value heads: pass "
                         "enable_gqa=True for grouped-query attention, as with torch")


def check_window(window_size) -> tuple[int, int]:
    """flash-attn's (left, right) window of ints; a negative entry leaves its side unbounded
    (returned as -1), as in flash-attn, which tests ``< 0``."""
    try:
        left, right = (operator.index(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair of ints (left, right), got "
                         f"{window_size!r}") from None
    return max(left, -1), max(right, -1)


def check_softcap(softcap: float) -> float:
    """A finite softcap as a float; as in flash-attn, only a positive one caps the scores
    (returned as it is), and one <= 0 is off (returned as 0.0)."""
    softcap = float(softcap)
    if not math.isfinite(softcap):
        raise ValueError(f"softcap must be a finite number (<= 0: off), got {softcap}")
    return max(softcap, 0.0)


def check_dropout(dropout_p: float) -> float:
    """A dropout probability in [0, 1), as a float."""
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return dropout_p


def check_attn_probs(dropout_p: float) -> None:
    """``return_attn_probs=True`` as flash-attn 2 takes it: without dropout it returns the
    LSE and an empty S_dmask (what callers use it for); with dropout flash-attn's S_dmask is
    the probabilities with the dropped ones negated, a testing aid these kernels do not
    write."""
    if check_dropout(dropout_p) > 0.0:
        raise NotImplementedError("return_attn_probs with dropout_p > 0: the probabilities "
                                  "and their dropout pattern (flash-attn's S_dmask) are not "
                                  "returned; pass dropout_p=0, or use return_lse=True for "
                                  "the log-sum-exp alone")


def check_alibi_slopes(slopes: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """[H] or [B, H] float32 slopes, returned as a contiguous [B, H] tensor."""
    if not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32:
        raise ValueError("alibi_slopes must be a float32 tensor of shape [heads] or "
                         f"[batch, heads], got {getattr(slopes, 'dtype', type(slopes))}")
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape [{heads}] or [{batch}, {heads}], got "
                         f"{tuple(slopes.shape)}")
    return slopes.expand(batch, heads).contiguous()


def check_sinks(sinks, heads: int, device: torch.device) -> torch.Tensor:
    """float32 [H] sink logits, one per query head, on the inputs' device; returned
    contiguous (a differentiable copy where they are not)."""
    if not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32:
        raise ValueError("sinks must be a float32 tensor of shape [heads], got "
                         f"{getattr(sinks, 'dtype', type(sinks).__name__)}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape [{heads}] (one logit per query head), got "
                         f"{tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks must be on {device} with q, got {sinks.device}")
    return sinks.contiguous()


def check_lengths(k_len: int, v_len: int, empty_ok: bool = False) -> None:
    """k and v have the same number of keys, nonzero unless ``empty_ok`` (the dense bf16/fp16
    entry points: every row then sees no key, as a fully masked row)."""
    if k_len != v_len:
        raise ValueError(f"k and v must have the same sequence length, got {k_len} and {v_len}")
    if k_len == 0 and not empty_ok:
        raise ValueError("k and v have sequence length 0, which this entry point does not "
                         "take")


def int_value(n) -> int | None:
    """``n`` as an int where an int parameter takes it (an int or a numpy integer: its
    ``__index__``, as ``operator.index``), never a bool; else None."""
    if isinstance(n, bool):
        return None
    try:
        return operator.index(n)
    except TypeError:
        return None


def check_max_seqlen(name: str, n) -> None:
    """flash-attn's ``max_seqlen_q`` / ``max_seqlen_k``, which the kernels do not read (their
    grid comes from the packed lengths): an int or anything flash-attn's int parameter takes
    (a numpy integer, a 0-d integer tensor, a torch.compile SymInt such as ``.item()`` of the
    lengths' max). Its type is checked, never its value: a comparison would make
    torch.compile guard on it, and fail on one read with ``.item()``."""
    if isinstance(n, torch.Tensor):
        ok = n.dim() == 0 and not (n.dtype.is_floating_point or n.dtype.is_complex or
                                   n.dtype == torch.bool)
    elif isinstance(n, (int, torch.SymInt)):  # not read: torch.compile would guard on it
        ok = not isinstance(n, bool)
    else:  # a numpy integer, or anything else an int parameter takes
        ok = int_value(n) is not None
    if not ok:
        raise ValueError(f"{name} must be an int (the longest sequence's length), got {n!r}")


def check_attn_mask(attn_mask: torch.Tensor, dtype: torch.dtype,
                    shape: tuple[int, ...]) -> torch.Tensor:
    """A boolean or ``dtype`` mask broadcast (as a stride-0 view) to ``shape``."""
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype not in (torch.bool, dtype):
        raise ValueError(f"attn_mask must be a bool tensor or a {dtype} tensor (additive), got "
                         f"{getattr(attn_mask, 'dtype', type(attn_mask))}")
    try:
        return attn_mask.expand(shape)
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                         f"{tuple(shape)}") from None


def check_scale(scale: float) -> float:
    """A positive finite softmax scale, as a float."""
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"the softmax scale must be a positive finite number, got {scale}")
    return scale


def check_device(*tensors: torch.Tensor) -> torch.device:
    """All tensors on one CUDA device of compute capability 8.0 or newer."""
    device = tensors[0].device
    if device.type != "cuda":
        why = "" if torch.cuda.is_available() else " (no CUDA GPU is visible to torch here)"
        raise ValueError(f"flash_tile runs on CUDA tensors, got tensors on {device}{why}")
    if any(t.device != device for t in tensors):
        raise ValueError("the call's tensors (q, k, v, then the others it takes) must be on "
                         "one device, got " + ", ".join(str(t.device) for t in tensors))
    capability, name = device_properties(device)
    check_capability(capability, name)
    check_compiler()
    return device


@functools.cache
def _device_properties(index: int) -> tuple[tuple[int, int], str]:
    """(compute capability, name) of device ``index``, from the driver."""
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.name


def device_properties(device: torch.device) -> tuple[tuple[int, int], str]:
    """(compute capability, name) of a CUDA device, looked up once per device: these checks
    run on every call, and the driver query costs more than the rest of them together."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_properties(index)


def check_capability(capability: tuple[int, int], name: str = "this GPU") -> None:
    """Compute capability 8.0 or newer, or a RuntimeError naming the GPU."""
    if tuple(capability) < MIN_CAPABILITY:
        major, minor = capability
        raise RuntimeError(f"{name} has compute capability {major}.{minor}; flash_tile needs "
                           "8.0 or newer (Ampere, Ada, Hopper, Blackwell)")


def find_cuda_tool(name: str) -> str | None:
    """A CUDA tool (tileiras, cuobjdump, nvdisasm, tileirdisasm) where cuTile looks for its
    compiler: the nvidia wheels' bin, then PATH, then $CUDA_HOME/bin; None if nowhere."""
    try:
        import nvidia.cu13

        found = shutil.which(name, path=os.path.join(nvidia.cu13.__path__[0], "bin"))
        if found:
            return found
    except (ImportError, AttributeError, IndexError):
        pass
    found = shutil.which(name)
    if found:
        return found
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return shutil.which(name, path=os.path.join(cuda_home, "bin")) if cuda_home else None


def find_tileiras() -> str | None:
    """Where cuTile will find its compiler, or None."""
    return find_cuda_tool("tileiras")


def package_version(name: str) -> str | None:
    """An installed distribution's version, or None (a copy that pip did not install)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def driver_version() -> str | None:
    """The NVIDIA driver version nvidia-smi reports, or None where there is none."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    words = done.stdout.split()
    return words[0] if done.returncode == 0 and words else None


_compiler_found = False


def check_compiler() -> None:
    """tileiras must be installed; once found it is not looked for again in this process.

    Skipped while torch.compile traces (a file-system search would break the graph); a missing
    compiler then surfaces at the launch, as cuTile's own error with the same install hint.
    """
    global _compiler_found
    if _compiler_found or torch.compiler.is_compiling():
        return
    _compiler_found = find_tileiras() is not None
    if not _compiler_found:
        raise RuntimeError("the cuTile compiler (tileiras) was not found; install it with "
                           f"`{INSTALL_HINT}` or put a CUDA 13.1+ toolkit's bin on PATH")


def check_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **no_grad_inputs) -> bool:
    """Whether the backward will be needed; raises for what it cannot do. ``no_grad_inputs``
    (alibi_slopes, attn_mask) get no gradient, so they must not ask for one. Arrays of 2**31
    elements or more are no limit: the backward has 64-bit entry points
    (``_launch.launch_backward``)."""
    if not torch.is_grad_enabled():
        return False
    for name, t in no_grad_inputs.items():
        if t is not None and t.requires_grad:
            raise NotImplementedError(f"{name}: gradients with respect to {name} are not "
                                      "supported; detach it")
    return any(t.requires_grad for t in (q, k, v))


def check_index_tensor(t, name: str, shape: tuple[int, ...], device: torch.device
                       ) -> torch.Tensor:
    """An int32 tensor of ``shape`` on ``device`` (cache lengths, cache rows, a block table);
    its values are not read (that would sync)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        raise ValueError(f"{name} must be an int32 tensor, got "
                         f"{getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} with q, got {t.device}")
    return t


def check_decode_mask(attn_mask, batch: int, q_len: int, capacity: int,
                      device: torch.device) -> torch.Tensor:
    """A KV-cache call's boolean mask as the decode takes it: [B, 1, Lq, capacity] (a
    stride-0 view where it broadcasts), from any bool tensor that broadcasts to that shape
    with its last dim the cache's capacity; one mask for every head."""
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool:
        raise ValueError(f"attn_mask must be a bool tensor (True = attend), got "
                         f"{getattr(attn_mask, 'dtype', type(attn_mask).__name__)}")
    shape = (batch, 1, q_len, capacity)
    if not 1 <= attn_mask.dim() <= 4 or attn_mask.shape[-1] != capacity:
        raise ValueError(f"attn_mask must be [B, 1, Lq, L] (or broadcast to it) with L the "
                         f"cache's capacity {capacity}, got shape {list(attn_mask.shape)}")
    if attn_mask.dim() == 4 and attn_mask.shape[1] != 1:
        raise ValueError(f"attn_mask must hold one mask for every head (dim 1 of size 1): the "
                         f"decode shares it across the heads, got shape "
                         f"{list(attn_mask.shape)}")
    try:
        view = decode_mask_view(attn_mask, batch, q_len)
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {list(attn_mask.shape)} does not broadcast to "
                         f"{list(shape)}") from None
    if view.device != device:
        raise ValueError(f"attn_mask must be on {device} with q, got {view.device}")
    return view


def decode_mask_view(attn_mask: torch.Tensor, batch: int, q_len: int) -> torch.Tensor:
    """A KV-cache mask as the decode reads it: [B, 1, Lq, L], a stride-0 view where it
    broadcasts (its shape checked by ``check_decode_mask``)."""
    return attn_mask.expand(batch, 1, q_len, attn_mask.shape[-1])


def check_block_table(block_table, batch: int, page_size: int, cache_batch_idx,
                      device: torch.device) -> None:
    """A paged cache's block table: int32 [B, max_blocks >= 1] on q's device, pages of at least
    one row, no cache_batch_idx (pages are the rows)."""
    if cache_batch_idx is not None:
        raise ValueError("cache_batch_idx selects rows of a contiguous cache; with a paged "
                         "cache (block_table) the table selects the pages")
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise ValueError("block_table must be an int32 tensor [batch, max_blocks], got "
                         f"{getattr(block_table, 'shape', type(block_table).__name__)}")
    check_index_tensor(block_table, "block_table", (batch, block_table.shape[1]), device)
    if block_table.shape[1] == 0:
        raise ValueError("block_table has no columns: every sequence needs room for at least "
                         "one page")
    if page_size <= 0:
        raise ValueError(f"page_size (the paged cache's dim 1) must be positive, got "
                         f"{page_size}")


def check_new_kv(k: torch.Tensor | None, v: torch.Tensor | None, batch: int,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, capacity: int,
                 has_seqlens: bool) -> int:
    """New keys/values to append: both given, [B, L_new, H_kv, D / Dv] matching the caches,
    L_new within the capacity, and cache_seqlens given (where to write). Returns L_new."""
    if k is None or v is None:
        raise ValueError("pass both k and v (the new keys and values), or neither")
    if not has_seqlens:
        raise ValueError("appending k/v needs cache_seqlens: the position to write at")
    kv_heads = k_cache.shape[2]
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if t.dim() != 4 or t.shape[0] != batch or t.shape[2] != kv_heads or \
                t.shape[3] != cache.shape[3]:
            raise ValueError(f"{name} must be [{batch}, L_new, {kv_heads}, {cache.shape[3]}], "
                             f"got {list(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same number of new rows, got {k.shape[1]} "
                         f"and {v.shape[1]}")
    if k.shape[1] > capacity:
        raise ValueError(f"{k.shape[1]} new rows do not fit a cache of {capacity}")
    return k.shape[1]


def check_rotary(rotary_cos, rotary_sin, q: torch.Tensor, capacity: int,
                 appends: bool) -> None:
    """The fused rotary embedding's tables: both given, with new k/v to rotate, 2-D
    [L_ro, rotary_dim / 2] alike in q's dtype and on its device, rotary_dim even and at most
    the head dim, and a row for each of ``capacity`` positions (those the cache can hold, and
    those of q's rows past the new keys), so that no position indexes past the tables
    whatever cache_seqlens holds (within the capacity)."""
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("pass both rotary_cos and rotary_sin, or neither")
    if not appends:
        raise ValueError("rotary_cos/rotary_sin rotate the new keys and q: pass k and v too "
                         "(as flash-attn requires)")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor [seqlen_ro, rotary_dim / 2], got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device} with q, got {t.device}")
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(f"rotary_cos and rotary_sin must have one shape, got "
                         f"{list(rotary_cos.shape)} and {list(rotary_sin.shape)}")
    seqlen_ro, half = rotary_cos.shape
    if not 1 <= 2 * half <= q.shape[-1]:
        raise ValueError(f"rotary_dim (2 * rotary_cos.shape[1] = {2 * half}) must be from 2 "
                         f"to the head dim {q.shape[-1]}")
    if seqlen_ro < capacity:
        raise ValueError(f"rotary_cos/rotary_sin have {seqlen_ro} rows for {capacity} "
                         f"positions (the cache's, and q's rows past the new keys): give a "
                         f"row for every position")


def check_decode_index(q: torch.Tensor, v_head_dim: int, *tensors: torch.Tensor) -> None:
    """The decode kernels index the caches in 64 bits where they need it (their _int64
    entry points), every other array in 32: q, its output [B, Lq, H, Dv] and ``tensors``
    (the new k/v, the mask) must stay below 2**31 elements (the split partials are kept
    below it by capping the split count)."""
    batch, q_len, heads, _ = q.shape
    if needs_int64_index(q, *tensors) or batch * q_len * heads * v_head_dim >= 2**31:
        raise NotImplementedError("flash_attn_with_kvcache with q, its output, new k/v or "
                                  "the mask of 2**31 elements or more is not supported: "
                                  "split the batch")


def check_num_splits(num_splits) -> int:
    """num_splits: a split count, or (0 or less, as flash-attn reads it) 0: chosen for the
    GPU; an int."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise ValueError(f"num_splits must be an int (0 or less: chosen for the GPU), got "
                         f"{num_splits!r}")
    return max(num_splits, 0)
