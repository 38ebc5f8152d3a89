"""Wall-clock time of importing kvpop_hf (and of transformers alone, for scale), each in a fresh process.

Statements timed (median of ``--repeats`` fresh interpreters, ``python -c STATEMENT``):

* ``import kvpop_hf``;
* ``import transformers``, ``import transformers.modeling_utils`` (transformers' model stack, which
  ``from_pretrained`` imports; it holds the attention registry) and that plus ``transformers.masking_utils`` (the
  mask registry, which every model file imports);
* ``import kvpop_hf; import transformers.modeling_utils`` (what a user pays before building a model with
  ``attn_implementation="kvpop"``; the name is registered once modeling_utils is imported);
* ``from kvpop_hf import KVpopCache``.

``--root DIR`` puts ``DIR`` first on ``PYTHONPATH`` (measure another tree, e.g. ``git archive REV kvpop_hf``
unpacked there). Writes a JSON file with the command, commit, date, versions, CPU count and load average.

    python benchmarks/import_time.py --repeats 3 --out after.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STATEMENTS = {
    "import kvpop_hf": "import kvpop_hf",
    "import transformers": "import transformers",
    "import transformers.modeling_utils": "import transformers.modeling_utils",
    "import transformers.modeling_utils + masking_utils": "import transformers.modeling_utils, "
    "transformers.masking_utils",
    "import kvpop_hf + transformers.modeling_utils": "import kvpop_hf; import transformers.modeling_utils; "
    "from transformers import AttentionInterface as A; assert 'kvpop' in A._global_mapping",
    "from kvpop_hf import KVpopCache": "from kvpop_hf import KVpopCache",
}


def time_statement(statement: str, root: Path, repeats: int) -> list[float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", statement], env=env, check=True, cwd=root)
        out.append(time.perf_counter() - start)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", type=Path, default=ROOT, help="tree whose kvpop_hf is imported")
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    from kvpop_lab.utils.provenance import git_commit, versions

    rows = {}
    for name, statement in STATEMENTS.items():
        times = time_statement(statement, args.root.resolve(), args.repeats)
        rows[name] = {"median_s": round(statistics.median(times), 3), "runs_s": [round(t, 3) for t in times]}
        print(f"{name:52s} median {rows[name]['median_s']:.2f} s  runs {rows[name]['runs_s']}")
    result = {
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:])),
        "commit": git_commit(ROOT), "root": str(args.root), "date": datetime.now(timezone.utc).isoformat(),
        "versions": versions("torch", "transformers"), "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
