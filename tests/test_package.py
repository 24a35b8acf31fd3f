"""Packaging and house rules that a CPU can check."""

import ast
import inspect
import pathlib
import subprocess
import sys

import pytest

import flash_tile
import flash_tile.kernels

KERNELS = pathlib.Path(flash_tile.kernels.__file__).parent


def test_kernels_ship_inside_flash_tile(tmp_path):
    """The installed package maps kernels/ to flash_tile.kernels and adds no top-level
    ``kernels`` (run outside the checkout, whose root would otherwise be on sys.path): a
    ``kernels`` found there is another distribution's (Transformers 5 depends on one)."""
    probe = ("import importlib.util as u, flash_tile.kernels.attention_fwd as m; "
             "s = u.find_spec('kernels'); print(m.__name__, s and s.origin)")
    done = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    name, origin = done.stdout.split()
    assert name == "flash_tile.kernels.attention_fwd"
    assert origin == "None" or pathlib.Path(origin).resolve().parent != KERNELS.resolve()


def test_kernel_modules_import_only_cuda_tile_and_math():
    """Kernel modules import cuda.tile, math and each other (relatively), never torch."""
    for path in KERNELS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level == 1:  # from ._tiles import ...: a sibling kernel module
                    assert (KERNELS / f"{node.module}.py").exists(), node.module
                    continue
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name == "math" or name == "cuda.tile" or name.startswith("cuda.tile."), \
                    f"{path.name} imports {name}"


def test_public_api():
    """The exported functions are flash-attn's seven and torch's SDPA, and each documents its
    layout and causal alignment; beside them the FP8 forward's two helpers, which document
    their layout and the FP8 dtype."""
    helpers = ["hadamard_rotate", "quantize_fp8"]
    for name in helpers:
        doc = getattr(flash_tile, name).__doc__
        assert "float8_e4m3fn" in doc or "FP8" in doc, name
    functions = [name for name in flash_tile.__all__ if name not in ("__version__", *helpers)]
    assert sorted(functions) == ["flash_attn_func", "flash_attn_kvpacked_func",
                                 "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
                                 "flash_attn_varlen_kvpacked_func",
                                 "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
                                 "scaled_dot_product_attention"]
    for name in functions:
        doc = getattr(flash_tile, name).__doc__
        assert "causal" in doc and "[B" in doc, name


# flash-attn 2.8's positional parameters and defaults (flash_attn/flash_attn_interface.py),
# which a drop-in must take in the same order; flash_tile's own additions are keyword-only.
_COMMON = (("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
           ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
           ("deterministic", False), ("return_attn_probs", False))
FLASH_ATTN_2_8 = {
    "flash_attn_func": ("q", "k", "v", *_COMMON),
    "flash_attn_qkvpacked_func": ("qkv", *_COMMON),
    "flash_attn_kvpacked_func": ("q", "kv", *_COMMON),
    "flash_attn_varlen_func": ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                               "max_seqlen_k", *_COMMON, ("block_table", None)),
    "flash_attn_varlen_qkvpacked_func": ("qkv", "cu_seqlens", "max_seqlen", *_COMMON),
    "flash_attn_varlen_kvpacked_func": ("q", "kv", "cu_seqlens_q", "cu_seqlens_k",
                                        "max_seqlen_q", "max_seqlen_k", *_COMMON),
    "flash_attn_with_kvcache": (
        "q", "k_cache", "v_cache", ("k", None), ("v", None), ("rotary_cos", None),
        ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None),
        ("cache_leftpad", None), ("block_table", None), ("softmax_scale", None),
        ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
        ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
        ("return_softmax_lse", False)),
}


@pytest.mark.parametrize("name", sorted(FLASH_ATTN_2_8))
def test_flash_attn_positional_parameters(name):
    """Each flash-attn entry point takes flash-attn 2.8's positional parameters in its order
    with its defaults; anything more is keyword-only."""
    params = inspect.signature(getattr(flash_tile, name)).parameters.values()
    positional = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    got = [p.name if p.default is p.empty else (p.name, p.default) for p in positional]
    assert got == list(FLASH_ATTN_2_8[name])
    assert all(p.kind is p.KEYWORD_ONLY for p in params if p not in positional)
