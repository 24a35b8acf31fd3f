"""Tiny random Transformers models and batches for the integration's tests
(tests/test_transformers.py on the CPU, tests/test_gpu_transformers.py on a GPU); the callers
import transformers first (``pytest.importorskip``)."""

import torch
import transformers


def model(kind, attn_implementation, device="cpu", dtype=torch.float32):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
    elif kind == "gpt_oss":  # sinks; a banded and a full layer, as gpt-oss alternates them
        config = transformers.GptOssConfig(
            **common, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    else:
        config = transformers.MistralConfig(**common, sliding_window=8)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, dtype=dtype)
    return model.to(device).eval()


def batch(device="cpu"):
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0  # left padding in the second sequence
    return ids.to(device), mask.to(device)


def packing(device="cpu"):
    """Three sequences of token ids, their packed row and flash-attn's packed kwargs."""
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 128, (n,), generator=gen).to(device) for n in (7, 20, 13)]
    cu = torch.tensor([0, 7, 27, 40], dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(len(s), device=device) for s in seqs])
    kwargs = dict(position_ids=positions[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                  max_length_q=20, max_length_k=20)
    return seqs, torch.cat(seqs)[None], kwargs
