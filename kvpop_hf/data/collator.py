"""Batches of documents of different lengths for KVpopTrainer: right padding with an attention mask.

Right padding keeps every real token at its own position: ``t = 0`` is the document's first token (the sinks are
real tokens) and a causal query never sees the padding after it, so the sparse student attention, the running
top-k and the dense teacher give each real position what the unpadded document gives it. The trainer masks the
padded queries out of the targets, the boundary loss and the distillation (labels ``-100``).
"""

from __future__ import annotations

import torch

from .render import IGNORE


class KVpopDataCollator:
    """``[{"input_ids": [n_i], "labels": [n_i] (optional)}, ...]`` -> ``{"input_ids" [B, S], "labels" [B, S],
    "attention_mask" [B, S]}`` with ``S = max n_i``, padded on the right with ``pad_token_id`` (ids), ``-100``
    (labels) and ``0`` (mask). ``pad_to_multiple_of``: round ``S`` up (fewer distinct shapes for compiled kernels)."""

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: int | None = None):
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features):
        if not features:
            raise ValueError("KVpopDataCollator got an empty batch.")
        ids = [torch.as_tensor(f["input_ids"], dtype=torch.long).flatten() for f in features]
        has_labels = ["labels" in f and f["labels"] is not None for f in features]
        if any(has_labels) and not all(has_labels):
            raise ValueError("some rows of the batch have labels and some do not: give labels for every row or none.")
        labels = [torch.as_tensor(f["labels"], dtype=torch.long).flatten() for f in features] if all(has_labels) \
            else [i.clone() for i in ids]
        for i, (x, y) in enumerate(zip(ids, labels)):
            if x.numel() == 0:
                raise ValueError(f"row {i} of the batch has no tokens.")
            if x.numel() != y.numel():
                raise ValueError(f"row {i}: input_ids has {x.numel()} tokens but labels has {y.numel()}.")
        S = max(x.numel() for x in ids)
        if self.pad_to_multiple_of:
            S = -(-S // self.pad_to_multiple_of) * self.pad_to_multiple_of
        B = len(ids)
        out_ids = torch.full((B, S), self.pad_token_id, dtype=torch.long)
        out_labels = torch.full((B, S), IGNORE, dtype=torch.long)
        mask = torch.zeros((B, S), dtype=torch.long)
        for b, (x, y) in enumerate(zip(ids, labels)):
            n = x.numel()
            out_ids[b, :n], out_labels[b, :n], mask[b, :n] = x, y, 1
        return {"input_ids": out_ids, "labels": out_labels, "attention_mask": mask}
