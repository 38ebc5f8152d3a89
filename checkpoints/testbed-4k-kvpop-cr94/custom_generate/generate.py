"""transformers' custom_generate hook of a KVpop checkpoint: the checkpoint's own KVpopCache, chunked prefill
and the fastest decoding loop of the device (kvpop_hf/hub_generate.py). Needs kvpop-hf installed."""

from kvpop_hf.hub_generate import generate  # noqa: F401
