"""From KVpop's budget (``B`` entries per layer and KV head) to kvpress's arguments; pure Python, imported by the
kvpress runner (no kvpop_hf, no kvpress) and by the tests.

kvpress keeps ``n_kept = max(1, int(k_len * (1 - compression_ratio)))`` entries of ``k_len``
(``kvpress.utils.compute_n_kept``). The prefill press gets the ratio that keeps exactly ``B`` of the prompt's
``L`` entries (about 1 - 492/3991 = 0.877 at 88%, 0.938 at 94% on the record's 3991-token prompts); a
``DecodingPress`` gets ``target_size = B`` and compresses back to ``B`` every ``compression_interval`` steps.
"""

from __future__ import annotations

__all__ = ["n_kept", "prefill_ratio", "DECODING_INTERVAL", "decoding_interval"]

DECODING_INTERVAL = 1  # a DecodingPress that compresses after every step holds B entries, as KVpop does
SNAPKV_WINDOW = 64  # kvpress SnapKVPress's default observation window, also KVpop's window of the record


def n_kept(k_len: int, compression_ratio: float) -> int:
    """Entries kvpress keeps of ``k_len`` at ``compression_ratio`` (kvpress.utils.compute_n_kept)."""
    if compression_ratio >= 1.0:
        return 0
    return max(1, int(k_len * (1 - compression_ratio)))


def prefill_ratio(k_len: int, budget: int) -> float:
    """The compression ratio with which kvpress keeps exactly ``budget`` of ``k_len`` entries."""
    if not 1 <= budget <= k_len:
        raise ValueError(f"budget must be in [1, k_len={k_len}], got {budget}: a prompt shorter than the budget "
                         "needs no compression.")
    if budget == k_len:
        return 0.0
    ratio = 1.0 - (budget + 0.5) / k_len  # int() of budget + 0.5 is budget, away from float rounding at integers
    if n_kept(k_len, ratio) != budget:
        raise AssertionError(f"no ratio keeps {budget} of {k_len}")  # float arithmetic bug, not bad input
    return ratio


def decoding_interval(press: str) -> int:
    """kvpress's ``compression_interval`` for ``press`` as a DecodingPress: 1 (back to ``B`` after every step),
    except SnapKV, whose score needs more buffered decode steps than its observation window
    (``hidden_states.shape[1] > window_size``): 65 with the 64-query window."""
    return SNAPKV_WINDOW + 1 if press == "snapkv" else DECODING_INTERVAL
