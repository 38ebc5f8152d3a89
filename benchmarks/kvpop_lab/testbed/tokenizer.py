"""A small, closed-vocabulary HF tokenizer for the testbed tasks (built offline).

Model: ``tokenizers`` WordPiece over :func:`kvpop_lab.testbed.vocab.vocabulary`
with a whitespace-split pre-tokenizer. Template words and pseudo-words are one
token each; numbers, variable names (``x17``) and UUID-like strings are spelled
one character per token (``x ##1 ##7``). ``"\\n"`` is mapped to a dedicated
newline token by the normaliser and back by the decoder.

Whitespace normalisation (:func:`normalize`): runs of spaces/tabs collapse to
one space, spaces around newlines are removed and the ends are stripped. For
any canonical text ``t`` produced by the generators,
``normalize(tok.decode(tok.encode(t, add_special_tokens=False))) == t``.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from .vocab import BOS, CONT, EOS, NEWLINE, PAD, SPECIAL_TOKENS, UNK, vocabulary

__all__ = [
    "build_backend",
    "build_tokenizer",
    "count_tokens",
    "normalize",
    "extract_answer",
    "ANSWER_MARKER",
]

ANSWER_MARKER = "answer :"
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")


def build_backend() -> Tokenizer:
    """The raw ``tokenizers.Tokenizer`` (no BOS post-processing added)."""
    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    tk = Tokenizer(
        models.WordPiece(vocab, unk_token=UNK, continuing_subword_prefix=CONT,
                         max_input_chars_per_word=200)
    )
    tk.normalizer = normalizers.Replace("\n", f" {NEWLINE} ")
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.Sequence(
        [decoders.WordPiece(prefix=CONT, cleanup=False), decoders.Replace(NEWLINE, "\n")]
    )
    tk.add_special_tokens(list(SPECIAL_TOKENS))
    return tk


@functools.lru_cache(maxsize=1)
def _counter() -> Tokenizer:
    return build_backend()


def count_tokens(text: str) -> int:
    """Number of tokens ``text`` encodes to (no BOS/EOS)."""
    return len(_counter().encode(text, add_special_tokens=False).ids)


def build_tokenizer(model_max_length: int = 32768):
    """Return a ``transformers.PreTrainedTokenizerFast`` for the testbed.

    ``tokenizer(text)`` prepends ``<bos>`` (never appends ``<eos>``);
    ``pad``/``bos``/``eos``/``unk`` are set; padding is on the left so batched
    greedy generation works out of the box. ``save_pretrained`` +
    ``AutoTokenizer.from_pretrained`` round-trips offline.
    """
    from transformers import PreTrainedTokenizerFast

    tk = build_backend()
    bos_id = tk.token_to_id(BOS)
    tk.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        model_input_names=["input_ids", "attention_mask"],
    )


def normalize(text: str) -> str:
    """Canonical whitespace: single spaces, no spaces around newlines, stripped.

    Special-token strings are kept as separate words.
    """
    text = _SPECIAL_RE.sub(r" \1 ", text).replace("\r\n", "\n").replace("\r", "\n")
    lines = [" ".join(line.split()) for line in text.split("\n")]
    return "\n".join(lines).strip()


def extract_answer(generated_text: str) -> str:
    """Pull the final answer out of generated text.

    Cuts at the first ``<eos>`` (if the text was decoded with special tokens),
    drops other special tokens, then keeps what follows the last
    ``"answer :"`` marker if there is one (reasoning traces end with
    ``"answer : <value>"``), and only its first line. The result is
    :func:`normalize`-d, so it compares exactly against ``Problem.answer``.
    """
    text = generated_text.split(EOS, 1)[0]
    text = _SPECIAL_RE.sub(" ", text)
    text = normalize(text)
    idx = text.rfind(ANSWER_MARKER)
    if idx >= 0:
        text = text[idx + len(ANSWER_MARKER):]
    text = text.strip()
    return text.split("\n", 1)[0].strip()


def encode_plain(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (works with HF or raw)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text, add_special_tokens=False).ids
    return tokenizer(text, add_special_tokens=False)["input_ids"]
