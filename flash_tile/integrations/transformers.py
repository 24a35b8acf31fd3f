"""flash_tile as a Hugging Face Transformers attention implementation.

    import flash_tile.integrations.transformers  # registers "cutile"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cutile")
    model.set_attn_implementation("cutile")  # or switch a loaded model

The name is "cutile", not "flash_tile": transformers 5 treats every implementation whose name
contains "flash" as a flash-attn kernel (``is_flash_attention_requested`` tests
``"flash" in name``) and tries to load it from the Hub with a varlen API, which fails offline
and is not this path.

Importing this module registers ``attention_forward`` with ``AttentionInterface`` and torch
SDPA's mask builder with ``AttentionMaskInterface`` under that name, so models
build the same boolean [B, 1, Lq, Lk] masks for it as for "sdpa" (causal, padding, sliding
window), which flash_tile reads in place. Calls map as transformers' own SDPA path does:
causal without a mask runs the kernel's causal switch (top-left, as torch), GQA runs in the
kernel (``enable_gqa``), ``scaling`` is the softmax scale; ``softcap`` runs through
``flash_attn_func`` when there is no mask. What cannot be honoured raises instead of being
ignored: attention weights (``output_attentions``), position biases, dropout while training,
softcap together with a mask.
"""

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import flash_tile

NAME = "cutile"


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
    q_len = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
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
                                         softcap=softcap)
        return out, None
    out = flash_tile.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal,
        scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2), None  # [B, Lq, H, Dv]: contiguous, as flash_tile lays it out


AttentionInterface.register(NAME, attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)
