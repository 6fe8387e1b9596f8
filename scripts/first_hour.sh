#!/usr/bin/env bash
# The README's set-up as a new user meets it: a clean clone, a fresh virtual environment (no
# system site packages), the README's two commands (read from its Set-up section, so this script
# follows the README), each timed and its results checked:
#   1. exit 0, and the demo's --verify line says ok;
#   2. exit 0, fastopt is not built a second time, and pytest's summary has passes and no failures.
# usage: scripts/first_hour.sh [REV]   (default HEAD; the clone is of this repository's commits,
#        so uncommitted changes are not in it). KEEP=1 keeps the work folder; pip's usual
#        settings apply (e.g. PIP_FIND_LINKS=/path/to/wheels, its cache).
#        scripts/first_hour.sh --print-commands prints the two commands and exits.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"

readme_commands() {
  # The first ```bash block of "## Set-up": its lines that are not comments.
  awk '/^## /{ in_setup = ($0 == "## Set-up") } in_setup && /^```bash/{ block = 1; next }
       block && /^```/{ exit } block && !/^[[:space:]]*(#|$)/{ print }' "$1"
}

if [[ "${1:-}" == "--print-commands" ]]; then readme_commands "$repo/README.md"; exit 0; fi
rev="${1:-HEAD}"
work="$(mktemp -d "${TMPDIR:-/tmp}/fastopt-first-hour.XXXXXX")"
[[ -n "${KEEP:-}" ]] || trap 'rm -rf "$work"' EXIT
git clone -q --no-local "$repo" "$work/fastopt"
git -C "$work/fastopt" checkout -q "$rev"
python3 -m venv "$work/venv"
# shellcheck disable=SC1091
source "$work/venv/bin/activate"
cd "$work/fastopt"
mapfile -t commands < <(readme_commands README.md)
if [[ ${#commands[@]} -ne 2 ]]; then
  echo "first_hour: expected 2 commands in README's Set-up, found ${#commands[@]}" >&2; exit 1
fi

failed=0
fail() { echo "first_hour: FAILED: $*" >&2; failed=1; }
for i in 0 1; do
  log="$work/command$((i + 1)).log"
  echo "== command $((i + 1)): ${commands[$i]}"
  start=$(date +%s)
  set +e
  # the whole log goes to the file; the terminal gets the build's [n/N] progress and results
  bash -c "${commands[$i]}" 2>&1 | tee "$log" | grep -E --line-buffered \
    '^ *\[[0-9]+/[0-9]+\]|accuracy|verif|the speed|passed|failed|error'
  rc=${PIPESTATUS[0]}
  set -e
  seconds[$i]=$(( $(date +%s) - start ))
  echo "== command $((i + 1)): exit $rc after ${seconds[$i]} s"
  [[ $rc -eq 0 ]] || fail "command $((i + 1)) exited $rc (log: $log)"
done

# 1: the demo's verification passed (a failed --verify exits 1, checked above; this says which
# line told so) and the bench compared the two models.
grep -Eq '(accuracy|verif|verification).*(: ok|passed)' "$work/command1.log" \
  || fail "command 1 printed no passing verification line"
grep -q 'the speed' "$work/command1.log" || fail "command 1 printed no bench comparison"
# 2: no second build of the C++ core, and pytest's summary line.
if grep -q 'Building wheel for fastopt' "$work/command2.log"; then
  fail "command 2 built fastopt again"
fi
summary=$(grep -E '^=+ .* in [0-9.]+s' "$work/command2.log" | tail -1 || true)
echo "pytest: ${summary:-no summary line}"
[[ "$summary" =~ [0-9]+\ passed && ! "$summary" =~ [0-9]+\ (failed|errors?) ]] \
  || fail "pytest's summary is not all passed"

echo "first_hour: command 1 ${seconds[0]} s, command 2 ${seconds[1]} s ($(nproc) cores)"
[[ $failed -eq 0 ]] && echo "first_hour: ok"
exit $failed
