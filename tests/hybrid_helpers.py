"""Tiny random-init hybrid models from the real transformers config classes (no download).

Each entry builds a 2-4 layer, hidden-64 model; a class missing from the installed transformers is skipped by the
tests (``pytest.importorskip``-style, through :func:`hybrid_config`)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

VOCAB = 128
WINDOW = 8  # sliding window of the tiny sliding layers: shorter than the test sequences
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=2)

# name -> (config class, its extra arguments, KVpopCache's sliding_layers for the default test cache)
HYBRIDS = {
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=2, attn_logit_softcapping=1.0, final_logit_softcapping=30.0,
                                    sliding_window=WINDOW, query_pre_attn_scalar=32), "window"),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention"] * 3 + ["full_attention"]), "window"),
    "gpt_oss": ("GptOssConfig", dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=WINDOW), "window"),
    # Mistral's default config: every layer slides (window 4096), so KVpop goes on the sliding layers
    "mistral": ("MistralConfig", dict(num_hidden_layers=2), "kvpop"),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW,
                                  max_window_layers=1), "window"),
    "qwen3_next": ("Qwen3NextConfig", dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                           linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                           linear_value_head_dim=16), "window"),
    "qwen3_5": ("Qwen3_5TextConfig", dict(num_hidden_layers=4, linear_num_value_heads=4, linear_num_key_heads=2,
                                         linear_key_head_dim=16, linear_value_head_dim=16), "window"),
    "olmo3": ("Olmo3Config", dict(num_hidden_layers=4, sliding_window=WINDOW), "window"),
}


def hybrid_config(name: str, **overrides):
    cls_name, extra, _ = HYBRIDS[name]
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"the installed transformers has no {cls_name}")
    kwargs = {**COMMON, **extra, **overrides}
    return cls(**kwargs)


def hybrid_model(name: str, attn: str = "kvpop", seed: int = 0, **overrides):
    """A random-init model; norm weights and GPT-OSS sinks are randomised (distinct key norms, sinks that matter)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hybrid_config(name, **overrides), attn_implementation=attn)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(0.5 + torch.rand_like(p))
            elif pname.endswith(".sinks"):
                p.copy_(2 * torch.randn_like(p))
    return model.eval()


def sliding_choice(name: str) -> str:
    return HYBRIDS[name][2]
