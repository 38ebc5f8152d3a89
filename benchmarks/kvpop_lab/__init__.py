"""The kvpop-hf laboratory (``pip install -e ./benchmarks``): what the benchmarks, the evaluation of record and the
tests share, built on kvpop-hf's public modules only.

* :mod:`kvpop_lab.testbed`: seeded long-context task families, the offline tokenizer, ``kvpop-eval``, the oracle
  and the analyses of what a cache keeps;
* :mod:`kvpop_lab.pretrain_teacher`: the testbed teacher's pretraining (``kvpop-pretrain-teacher``);
* :mod:`kvpop_lab.train_kvp`: the KVP baseline's training on recorded testbed traces (``kvpop-train-kvp``);
* :mod:`kvpop_lab.utils`: timing and the provenance (command, commit, versions) stamped into results files;
"""
