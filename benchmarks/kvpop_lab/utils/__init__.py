"""Helpers of the benchmarks, the evaluation harness and the training scripts: timing and out-of-memory detection
(:mod:`.timing`), and the provenance stamped into result files (:mod:`.provenance`)."""
