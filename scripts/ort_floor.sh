#!/usr/bin/env bash
# Runs scripts/ort_floor.py's outputs under each onnxruntime release, each in its own venv
# (no system site packages), and prints one JSON line per (release, output).
#   python scripts/ort_floor.py make /tmp/floor && scripts/ort_floor.sh /tmp/floor 1.17.3 1.18.1 ...
set -euo pipefail
dir="$1"; shift
here="$(cd "$(dirname "$0")" && pwd)"
for v in "$@"; do
  venv="$(mktemp -d)/venv"
  python3 -m venv "$venv"
  # ORT before 1.19 was built against numpy 1.x
  numpy="numpy"; case "$v" in 1.1[5-8].*) numpy="numpy<2" ;; esac
  "$venv/bin/pip" install -q "onnxruntime==$v" "$numpy" >&2
  "$venv/bin/python" "$here/ort_floor.py" try "$dir"
  rm -rf "$(dirname "$venv")"
done
