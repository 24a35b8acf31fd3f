"""Autotuning: the fastest registered tile variant per problem class, measured once per machine.

A problem class (``problem_key``) is the pass (forward or backward), the architecture, the
dtype, the head dims rounded up to the kernel's tile width, the band (full, causal, window),
the GQA group size, the optional features (softcap, ALiBi, mask kind, dropout), whether the
sequences are packed (varlen) and the query and key lengths (a packing's mean per sequence)
rounded up to a power of two. The first call of a class times every candidate of
``variants.candidates`` on that call's own inputs, rejects any candidate whose result differs
from the default variant's by more than rounding (a fast wrong variant never wins), and keeps
the fastest. The winner is launched from then on with exactly the config, so the hints, it was
timed with (``_launch.hinted_kernel``).

Winners persist in a JSON file per machine identity (GPU name, driver, cuda-tile, tileiras
and flash_tile versions, and ``code_digest`` of the kernels and the registry) in
``$FLASH_TILE_CACHE_DIR`` (default ``~/.cache/flash_tile``), so a class is tuned once per
machine, not once per process; ``flash-tile tune`` fills it ahead of time.

``FLASH_TILE_AUTOTUNE=0`` turns tuning off: every call gets the architecture's fixed default
(``variants.default_config``, ``default_backward_config`` for the backward), deterministic and
with no timing or cache. Calls made while a
CUDA graph is being captured never tune (timing needs synchronisation): they use a cached
winner or the default.
"""

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from tqdm import tqdm

from flash_tile import variants
from flash_tile._timing import cuda_time_ms, interleaved_ms

ENV_SWITCH = "FLASH_TILE_AUTOTUNE"
ENV_CACHE_DIR = "FLASH_TILE_CACHE_DIR"

# Timing per candidate: _ROUNDS interleaved rounds (``_timing.interleaved_ms``) of _ITERS
# launches after _WARMUP.
_WARMUP, _ITERS, _ROUNDS = 2, 5, 3


def enabled() -> bool:
    """False when ``FLASH_TILE_AUTOTUNE`` is 0/false/off/no."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def settings() -> tuple[str | None, str | None]:
    """The environment the choice depends on, part of ``decided``'s keys."""
    return os.environ.get(ENV_SWITCH), os.environ.get(ENV_CACHE_DIR)


#: The variant chosen per problem in this process, keyed by the caller's (cheap) tuple of
#: everything ``problem_key`` reads plus ``settings()``; emptied by ``clear_memory_cache``.
decided: dict[tuple, variants.TileConfig] = {}

#: Call plans made from those choices (``flash_tile._plans``), keyed by a call's signature
#: plus ``settings()``; emptied with them.
plans: dict[tuple, object] = {}

#: Signatures met once, whose second call makes a plan (``flash_tile._plans.sighted``, for
#: calls whose keys may change every call, as a serving batch's packing); emptied with them.
sighted: set[tuple] = set()


def length_bucket(length: int) -> int:
    """Lengths share a tuning result per power of two, from 64 up to 16k (longer ones tile the
    same way as 16k)."""
    return min(variants.tile_width(length, 64), 16384)


def problem_key(backward: bool, capability: tuple[int, int], dtype: torch.dtype,
                head_dim: int, v_head_dim: int, q_len: int, k_len: int, group: int,
                window: tuple[int, int], softcap: bool, alibi: bool,
                mask_kind: str | None, dropout: bool = False,
                deterministic: bool = False, varlen: bool = False) -> str:
    """The problem class a tuning result holds for, as a readable string; a deterministic
    backward is a class of its own (it times the two-pass variants only), and so are packed
    sequences (``varlen``, whose lengths are the mean per sequence)."""
    left, right = window
    band = "full" if (left, right) == (-1, -1) else "causal" if (left, right) == (-1, 0) \
        else "window"
    features = [name for name, on in (("softcap", softcap), ("alibi", alibi)) if on]
    if mask_kind:
        features.append(f"{mask_kind}-mask")
    if dropout:
        features.append("dropout")
    if deterministic:
        features.append("deterministic")
    if varlen:
        features.append("varlen")
    return "|".join([
        "bwd" if backward else "fwd", variants.arch_name(capability),
        str(dtype).removeprefix("torch."),
        f"d{variants.tile_width(head_dim)}x{variants.tile_width(v_head_dim)}", band,
        f"group{group}",
        "+".join(features) or "plain", f"q{length_bucket(q_len)}", f"k{length_bucket(k_len)}"])


def _agree(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> bool:
    """Whether a candidate's outputs equal the default's up to rounding: the same infinities
    (an LSE's empty rows) and, elsewhere, a max difference within 8 units of the output
    dtype's precision at the reference's largest magnitude (two correct variants differ by
    fp32 summation order, so by an ulp or two after rounding). A variant that drops or repeats
    a tile is off by a fraction of the values themselves: attention outputs over long rows are
    small (about 1/sqrt(L) for random values), so the scale has no floor of 1."""
    for a, b in zip(got, want, strict=True):
        if a.shape != b.shape:
            return False
        # fp32 outputs (the LSE) still differ by the summation order of fp32 sums.
        eps = max(torch.finfo(b.dtype).eps, 1e-6)
        a, b = a.float(), b.float()
        inf = b.isinf()
        if not torch.equal(inf, a.isinf()) or not torch.equal(a[inf], b[inf]):
            return False
        if a.isnan().any():
            return False
        if b.numel() == 0:
            continue
        a, b = a.masked_fill(inf, 0.0), b.masked_fill(inf, 0.0)
        if (a - b).abs().max().item() > 8 * eps * b.abs().max().item():
            return False
    return True


def tune(configs: Sequence[variants.TileConfig],
         run: Callable[[variants.TileConfig], tuple[torch.Tensor, ...]],
         time_ms: Callable[[Callable[[], object]], float] | None = None,
         log: Callable[[str], None] | None = None,
         progress: Callable[[Sequence], Iterable] = iter,
         written: Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]] | None = None
         ) -> tuple[variants.TileConfig, dict]:
    """Time ``run(config)`` for each config (the first is the default and the reference) and
    return the fastest whose outputs agree with the default's, with every candidate's result:
    milliseconds (the median of its rounds), or why it was rejected. Every candidate is
    checked (and so compiled) first, through ``progress(configs)`` (a progress bar), then
    timed once per round. ``written`` maps a run's outputs to the part of them the kernels
    write (varlen leaves rows outside every sequence unwritten); the check compares that."""
    time_ms = time_ms or (lambda fn: cuda_time_ms(fn, _WARMUP, _ITERS))
    log = log or (lambda line: None)
    written = written or (lambda outputs: outputs)
    outputs = run(configs[0])
    reference = [t.clone() for t in written(outputs)]
    if any(t.is_floating_point() and bool(t.isnan().any()) for t in reference):
        raise NotTunable("the default variant's result holds NaN (NaN or inf inputs): "
                         "nothing to check the candidates against")
    _spoil(outputs)
    results, checked = {}, []
    for config in progress(configs):
        name = describe(config)
        try:
            outputs = run(config)
            agrees = _agree(written(outputs), reference)
            _spoil(outputs)
            if agrees:
                checked.append(config)
                log(f"  {name}: checked")
            else:
                results[name] = "rejected: its result differs from the default variant's"
                log(f"  {name}: rejected (wrong result)")
        except Exception as e:  # noqa: BLE001 - a candidate that fails to build or run loses
            _failed(results, name, e, log)
    timed = interleaved_ms({describe(config): functools.partial(run, config)
                            for config in checked}, _ROUNDS, time_ms)
    best = None
    for config in checked:
        name = describe(config)
        if isinstance(timed[name], Exception):
            _failed(results, name, timed[name], log)
            continue
        results[name] = round(timed[name], 4)
        log(f"  {name}: {results[name]:.3f} ms")
        if best is None or results[name] < results[describe(best)]:
            best = config
    results = {describe(config): results[describe(config)] for config in configs}  # in order
    if best is None:
        raise RuntimeError("flash_tile autotune: no variant ran correctly, not even the "
                           f"default: {results}")
    return best, results


class NotTunable(RuntimeError):
    """This call's problem cannot be tuned on (``tune``): its default is launched, and a later
    call of the class tunes."""


def _spoil(outputs: Sequence[torch.Tensor]) -> None:
    """Fill a checked run's outputs with NaN before they are freed: the caching allocator
    tends to hand the next candidate the same blocks, where a variant that skips a tile would
    otherwise find the last run's right values and pass the check."""
    for t in outputs:
        if t.is_floating_point():
            t.fill_(math.nan)


def _failed(results: dict, name: str, error: Exception, log: Callable[[str], None]) -> None:
    results[name] = f"failed: {str(error).splitlines()[0][:200] if str(error) else type(error)}"
    log(f"  {name}: failed ({results[name]})")


def describe(config: variants.TileConfig) -> str:
    """``64x64 occupancy=2``: the tile shape, the hints and switches that are set and the dQ
    kernel's tiles when they are (``64x128 num_worker_warps=8 dq=128x64``, ``64x128
    num_worker_warps=8 one_pass``, ``128x256 num_worker_warps=8 exp2_fma=4``)."""
    hints = [f"{k}={v}" for k, v in config.hints().items()]
    default = variants.TileConfig()
    if (config.latency_k, config.latency_v) != (default.latency_k, default.latency_v):
        hints.append(f"latency={config.latency_k}/{config.latency_v}")
    if config.group_inner:
        hints.append("group_inner")
    if config.one_pass:
        hints.append("one_pass")
    if config.exp2_fma:
        hints.append(f"exp2_fma={config.exp2_fma}")
    if config.page_ahead:
        hints.append("page_ahead")
    # Named whenever set, even to tile_m x tile_n: configs that differ never share a name.
    if (config.dq_tile_m, config.dq_tile_n) != (None, None):
        dq = config.dq_kernel()
        hints.append(f"dq={dq.tile_m}x{dq.tile_n}")
    return " ".join([f"{config.tile_m}x{config.tile_n}", *hints])


class Cache:
    """Winners on disk, one JSON file per machine identity, read once per process; in memory
    only where the file cannot be found or written (a warning says so, once)."""

    def __init__(self, path: Path | None):
        self.path = path
        self.entries, self._configs = self._read(), {}

    def _read(self) -> dict:
        if self.path is None:
            return {}
        try:
            entries = json.loads(self.path.read_text()).get("entries", {})
        except (OSError, ValueError, AttributeError):
            return {}  # missing or unreadable: tune again and overwrite it
        return entries if isinstance(entries, dict) else {}

    def get(self, key: str, reread: bool = False) -> variants.TileConfig | None:
        """The winner kept for ``key``, or None; ``reread``: look at the file again first
        (another process may have tuned the class since this one read it)."""
        if key in self._configs:  # every lookup after the first (calls hit _ops' dict first)
            return self._configs[key]
        if reread:
            self.entries = {**self._read(), **self.entries}
        entry = self.entries.get(key)
        if entry is None:
            return None
        try:
            config = variants.TileConfig(**entry["config"])
        except (KeyError, TypeError, ValueError):
            return None  # written by another flash_tile: tune again
        self._configs[key] = config
        return config

    def put(self, key: str, config: variants.TileConfig, results: dict) -> None:
        # Another process may have tuned other classes since this one read the file: keep them.
        self.entries = {**self._read(), **self.entries,
                        key: {"config": dataclasses.asdict(config), "results": results}}
        self._configs[key] = config
        if self.path is None:
            return
        temporary = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Write then rename, so that a process reading it never sees half a file.
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False,
                                             suffix=".tmp") as f:
                temporary = f.name
                json.dump({"entries": self.entries}, f, indent=1, sort_keys=True)
            os.chmod(temporary, 0o644)  # readable by the other users of a shared directory
            os.replace(temporary, self.path)
        except OSError as e:  # a read-only or missing directory: keep the winners in memory
            if temporary is not None:
                Path(temporary).unlink(missing_ok=True)
            warnings.warn(f"flash_tile autotune: cannot write {self.path} ({e}); tuning "
                          f"results stay in this process (set {ENV_CACHE_DIR})",
                          RuntimeWarning, stacklevel=2)
            self.path = None


def code_digest() -> str:
    """A digest of the kernel sources and the variant registry: a source checkout keeps its
    version number across changes to either, and a winner tuned for other code is stale."""
    from flash_tile import kernels

    digest = hashlib.sha1(repr((variants._DEFAULTS, variants._BACKWARD_DEFAULTS,
                                variants._FORWARD_CANDIDATES,
                                variants._BACKWARD_CANDIDATES)).encode())
    for source in sorted(Path(kernels.__file__).parent.glob("*.py")):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:10]


@functools.cache
def _machine_slug(gpu_name: str) -> str:
    """GPU name, driver, cuda-tile, tileiras and flash_tile versions and the code's digest as a
    file-name fragment; looked up once per process (the driver query runs nvidia-smi, far too
    slow for every call)."""
    from flash_tile import __version__
    from flash_tile._validate import driver_version, package_version

    parts = [gpu_name, f"driver{driver_version() or 'unknown'}",
             f"cuda-tile{package_version('cuda-tile') or 'unknown'}",
             f"tileiras{package_version('nvidia-cuda-tileiras') or 'unknown'}",
             f"flash-tile{__version__}", f"code{code_digest()}"]
    return "-".join("".join(c if c.isalnum() or c in "._" else "_" for c in p) for p in parts)


def cache_path(device: torch.device) -> Path | None:
    """The cache file for this machine: named after the GPU, driver, cuda-tile, tileiras and
    flash_tile versions and the kernels' and registry's digest, so that a change of any of
    them tunes afresh; None where there is no directory to put it in (no
    ``FLASH_TILE_CACHE_DIR`` and no home directory: no HOME, a uid without a passwd entry)."""
    from flash_tile._validate import device_properties

    root = os.environ.get(ENV_CACHE_DIR)
    if not root:
        try:
            root = Path.home() / ".cache" / "flash_tile"
        except RuntimeError:
            return None
    return Path(root) / f"autotune-{_machine_slug(device_properties(device)[1])}.json"


_caches: dict[str, Cache] = {}


def _cache_for(device: torch.device) -> Cache:
    path = cache_path(device)
    if str(path) not in _caches:
        _caches[str(path)] = Cache(path)
    return _caches[str(path)]


def cached_entry(key: str, device: torch.device) -> dict | None:
    """The cache's entry for problem class ``key`` on ``device`` as this process holds it:
    {"config": the winner's fields, "results": every candidate's time or failure}."""
    return _cache_for(device).entries.get(key)


def cached_entries(device: torch.device) -> tuple[Path | None, dict]:
    """(the cache file, or None where it is kept in memory only; every problem class's entry
    as ``cached_entry`` gives it) for ``device``, as this process holds them."""
    cache = _cache_for(device)
    return cache.path, dict(cache.entries)


def choose(key: str, device: torch.device, configs: Sequence[variants.TileConfig],
           run: Callable[[variants.TileConfig], tuple[torch.Tensor, ...]],
           written: Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]] | None = None
           ) -> variants.TileConfig | None:
    """The variant to launch for problem class ``key``: the default (``configs[0]``) when
    tuning is off or there is nothing to choose from, else the cached winner, else the winner
    of a tuning run now (printed to stderr as it goes, then cached; ``written`` as
    ``tune``'s), run with ``device`` current (its stream is the one timed). None where this
    call cannot decide (a CUDA-graph capture, or inputs that make the default's result NaN):
    the caller launches the default and asks again on the class's next call."""
    if not enabled() or len(configs) == 1:
        return configs[0]
    cache = _cache_for(device)
    cached = cache.get(key, reread=True)  # before minutes of tuning: a file read is nothing
    if cached in configs:  # a winner no longer registered for this class is tuned again
        return cached
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        if torch.cuda.is_current_stream_capturing():
            return None
        return _tune_and_keep(key, cache, configs, run, written)


def _tune_and_keep(key, cache, configs, run, written) -> variants.TileConfig | None:

    def log(line):
        tqdm.write(f"flash_tile autotune: {line}", file=sys.stderr)

    log(f"tuning {key} over {len(configs)} variants (once per machine; "
        f"{ENV_SWITCH}=0 skips it)")
    progress = functools.partial(tqdm, desc="flash_tile autotune: compiling and checking",
                                 unit="variant", file=sys.stderr, leave=False)
    try:
        best, results = tune(configs, run, log=log, progress=progress, written=written)
    except NotTunable as e:
        log(f"  not now: {e}")
        return None
    log(f"  -> {describe(best)}")
    cache.put(key, best, results)
    return best


def clear_memory_cache() -> None:
    """Forget the cache files read and the choices made by this process (as a new process
    would); the tests use it."""
    _caches.clear()
    decided.clear()
    plans.clear()
    sighted.clear()
