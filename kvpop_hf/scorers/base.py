"""The scorer interface: a module that turns cached (key, value) pairs into importance scores.

A scorer serves every layer of one model; `layer_idx` selects the layer's weights.
Shapes: keys/values ``[batch, kv_heads, n, head_dim]``, positions ``[batch, kv_heads, n]``
(int64, real-token index, -1 for no token), scores ``[batch, kv_heads, n]`` float32.

Stateless scorers give ``r_t = f(k_t, v_t, t)``. Stateful scorers (``stateful = True``) carry a
per-layer memory that absorbs every token in order; the token ``u = q - w`` leaving the
protected window is scored from the memory after it absorbed token ``q`` (delayed scoring,
KVpop arXiv:2607.05061, Sec. 3).
"""

from __future__ import annotations

import torch
from torch import nn


class Scorer(nn.Module):
    """Base class. Subclasses implement :meth:`score` (stateless) or the stateful trio.

    Four class attributes say what kind of scorer it is; the cache, its layers and the trainer read them
    (a subclass sets those that differ from the defaults here)."""

    stateful: bool = False
    """True: a per-layer memory absorbs every token in order (:meth:`init_state`, :meth:`absorb_and_read`);
    False: each token is scored from its own key and value (:meth:`score`)."""

    delayed: bool = True
    """For a stateful scorer, when a token is read: True reads token ``u = q - w`` as it leaves the protected
    window, from the memory after it absorbed token ``q`` (delayed scoring, paper Sec. 3); False reads each
    token as it enters, right after absorbing it. Not used by stateless scorers."""

    dynamic: bool = False
    """True: scores come from the model's attention probabilities, not from keys and values alone
    (:class:`kvpop_hf.baselines.attention_policies.policies.AttentionPolicy`), and the scorer names the cache layer
    that stores its entries (``layer_class``)."""

    layer_class: type | None = None
    """The class of ``KVpopCache``'s layers for this scorer (constructed as ``layer_class(shared, layer_idx)``);
    None: :class:`kvpop_hf.layer.KVpopLayer`. The attention-based policies bring
    :class:`~kvpop_hf.baselines.attention_policies.layer.DynamicScoreLayer`."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def config_dict(self) -> dict:
        """Constructor keyword arguments (besides the model shape) needed to rebuild the scorer."""
        return {}

    # -- stateless ---------------------------------------------------------------------------
    def score(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode_kernel(self, device: torch.device):
        """A fused function for this scorer's part of one decode step on ``device`` (read, absorb, score, decay;
        the signature of :func:`kvpop_hf.ops.mlstm_decode.mlstm_decode_priority_triton`), or None:
        the layer then runs the torch path (``absorb_and_read``/``score``). Asked once, when a layer allocates."""
        return None

    # -- stateful ----------------------------------------------------------------------------
    def init_state(self, layer_idx: int, batch_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def absorb_and_read(
        self,
        layer_idx: int,
        state: tuple[torch.Tensor, ...],
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        new_valid: torch.Tensor,
        read_keys: torch.Tensor,
        read_values: torch.Tensor,
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Absorb ``n`` new tokens in order and read one score after each of them.

        new_keys/new_values ``[b, h, n, d]``; new_valid ``[b, n]`` bool (False: padding, skipped);
        read_keys/read_values ``[b, h, n, d]``: the token read after absorbing new token j.
        Returns the new state and scores ``[b, h, n]``.
        """
        raise NotImplementedError


def check_scorer_option(scorer: str, name: str, value, minimum: int) -> int:
    """A positive integer option of a scorer (``scorer_kwargs``), else a ValueError that names it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"Scorer {scorer!r}: `{name}` must be an integer >= {minimum}, got {value!r}. "
                         f"Fix scorer_kwargs={{{name!r}: ...}}.")
    return int(value)


def headwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head linear map. x ``[b, h, n, i]``, weight ``[h, i, o]``, bias ``[h, o]`` -> ``[b, h, n, o]``.

    For one token (``n == 1``, a decode step) it is written as a broadcast product and a sum, which
    ``torch.compile`` fuses with its neighbours into one kernel (a batched matmul would be a launch of
    its own for a few hundred multiply-adds)."""
    if x.shape[2] == 1:
        out = (x[..., :, None] * weight[None, :, None]).sum(-2)
    else:
        out = torch.einsum("bhni,hio->bhno", x, weight)
    if bias is not None:
        out = out + bias[None, :, None, :]
    return out


def scorer_input(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The learned scorers' input ``x = [k; v]`` in float32, ``[b, h, n, 2d]`` (paper Sec. 3.3)."""
    return torch.cat([keys, values], dim=-1).float()
