"""A tiny random Qwen3 with a real byte-level BPE tokenizer and a ChatML chat template, built offline and saved as
a model folder (``AutoTokenizer`` / ``AutoModelForCausalLM`` load it like a Hub checkpoint)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen models render it (system/user/assistant turns, a generation prompt for the assistant)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer(chat_template: str | None = CHATML) -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges (every UTF-8 byte one token) plus the ChatML special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if chat_template:
        fast.chat_template = chat_template
    return fast


def save_chat_model(folder, seed: int = 0, chat_template: str | None = CHATML, layers: int = 2):
    """A tiny random Qwen3 and :func:`chat_tokenizer` saved in ``folder``; returns ``folder``."""
    tok = chat_tokenizer(chat_template)
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand_like(p))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def conversations(n: int, seed: int = 0):
    """``n`` short math-style conversations (system, user, assistant) of different lengths."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        steps = " ".join(f"step {j}: {a} + {j} = {a + j}." for j in range(rng.randrange(1, 6)))
        out.append([{"role": "system", "content": "Reason step by step."},
                    {"role": "user", "content": f"What is {a} + {b}?"},
                    {"role": "assistant", "content": f"<think>{steps}</think> The answer is {a + b}."}])
    return out
