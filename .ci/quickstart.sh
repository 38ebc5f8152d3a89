#!/usr/bin/env bash
# README quick start, command 1, exactly as the README writes it, in a fresh venv of its own (no test extra):
# the KVpop student must print the dense cache's answer.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=$(grep -A1 '^# 1\. ' README.md | sed -n 2p)
case "$cmd" in pip\ install*examples/generate.py*) ;; *) echo "README command 1 not found: '$cmd'" >&2; exit 1;; esac
rm -rf .venv-quickstart
python3 -m venv .venv-quickstart
(
  source .venv-quickstart/bin/activate
  echo "+ $cmd"
  bash -c "$cmd" 2>&1 | tee .venv-quickstart/out.txt
)
answers=$(grep 'extracted answer:' .venv-quickstart/out.txt | sed 's/ -> .*//' | sort -u | wc -l)
correct=$(grep -c 'extracted answer:.* -> correct' .venv-quickstart/out.txt || true)
if [ "$answers" != 1 ] || [ "$correct" != 2 ]; then
  echo "README command 1: the KVpop and DynamicCache answers differ or are wrong" >&2; exit 1
fi
echo "README command 1: KVpop and DynamicCache give the same correct answer"
