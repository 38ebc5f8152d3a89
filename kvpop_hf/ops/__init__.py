"""The numerical kernels of the cache and the trainer, each beside its plain torch reference: decode eviction
and attention, prompt-chunk attention and its masks, fused projections, the running top-k, the future-attention
target and the priority math (docs/backends.md lists the reference of every fast path)."""
