"""Command-line front ends of training, one module per command, each with ``main(argv=None) -> int``.

``kvpop-retrofit`` (:mod:`.retrofit`), ``kvpop-train-dms`` (:mod:`.train_dms`), ``kvpop-train-kvp``
(:mod:`.train_kvp`) and ``kvpop-pretrain-teacher`` (:mod:`.pretrain_teacher`); ``training/*.py`` run the same
``main``. :mod:`.budget_flags` adds ``--sinks``, ``--window`` and ``--topk`` to
``kvpop-warm-compile`` and the speed benchmarks. Nothing is imported here, so ``import kvpop_hf`` loads none of them.
"""
