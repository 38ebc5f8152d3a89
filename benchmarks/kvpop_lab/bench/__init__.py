"""The code of the benchmark scripts that tests or other benchmarks use: each ``benchmarks/<name>.py`` runs
``kvpop_lab.bench.<name>.main``."""
