"""attn_implementation="flash_tile" (and "cutile") in Hugging Face Transformers on a GPU: the
real kernels against attn_implementation="sdpa" (and gpt-oss against "eager"). The CPU side
is tests/test_transformers.py."""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import flash_tile.integrations.transformers as flash_tile_hf  # noqa: E402
from flash_tile import reference  # noqa: E402
from hf_tiny import batch as _batch, model as _model, packing as _packing  # noqa: E402

NAMES = flash_tile_hf.NAMES


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_logits_and_greedy_generation_on_gpu(kind, name):
    ids, mask = _batch("cuda")
    with torch.no_grad():
        ours_model = _model(kind, name, "cuda", torch.bfloat16)
        ref_model = _model(kind, "sdpa", "cuda", torch.bfloat16)
        ours = ours_model(input_ids=ids, attention_mask=mask).logits
        ref = ref_model(input_ids=ids, attention_mask=mask).logits
        exact = _model(kind, "sdpa", "cuda", torch.float32)(input_ids=ids,
                                                            attention_mask=mask).logits
        valid = mask.bool()  # flash-attn's rule: 2x torch's own bf16 error, plus rounding
        report = reference.check_error(ours[valid], exact[valid], ref[valid])
        assert report["ok"], report
        gen_ours = ours_model.generate(ids[:1], max_new_tokens=8, do_sample=False)
        gen_ref = ref_model.generate(ids[:1], max_new_tokens=8, do_sample=False)
    assert torch.equal(gen_ours, gen_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_static_cache_generation_under_torch_compile_on_gpu(kind):
    """generate with a static cache, each model's forward compiled (fullgraph=True, so a
    graph break fails): greedy output equals "sdpa" compiled the same way (Llama with GQA,
    Mistral past its sliding window of 8). That such steps reach the KV-cache op with their
    masks is test_masked_decode_steps_reach_the_kvcache_kernel_on_cpu's and
    tests/test_decode.py::test_kvcache_traces_into_one_graph's."""
    ids, _ = _batch("cuda")
    config = dict(max_new_tokens=8, do_sample=False, cache_implementation="static")
    out = {}
    with torch.no_grad():
        for name in ("sdpa", "flash_tile"):
            torch.compiler.reset()
            model = _model(kind, name, "cuda", torch.bfloat16)
            model.forward = torch.compile(model.forward, fullgraph=True)
            out[name] = model.generate(ids[:1], **config)
    assert torch.equal(out["flash_tile"], out["sdpa"])


@pytest.mark.gpu
@pytest.mark.parametrize("packing", ["cu_seq_lens", "position_ids"])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_packed_training_step_matches_sequences_one_by_one_on_gpu(kind, packing):
    """Padding-free training: the packed row through the varlen kernel gives the loss and the
    parameter gradients of the sequences run one by one, within bf16 rounding (the error
    against fp32 SDPA at most 2x that of bf16 SDPA, plus a floor); the packing given as
    cu_seq_lens, or as restarting position ids alone (the collator's default)."""
    seqs, packed, kwargs = _packing("cuda")
    if packing == "position_ids":
        kwargs = dict(position_ids=kwargs["position_ids"])
    weights = torch.randn(packed.shape[1], 128, device="cuda",
                          generator=torch.Generator(device="cuda").manual_seed(6))

    def step(name, dtype, packed_call):
        model = _model(kind, name, "cuda", dtype).train()
        if packed_call:
            logits = model(input_ids=packed, **kwargs).logits[0]
        else:
            logits = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])
        loss = (logits.float() * weights).sum() / weights.numel()
        loss.backward()
        return [loss.detach()] + [p.grad.float() for p in model.parameters()]

    ours = step("flash_tile", torch.bfloat16, True)
    low = step("sdpa", torch.bfloat16, False)
    exact = step("sdpa", torch.float32, False)
    for i, (o, lo, ex) in enumerate(zip(ours, low, exact)):
        err, err_torch = (o - ex).abs().max().item(), (lo - ex).abs().max().item()
        assert err <= 2 * err_torch + 1e-3 * ex.abs().max().item() + 1e-6, (i, err, err_torch)


@pytest.mark.gpu
def test_gpt_oss_training_and_generation_on_gpu():
    """A tiny gpt-oss in bf16 with attn_implementation="flash_tile" against "eager": logits,
    loss and every parameter's gradient (the sinks' included) within 2x of eager bf16's error
    against eager fp32 (plus a floor); greedy generation equal."""
    ids, _ = _batch("cuda")
    weights = torch.randn(*ids.shape, 128, device="cuda",
                          generator=torch.Generator(device="cuda").manual_seed(8))

    def step(implementation, dtype):
        model = _model("gpt_oss", implementation, "cuda", dtype).train()
        logits = model(input_ids=ids).logits.float()
        loss = (logits * weights).sum() / weights.numel()
        loss.backward()
        return model, [logits.detach(), loss.detach()] + [p.grad.float() for p in
                                                          model.parameters()]

    ours_model, ours = step("cutile", torch.bfloat16)  # gpt-oss swaps "flash*" names
    ref_model, low = step("eager", torch.bfloat16)
    _, exact = step("eager", torch.float32)
    sinks = [i for i, (n, _) in enumerate(ours_model.named_parameters()) if "sinks" in n]
    assert sinks and all(ours[2 + i].abs().max() > 0 for i in sinks)
    for i, (o, lo, ex) in enumerate(zip(ours, low, exact)):
        err, err_eager = (o - ex).abs().max().item(), (lo - ex).abs().max().item()
        assert err <= 2 * err_eager + 1e-3 * ex.abs().max().item() + 1e-6, (i, err, err_eager)
    with torch.no_grad():
        gen_ours = ours_model.eval().generate(ids[:1], max_new_tokens=8, do_sample=False)
        gen_ref = ref_model.eval().generate(ids[:1], max_new_tokens=8, do_sample=False)
    assert torch.equal(gen_ours, gen_ref)
