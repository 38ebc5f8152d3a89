"""The numerical kernels of the cache, the scorers and the trainer, each beside its plain torch reference: decode
eviction and attention, prompt-chunk attention and its masks, fused projections, the mLSTM memory (step and
chunkwise forms) and its fused decode step, the running top-k, the training sparse attention with its block masks and
interval layout, the future-attention target and the priority math (docs/backends.md lists the reference of every
fast path). The bottom layer: nothing here imports the trainer, the scorers, the baselines or the integrations
(tests/test_import_layers.py)."""
