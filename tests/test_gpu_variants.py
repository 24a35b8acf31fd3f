"""Every registered tile variant of this GPU's architecture, and the autotuner, on the GPU.

Each candidate the tuner may pick (``variants.candidates``) is launched directly, forward and
backward, and checked against the fp32 reference with flash-attn's rules (2x for outputs, 3x
for gradients), so that the tuner's own check against the default variant is a second line,
not the only one. The end-to-end test tunes into a temporary cache and reads it back.
"""

import pytest
import torch

import flash_tile
from conftest import VARIANTS_CAPABILITY
from flash_tile import _launch, autotune, variants
from flash_tile.reference import attention_dense, check_error, kv_tile_runs

pytestmark = pytest.mark.gpu

# (head dim, candidate) for the head dims the variants are bucketed by.
CASES = [(d, c) for d in (64, 128, 256)
         for c in variants.candidates(VARIANTS_CAPABILITY, d)]
BACKWARD_CASES = [(d, c) for d in (64, 128, 256)
                  for c in variants.candidates(VARIANTS_CAPABILITY, d, backward=True)]


# The score-feature test's keys and two-sided window: long and wide enough that every
# registered tile shape has a query tile with all three runs (tests/test_autotune.py checks).
FEATURE_K_LEN, FEATURE_WINDOW = 700, (400, 50)


def _ids(cases):
    return [f"d{d}-{autotune.describe(c).replace(' ', '-')}" for d, c in cases]


def _inputs(head_dim, requires_grad=False, k_len=333):
    # GQA 2, Lq != Lk, ragged lengths, bottom-right causal: every masked path of the kernels.
    shapes = [(2, 4, 203, head_dim), (2, 2, k_len, head_dim), (2, 2, k_len, head_dim)]
    return [torch.randn(*s, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)
            for s in shapes]


@pytest.mark.parametrize("offset", [333 - 203, 0], ids=["bottom-right", "top-left"])
@pytest.mark.parametrize("head_dim,config", CASES, ids=_ids(CASES))
def test_every_forward_variant(head_dim, config, offset):
    """Causal aligned as flash-attn does (every row sees the first keys, so the first key
    tiles are unmasked) and as torch does (the first query tile's first key tile is its
    diagonal: masked, while its rows' running max is still -inf)."""
    q, k, v = _inputs(head_dim)
    out = torch.full((2, 4, 203, head_dim), torch.nan, device="cuda", dtype=q.dtype)
    window, scale = (-1, 0), head_dim ** -0.5
    _launch.launch_forward(q, k, v, out, None, None, None, scale, 0.0, offset, window, config)
    ref = attention_dense(q.float(), k.float(), v.float(), scale, offset, window)
    low = attention_dense(q, k, v, scale, offset, window)
    report = check_error(out, ref, low)
    assert report["ok"], report


@pytest.mark.parametrize("mask_kind", ["additive", "bool"])
@pytest.mark.parametrize("head_dim,config", CASES, ids=_ids(CASES))
def test_every_forward_variant_under_every_score_feature(head_dim, config, mask_kind):
    """The tuner may pick any candidate for a class with features: a two-sided window wide
    enough that some query tile has all three runs of key tiles (masked, unmasked, masked),
    with softcap, ALiBi and an attention mask on the scores."""
    q, k, v = _inputs(head_dim, k_len=FEATURE_K_LEN)
    offset, window = FEATURE_K_LEN - 203, FEATURE_WINDOW
    scale, softcap = head_dim ** -0.5, 20.0
    runs = [kv_tile_runs(m, config.tile_m, config.tile_n, FEATURE_K_LEN, offset, window)
            for m in range(0, 203, config.tile_m)]
    assert any(a < b < c < d for a, b, c, d in runs), runs
    slopes = torch.rand(2, 4, device="cuda") * 0.1
    if mask_kind == "bool":
        mask = torch.rand(2, 4, 203, FEATURE_K_LEN, device="cuda") > 0.2
    else:
        mask = torch.randn(2, 4, 203, FEATURE_K_LEN, device="cuda").to(q.dtype)
    out = torch.full((2, 4, 203, head_dim), torch.nan, device="cuda", dtype=q.dtype)
    _launch.launch_forward(q, k, v, out, None, slopes, mask, scale, softcap, offset, window,
                           config)
    ref_mask = mask if mask_kind == "bool" else mask.float()
    ref = attention_dense(q.float(), k.float(), v.float(), scale, offset, window, softcap,
                          slopes, ref_mask)
    low = attention_dense(q, k, v, scale, offset, window, softcap, slopes, mask)
    report = check_error(out, ref, low)
    assert report["ok"], report


def _check_backward(head_dim, config, features, k_len=333):
    """dQ, dK, dV of ``config`` launched directly against the fp32 reference under the 3x rule:
    GQA 2, 203 queries against ``k_len`` keys, bottom-right causal; with ``features`` a
    two-sided window, softcap, ALiBi, a head-broadcast boolean mask and dropout instead."""
    q, k, v = _inputs(head_dim, requires_grad=True, k_len=k_len)
    offset, scale = k_len - 203, head_dim ** -0.5
    window, softcap, slopes, mask, drop = (-1, 0), 0.0, None, None, _launch.NO_DROPOUT
    if features:
        window, softcap, drop = (200, 150), 20.0, _launch.Dropout(0.2, 4321)
        slopes = torch.rand(2, 4, device="cuda") * 0.1
        mask = (torch.rand(2, 1, 203, k_len, device="cuda") > 0.2).expand(2, 4, 203, k_len)
    dout = torch.randn(2, 4, 203, head_dim, device="cuda", dtype=q.dtype)

    def dense(*qkv, **kw):
        return attention_dense(*qkv, scale, offset, window, softcap, slopes, mask,
                               dropout_p=drop.p, dropout_seed=drop.seed, **kw)

    out, lse = dense(q.float(), k.float(), v.float(), return_lse=True)
    grads = [torch.full_like(t, torch.nan) for t in (q, k, v)]
    _launch.launch_backward(dout, q.detach(), k.detach(), v.detach(), out.to(q.dtype).detach(),
                            lse.detach(), *grads, None, slopes, mask, scale, softcap, offset,
                            window, config, drop)

    def autograd(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        dense(*leaves).backward(dout.to(dtype))
        return [t.grad for t in leaves]

    for name, g, r, p in zip(("dq", "dk", "dv"), grads, autograd(torch.float32),
                             autograd(q.dtype)):
        report = check_error(g, r, p, 3)
        assert report["ok"], f"{name}: {report}"


@pytest.mark.parametrize("head_dim,config", BACKWARD_CASES, ids=_ids(BACKWARD_CASES))
def test_every_backward_variant(head_dim, config):
    _check_backward(head_dim, config, features=False)


@pytest.mark.parametrize("head_dim,config", BACKWARD_CASES, ids=_ids(BACKWARD_CASES))
def test_every_backward_variant_under_every_feature(head_dim, config):
    """Under a window with softcap, ALiBi, a mask and dropout, with 320 keys: a whole number of
    64-key tiles and not of 128-key ones, so a variant whose dQ kernel steps 64 keys where its
    dK/dV kernel owns 128 (sm_90's SM90_BACKWARD) runs dQ without the ragged-end masks and
    dK/dV with them."""
    _check_backward(head_dim, config, True, k_len=320)


def test_autotune_tunes_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(autotune.ENV_SWITCH, "1")
    monkeypatch.setenv(autotune.ENV_CACHE_DIR, str(tmp_path))
    autotune.clear_memory_cache()
    q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)

    def run():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = flash_tile.flash_attn_func(qq, kk, vv, causal=True)
        out.backward(dout)
        return out.detach(), qq.grad, kk.grad, vv.grad

    first = run()
    [path] = tmp_path.glob("autotune-*.json")
    entries = autotune.Cache(path).entries
    assert {key.split("|")[0] for key in entries} == {"fwd", "bwd"}
    for entry in entries.values():
        assert len(entry["results"]) > 1  # more than the default was timed

    # A new process reads the winners back and launches them without timing anything.
    autotune.clear_memory_cache()
    monkeypatch.setattr(autotune, "tune", lambda *a, **k: pytest.fail("tuned twice"))
    second = run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)  # the same variant, deterministic
    ref = attention_dense(*(t.detach().float().transpose(1, 2) for t in (q, k, v)), None,
                          0, (-1, 0)).transpose(1, 2)
    low = attention_dense(*(t.detach().transpose(1, 2) for t in (q, k, v)), None, 0,
                          (-1, 0)).transpose(1, 2)
    assert check_error(second[0], ref, low)["ok"]


def test_flash_tile_tune_fills_the_cache(tmp_path, monkeypatch, capsys):
    from flash_tile.cli import main

    monkeypatch.setenv(autotune.ENV_SWITCH, "1")
    monkeypatch.setenv(autotune.ENV_CACHE_DIR, str(tmp_path))
    autotune.clear_memory_cache()
    assert main(["tune", "--dtypes", "bf16", "--head-dims", "64", "--lengths", "256",
                 "--causal", "yes", "--backward", "--tokens", "512"]) == 0
    captured = capsys.readouterr()
    # The progress bar (tqdm, on stderr) names the shape it tuned.
    assert "flash-tile tune" in captured.err and "1/1" in captured.err
    assert "bf16 D=64 L=256 causal=True (B=2, H=32)" in captured.err
    out = captured.out
    assert "fwd|" in out and "bwd|" in out  # both winners listed from the cache file
