# Sourced by the GPU scripts: the repository's library and laboratory on a machine where neither is installed.
# PYTHONPATH makes kvpop_hf and kvpop_lab importable; the laboratory's entry points (--dataset testbed:..., the
# kvpop-eval command) need its metadata, so it is installed editable, offline and without dependencies, once.
export PYTHONPATH=.:benchmarks${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c "import importlib.metadata as m; m.distribution('kvpop-lab')" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e ./benchmarks >/dev/null 2>&1 \
    || echo "note: could not install the laboratory (benchmarks/); --dataset testbed:... will not resolve" >&2
fi
source "$(dirname "${BASH_SOURCE[0]}")/commit_env.sh"  # KVPOP_GIT_COMMIT=HEAD+changes for a tree that differs from HEAD
