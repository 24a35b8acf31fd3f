"""attn_implementation="flash_tile" (and "cutile") in Hugging Face Transformers.

On the CPU, flash_tile's public functions are swapped for torch's SDPA (the kernels need a GPU),
which checks the registration and everything the integration maps: masks (causal, padding,
sliding window), GQA, scaling, the output layout. On a GPU the real kernels run against
attn_implementation="sdpa" (tests/test_gpu_transformers.py). (Why two names:
flash_tile/integrations/transformers.py.)
"""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import flash_tile  # noqa: E402
import flash_tile.integrations.transformers as flash_tile_hf  # noqa: E402
from flash_tile import reference  # noqa: E402
from hf_tiny import batch as _batch, model as _model, packing as _packing  # noqa: E402

NAMES = flash_tile_hf.NAMES


def _torch_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=scale, enable_gqa=enable_gqa)


@pytest.mark.parametrize("name", NAMES)
def test_registered(name):
    from transformers.masking_utils import AttentionMaskInterface

    assert name in transformers.AttentionInterface()
    assert name in AttentionMaskInterface()
    assert f"not-{name}" not in transformers.AttentionInterface()


def test_the_preload_skip_passes_every_other_call_through():
    calls = []

    def loader(implementation, *args, **kwargs):
        calls.append((implementation, args, kwargs))
        return "loaded"

    wrapper = flash_tile_hf.skip_preload_for_flash_tile(loader)
    assert wrapper("flash_tile") is None and wrapper("cutile") is None and not calls
    assert wrapper("flash_attention_2", None, allow_all_kernels=True) == "loaded"
    assert calls == [("flash_attention_2", (None,), {"allow_all_kernels": True})]
    assert flash_tile_hf.skip_preload_for_flash_tile(wrapper) is wrapper  # not wrapped twice


def test_loading_by_name_needs_no_flash_attn(monkeypatch):
    """Through transformers' public API only: loading a model under flash_tile's names, and
    switching to them, must not ask for flash-attn (not installed here), whatever this
    transformers' loader does; the forward then runs flash_tile's function, and after a
    switch to "sdpa" it does not."""
    calls = []

    def recording_sdpa(*args, **kwargs):
        calls.append(1)
        return _torch_sdpa(*args, **kwargs)

    monkeypatch.setattr(flash_tile, "scaled_dot_product_attention", recording_sdpa)
    ids, mask = _batch()
    mask[0, 12] = 0  # a mask with a hole: the masked path, one call a layer
    for name in NAMES:
        model = _model("llama", name)
        for implementation, layers in ((name, 2), ("sdpa", 0), (name, 2)):
            model.set_attn_implementation(implementation)
            calls.clear()
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask)
            assert len(calls) == layers, implementation


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_mapping_matches_sdpa_on_cpu(kind, name, monkeypatch):
    calls = []

    def recording_sdpa(*args, **kwargs):
        calls.append(kwargs)
        return _torch_sdpa(*args, **kwargs)

    monkeypatch.setattr(flash_tile, "scaled_dot_product_attention", recording_sdpa)
    ids, mask = _batch()
    mask[0, 12] = 0  # a hole: no longer one run of tokens a row, so not run as packed
    with torch.no_grad():
        ours = _model(kind, name)(input_ids=ids, attention_mask=mask).logits
        ref = _model(kind, "sdpa")(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert calls and all(c["enable_gqa"] for c in calls)  # GQA runs in the kernel
    assert all(c["attn_mask"] is not None and c["attn_mask"].dtype == torch.bool for c in calls)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_padded_batches_run_as_packed_sequences_on_cpu(kind, side, monkeypatch, varlen_calls):
    """A left- or right-padded batch (a mask of causal attention over each row's tokens, and
    Mistral's window) runs flash_attn_varlen_func on the rows' tokens: their logits are
    transformers' SDPA's; the padding's positions are not compared (flash-attn's path leaves
    them 0, SDPA's whatever its mask gives)."""
    calls = varlen_calls
    monkeypatch.setattr(flash_tile, "scaled_dot_product_attention",
                        lambda *a, **k: pytest.fail("the masked path ran"))
    ids, mask = _batch()
    if side == "right":
        mask = mask.flip(1)
    with torch.no_grad():
        ours = _model(kind, "flash_tile")(input_ids=ids, attention_mask=mask).logits
        ref = _model(kind, "sdpa")(input_ids=ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(ours[valid], ref[valid], rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 and all(c[3].tolist() == [0, 20, 35] for c in calls)


def _torch_kvcache(q, k_cache, v_cache, cache_seqlens, softmax_scale=None, softcap=0.0,
                   sinks=None, attn_mask=None):
    """flash_attn_with_kvcache for one query row against whole caches, by the reference."""
    assert q.shape[1] == 1 and cache_seqlens == k_cache.shape[1] and softcap == 0.0
    out = reference.attention_dense(*(t.transpose(1, 2) for t in (q, k_cache, v_cache)),
                                    softmax_scale, attn_mask=attn_mask, sinks=sinks)
    return out.transpose(1, 2)


def _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None,
                  causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                  deterministic=False, sinks=None):
    """flash_attn_varlen_func by the float64 reference, one sequence at a time."""
    assert dropout_p == 0.0 and softcap == 0.0 and cu_q.dtype == cu_k.dtype == torch.int32
    assert alibi_slopes is None
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] -
                                                                        cu_k[:-1]).max())
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    window = (window_size[0], 0) if causal else window_size
    for b, rows, seq, diag in reference.varlen_sequences(q, k, v, cu_q, cu_k):
        o = reference.attention_dense(*seq, softmax_scale, diag, window, sinks=sinks)
        out[rows] = o[0].transpose(0, 1)
    return out


@pytest.fixture
def varlen_calls(monkeypatch):
    """The args of each flash_attn_varlen_func call, which the reference (``_torch_varlen``)
    answers; the SDPA drop-in is torch's. Llama and Mistral pass no sinks."""
    calls = []

    def recording_varlen(*args, sinks):
        assert sinks is None
        calls.append(args)
        return _torch_varlen(*args)

    monkeypatch.setattr(flash_tile, "scaled_dot_product_attention", _torch_sdpa)
    monkeypatch.setattr(flash_tile, "flash_attn_varlen_func", recording_varlen)
    return calls


def _torch_sdpa_with_sinks(query, key, value, attn_mask, dropout_p, is_causal, scale,
                           enable_gqa, sinks, deterministic=False):  # noqa: ARG001 - the
    # reference does GQA itself, and has one form
    """flash_tile.api._sdpa by the reference: a sink column in the softmax."""
    assert dropout_p == 0.0 and sinks.dtype == torch.float32
    window = (-1, 0) if is_causal else (-1, -1)
    return reference.attention_dense(query, key, value, scale, 0, window, attn_mask=attn_mask,
                                     sinks=sinks)


def test_gpt_oss_sinks_reach_the_kernels_on_cpu(monkeypatch):
    """gpt-oss passes its sinks as s_aux: they reach flash_tile as fp32 sinks on every layer
    and step (prompt and decode), and logits and greedy generation equal "eager"'s. (gpt-oss
    lists its own flash kernels, which replace any "flash*" name: it takes "cutile".)"""
    name = "cutile"
    calls, decode_calls = [], []

    def recording(query, key, value, sinks, **kwargs):
        calls.append(sinks)
        return _torch_sdpa_with_sinks(query, key, value, sinks=sinks, **kwargs)

    def recording_kvcache(*args, **kwargs):
        decode_calls.append(kwargs["sinks"])
        return _torch_kvcache(*args, **kwargs)

    monkeypatch.setattr(flash_tile.api, "_sdpa", recording)
    monkeypatch.setattr(flash_tile, "flash_attn_with_kvcache", recording_kvcache)
    ids, _ = _batch()
    ours_model, ref_model = _model("gpt_oss", name), _model("gpt_oss", "eager")
    with torch.no_grad():
        ours = ours_model(input_ids=ids).logits
        ref = ref_model(input_ids=ids).logits
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        assert len(calls) == 2 and all(c.dtype == torch.float32 for c in calls)
        gen_ours = ours_model.generate(ids[:1], max_new_tokens=5, do_sample=False)
        gen_ref = ref_model.generate(ids[:1], max_new_tokens=5, do_sample=False)
    assert torch.equal(gen_ours, gen_ref)
    # Every layer of the prompt and of each decode step carried the sinks (gpt-oss passes a
    # mask each step, so the steps take the SDPA body; a maskless step would take the KV-cache
    # kernel, which has them too).
    assert len(calls) + len(decode_calls) == 2 + 2 * 5
    assert all(c is not None and c.dtype == torch.float32 for c in calls + decode_calls)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_packed_sequences_reach_the_varlen_kernel_on_cpu(kind, name, varlen_calls):
    """A packed row with cu_seq_lens (as DataCollatorWithFlattening gives it) runs
    flash_attn_varlen_func and gives each sequence's logits as when run alone, sliding window
    included (Mistral's window of 8 is shorter than the sequences)."""
    calls = varlen_calls
    seqs, packed, kwargs = _packing()
    model = _model(kind, name)
    with torch.no_grad():
        ours = model(input_ids=packed, **kwargs).logits[0]
        alone = [model(input_ids=s[None]).logits[0] for s in seqs]
    torch.testing.assert_close(ours, torch.cat(alone), rtol=1e-5, atol=1e-5)
    assert len(calls) == 2  # one call a layer
    # transformers' flash-attn path passes (w - 1, w - 1); causal makes the right side 0
    assert all(c[9] and c[10] == ((7, 7) if kind == "mistral" else (-1, -1)) for c in calls)


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_packed_position_ids_reach_the_varlen_kernel_on_cpu(kind, use_cache, varlen_calls):
    """DataCollatorWithFlattening's default: one row whose position ids restart, no
    cu_seq_lens. Without a cache transformers builds the block-diagonal mask (checked, then
    the varlen call); with one it builds none, and the position ids alone must keep the
    sequences apart. Either way each sequence's logits are as when run alone."""
    calls = varlen_calls
    seqs, packed, kwargs = _packing()
    model = _model(kind, "flash_tile")
    with torch.no_grad():
        ours = model(input_ids=packed, position_ids=kwargs["position_ids"],
                     use_cache=use_cache).logits[0]
        alone = [model(input_ids=s[None]).logits[0] for s in seqs]
    torch.testing.assert_close(ours, torch.cat(alone), rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 and all(c[3].tolist() == [0, 7, 27, 40] and c[5] == 20
                                   for c in calls)


def test_inference_mode_packed_and_padded(varlen_calls):
    """Under torch.inference_mode (pipelines, generate), whose tensors keep no version counter:
    a plain batch-1 call, packed position ids and a padded batch all run (the checks' answers
    are then recomputed each layer instead of remembered), the packed and padded ones on the
    varlen kernel."""
    calls = varlen_calls
    seqs, packed, kwargs = _packing()
    ids, mask = _batch()
    model = _model("llama", "flash_tile")
    with torch.inference_mode():
        model(input_ids=ids[:1])
        assert not calls
        ours = model(input_ids=packed, position_ids=kwargs["position_ids"]).logits[0]
        alone = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])
        model(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(ours, alone, rtol=1e-5, atol=1e-5)
    assert len(calls) == 4  # two layers, packed then padded


def test_a_mask_beside_a_packing_is_checked(monkeypatch):
    """cu_seq_lens with a mask that hides keys within their sequences (padding) raise; packed
    position ids beside such a mask leave the call to the masked path."""
    monkeypatch.setattr(flash_tile, "scaled_dot_product_attention", _torch_sdpa)
    monkeypatch.setattr(flash_tile, "flash_attn_varlen_func",
                        lambda *a, sinks: pytest.fail("the varlen kernel ran"))
    q = torch.randn(1, 4, 10, 16)
    causal = torch.ones(10, 10, dtype=torch.bool).tril()[None, None]
    causal[..., 2] = False  # key 2 padded
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="hides keys"):
        flash_tile_hf.attention_forward(torch.nn.Module(), q, q, q, causal, cu_seq_lens_q=cu,
                                        cu_seq_lens_k=cu, max_length_q=6, max_length_k=6)
    positions = torch.cat([torch.arange(4), torch.arange(6)])[None]
    out, _ = flash_tile_hf.attention_forward(torch.nn.Module(), q, q, q, causal,
                                             position_ids=positions)
    torch.testing.assert_close(out, _torch_sdpa(q, q, q, attn_mask=causal).transpose(1, 2))


@pytest.mark.parametrize("name", NAMES)
def test_set_attn_implementation_and_generate_on_cpu(name, monkeypatch):
    decode_calls = []

    def recording_kvcache(*args, **kwargs):
        decode_calls.append(kwargs["cache_seqlens"])
        return _torch_kvcache(*args, **kwargs)

    monkeypatch.setattr(flash_tile, "scaled_dot_product_attention", _torch_sdpa)
    monkeypatch.setattr(flash_tile, "flash_attn_with_kvcache", recording_kvcache)
    model = _model("llama", "sdpa", dtype=torch.bfloat16)  # the decode kernel's dtypes
    ids, _ = _batch()
    with torch.no_grad():
        ref = model.generate(ids[:1], max_new_tokens=5, do_sample=False)
        model.set_attn_implementation(name)
        ours = model.generate(ids[:1], max_new_tokens=5, do_sample=False)
    assert torch.equal(ours, ref)
    # The four steps after the prompt's decode through the KV-cache kernel, both layers each,
    # against caches one key longer every step.
    assert decode_calls == [n for n in range(21, 25) for _ in range(2)]


@pytest.mark.usefixtures("varlen_calls")  # the left-padded prompt runs as packed sequences
@pytest.mark.parametrize("cache", ["static", "left_padded"])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_masked_decode_steps_reach_the_kvcache_kernel_on_cpu(kind, cache, monkeypatch):
    """Decode steps with a mask (a static cache's unwritten slots, a left-padded batch's pad,
    Mistral's window once the cache outgrows it) run the KV-cache kernel with that mask, not
    the masked forward; greedy output equals "sdpa"."""
    masks = []

    def recording_kvcache(*args, **kwargs):
        masks.append(kwargs["attn_mask"])
        return _torch_kvcache(*args, **kwargs)

    monkeypatch.setattr(flash_tile, "flash_attn_with_kvcache", recording_kvcache)
    ids, pad = _batch()
    kwargs = dict(max_new_tokens=6, do_sample=False)
    if cache == "static":
        ids, pad = ids[:1], pad[:1]
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        ref = _model(kind, "sdpa", dtype=torch.bfloat16).generate(ids, attention_mask=pad,
                                                                  **kwargs)
        ours = _model(kind, "flash_tile", dtype=torch.bfloat16).generate(
            ids, attention_mask=pad, **kwargs)
    assert torch.equal(ours, ref)
    assert len(masks) == 2 * 5  # five steps after the prompt's, two layers each
    seen = [m for m in masks if m is not None]
    assert seen and all(m.dtype == torch.bool and m.shape[1:3] == (1, 1) for m in seen)
    if kind == "llama":  # Mistral's caches keep one window, which the 20-token prompt fills
        assert any(not bool(m.all()) for m in seen)


def test_a_non_causal_sliding_window_sees_both_sides(varlen_calls):
    """A bidirectional model's sliding window (ModernBERT's local layers) as transformers'
    flash-attn path runs it: key j within w - 1 rows of query i on either side, in its
    sequence; the symmetric mask transformers builds beside the packing passes the check."""
    calls = varlen_calls
    q, k, v = (torch.randn(1, 4, 12, 16, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    seq = torch.tensor([0] * 5 + [1] * 7)
    rows = torch.arange(12)
    allowed = (seq[:, None] == seq[None, :]) & ((rows[:, None] - rows[None, :]).abs() < 3)
    packed = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7,
                  sliding_window=3)
    for mask in (None, allowed[None, None]):
        out, _ = flash_tile_hf.attention_forward(torch.nn.Module(), q, k, v, mask,
                                                 is_causal=False, **packed)
        ref = _torch_sdpa(q, k, v, attn_mask=allowed[None, None]).transpose(1, 2)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert len(calls) == 2 and all(not c[9] and c[10] == (2, 2) for c in calls)


@pytest.mark.parametrize("is_causal,q_len", [(False, 3), (True, 5), (True, 1)])
def test_a_2d_mask_is_a_key_padding_mask(monkeypatch, varlen_calls, is_causal, q_len):
    """flash-attn's [B, Lk] padding mask, as models that branch on "flash" in the name pass
    it (gpt_bigcode's cross-attention), hides the padded keys (and, causal, the later ones,
    bottom-right); read as an SDPA mask it would broadcast as [Lq, Lk] (here B = 3 rows).
    Rows that see no key (a padded query's) are not compared: the packed path leaves them
    0, as flash-attn's."""
    monkeypatch.setattr(flash_tile, "flash_attn_with_kvcache", _torch_kvcache)
    q = torch.randn(3, 4, q_len, 16, dtype=torch.float64)
    k, v = (torch.randn(3, 2, 5, 16, dtype=torch.float64) for _ in range(2))
    pad = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    out, _ = flash_tile_hf.attention_forward(torch.nn.Module(), q, k, v, pad,
                                             is_causal=is_causal)
    allowed = pad.bool()[:, None, None, :].expand(3, 1, q_len, 5)
    if is_causal:
        allowed = allowed & torch.ones(q_len, 5, dtype=torch.bool).tril(5 - q_len)
    want = _torch_sdpa(q, k, v, attn_mask=allowed, enable_gqa=True).transpose(1, 2)
    seen = allowed[:, 0].any(-1)  # [B, Lq]
    torch.testing.assert_close(out[seen], want[seen], rtol=1e-12, atol=1e-12)
    assert len(varlen_calls) == (1 if is_causal and q_len > 1 else 0)  # the padded batch


def test_a_step_that_needs_gradients_does_not_take_the_decode_kernel(monkeypatch):
    """One query row whose inputs need gradients (training with a batch of one-token rows, or
    sinks that learn) takes the differentiable path: the decode kernel has no backward. The
    same step under no_grad runs the decode kernel."""
    decode_calls = []

    def recording_kvcache(*args, **kwargs):
        decode_calls.append(kwargs)
        return _torch_kvcache(*args, **kwargs)

    monkeypatch.setattr(flash_tile, "scaled_dot_product_attention", _torch_sdpa)
    monkeypatch.setattr(flash_tile, "flash_attn_with_kvcache", recording_kvcache)
    q = torch.randn(2, 4, 1, 16, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 9, 16, dtype=torch.bfloat16) for _ in range(2))
    out, _ = flash_tile_hf.attention_forward(torch.nn.Module(), q, k, v, None, is_causal=True)
    out.float().sum().backward()
    assert not decode_calls and q.grad is not None and bool(q.grad.abs().sum() > 0)
    with torch.no_grad():
        flash_tile_hf.attention_forward(torch.nn.Module(), q, k, v, None, is_causal=True)
    assert len(decode_calls) == 1


@pytest.mark.parametrize("keyword,env,expected", [(None, None, False), (True, None, True),
                                                  (None, "1", True), (False, "1", False)])
def test_deterministic_as_transformers_asks_for_it(monkeypatch, varlen_calls, keyword, env,
                                                   expected):
    """The model's ``deterministic`` keyword, or FLASH_ATTENTION_DETERMINISTIC=1 where it
    passes none (transformers' flash-attn path), reaches the packed and the masked paths."""
    sdpa_calls = []

    def recording_sdpa(query, key, value, sinks, deterministic, **kwargs):
        sdpa_calls.append(deterministic)
        return _torch_sdpa(query, key, value, **kwargs)

    if env is None:
        monkeypatch.delenv("FLASH_ATTENTION_DETERMINISTIC", raising=False)
    else:
        monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", env)
    monkeypatch.setattr(flash_tile.api, "_sdpa", recording_sdpa)
    q = torch.randn(1, 4, 10, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    extra = {} if keyword is None else {"deterministic": keyword}
    flash_tile_hf.attention_forward(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=cu,
                                    cu_seq_lens_k=cu, max_length_q=6, max_length_k=6, **extra)
    mask = torch.rand(1, 1, 10, 10) > 0.3
    flash_tile_hf.attention_forward(torch.nn.Module(), q, q, q, mask, **extra)
    assert [c[13] for c in varlen_calls] == [expected]
    assert sdpa_calls == ([True] if expected else [])  # else flash_tile's public SDPA


def test_unsupported_requests_raise():
    q = torch.zeros(1, 4, 3, 16)
    with pytest.raises(NotImplementedError, match="output_attentions"):
        flash_tile_hf.attention_forward(torch.nn.Module(), q, q, q, None, output_attentions=True)
    with pytest.raises(NotImplementedError, match="position biases"):
        flash_tile_hf.attention_forward(torch.nn.Module(), q, q, q, None, position_bias=q)
    with pytest.raises(NotImplementedError, match="block_table"):
        flash_tile_hf.attention_forward(torch.nn.Module(), q, q, q, None,
                                        block_table=torch.zeros(1, 2, dtype=torch.int32),
                                        k_cache=q, v_cache=q)
    with pytest.raises(ValueError, match="max_length_q"):
        flash_tile_hf.attention_forward(torch.nn.Module(), q, q, q, None,
                                        cu_seq_lens_q=torch.tensor([0, 3]),
                                        cu_seq_lens_k=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="batch 1"):
        flash_tile_hf.attention_forward(torch.nn.Module(), q.expand(2, -1, -1, -1), q, q, None,
                                        cu_seq_lens_q=torch.tensor([0, 3]),
                                        cu_seq_lens_k=torch.tensor([0, 3]), max_length_q=3,
                                        max_length_k=3)
    with pytest.raises(NotImplementedError, match="softcap together"):
        flash_tile_hf.attention_forward(torch.nn.Module(), q, q, q, torch.ones(1, 1, 3, 3) > 0,
                                        softcap=30.0)


def test_attention_dropout_is_passed_to_the_kernels(monkeypatch):
    calls = []

    def recording_sdpa(*args, **kwargs):
        calls.append(kwargs)
        return _torch_sdpa(*args, **{**kwargs, "dropout_p": 0.0})

    monkeypatch.setattr(flash_tile, "scaled_dot_product_attention", recording_sdpa)
    q = torch.randn(1, 4, 3, 16)
    flash_tile_hf.attention_forward(torch.nn.Module(), q, q, q, None, dropout=0.1)
    assert calls[0]["dropout_p"] == 0.1


def test_a_decode_step_in_float32_takes_the_sdpa_path(monkeypatch):
    """One query row with no mask takes the KV-cache kernel only in fp16/bf16 with one dtype
    throughout: fp32 (or mixed, under autocast) goes where torch's casting rules apply."""
    calls = []
    monkeypatch.setattr(flash_tile, "scaled_dot_product_attention",
                        lambda q, *a, **k: calls.append("sdpa") or torch.zeros_like(q))
    monkeypatch.setattr(flash_tile, "flash_attn_with_kvcache",
                        lambda *a, **k: calls.append("kvcache") or _torch_kvcache(*a, **k))
    q, kv = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 9, 16)
    flash_tile_hf.attention_forward(torch.nn.Module(), q, kv, kv, None)
    flash_tile_hf.attention_forward(torch.nn.Module(), q.bfloat16(), kv.bfloat16(),
                                    kv.bfloat16(), None)
    flash_tile_hf.attention_forward(torch.nn.Module(), q, kv.bfloat16(), kv.bfloat16(), None)
    assert calls == ["sdpa", "kvcache", "sdpa"]
