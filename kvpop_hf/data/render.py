"""One dataset row -> token ids and labels: a ``text`` field as is, or a ``messages`` conversation through the
tokenizer's chat template.

Labels are the ids themselves (the whole document is supervised, as the paper distils on whole traces), or, with
``assistant_only=True``, ``-100`` outside the assistant turns. The assistant spans are found by rendering each
conversation prefix that ends before an assistant turn (``add_generation_prompt=True``) and the prefix that ends
after it, and mapping the characters between them to tokens through the tokenizer's offsets; a template that
renders a prefix differently from the start of the whole conversation (it rewrites earlier turns) is refused.
"""

from __future__ import annotations

IGNORE = -100


def check_chat_template(tokenizer) -> None:
    """A ValueError naming the fix when ``tokenizer`` has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"--messages_field renders conversations with the tokenizer's chat template, and the "
                         f"tokenizer of {name!r} has none: use a tokenizer with a chat template (an instruct/chat "
                         "model's), set tokenizer.chat_template, or give plain text with --text_field.")


def text_ids(tokenizer, text: str) -> list[int]:
    """``text`` tokenized with the tokenizer's own special tokens (a BOS where the model uses one), EOS appended
    unless already last."""
    if not isinstance(text, str):
        raise ValueError(f"the text field must hold strings, got {type(text).__name__}.")
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    return ids


def _render(tokenizer, messages, generation_prompt: bool, template_kwargs: dict) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                         **template_kwargs)


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError("the messages field must hold a non-empty list of {'role': ..., 'content': ...} dicts, got "
                         f"{str(messages)[:200]!r}.")


def conversation_ids(tokenizer, messages, assistant_only: bool = False,
                     template_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """(ids, labels) of a conversation rendered by the chat template (the template adds its own special tokens).
    ``assistant_only``: labels are ``-100`` except on the tokens of assistant turns."""
    _check_messages(messages)
    kw = dict(template_kwargs or {})
    text = _render(tokenizer, messages, False, kw)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=assistant_only)
    ids = list(enc["input_ids"])
    if not assistant_only:
        return ids, list(ids)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:i], True, kw) if i else ""
        end = _render(tokenizer, messages[:i + 1], False, kw) if i + 1 < len(messages) else text
        if not text.startswith(start) or not text.startswith(end):
            raise ValueError("assistant_only_loss: this chat template renders the conversation before an assistant "
                             "turn differently from the start of the whole conversation (it rewrites earlier turns, "
                             "e.g. drops their reasoning), so the assistant tokens cannot be located: train on whole "
                             "conversations (the default) or give conversations with one assistant turn at the end.")
        spans.append((len(start), len(end)))
    if not spans:
        raise ValueError("assistant_only_loss: a conversation has no assistant turn, so no token would be trained: "
                         "drop such rows or train on whole conversations (the default).")
    labels = [IGNORE] * len(ids)
    for j, (a, b) in enumerate(enc["offset_mapping"]):
        if any(s <= a < e for s, e in spans):
            labels[j] = ids[j]
    return ids, labels
