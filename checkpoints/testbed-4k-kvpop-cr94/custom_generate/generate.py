"""transformers' custom_generate hook of a KVpop checkpoint: generate with the checkpoint's own
KVpopCache, chunked prefill and the device's fastest decoding loop (kvpop_hf/hub_generate.py in kvpop-hf, which
must be installed)."""

from kvpop_hf.hub_generate import generate  # noqa: F401
