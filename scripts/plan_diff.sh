#!/usr/bin/env bash
# Diffs every shipped graph's launch plan (what `dynamo-flexkv serve` starts: processes, argv, env,
# files, cache config) and its `render --k8s` manifest between two commits:
#
#   scripts/plan_diff.sh BEFORE [AFTER]      (AFTER: the work tree, default)
#
# Each commit is checked out in a temporary git worktree and rendered by scripts/plan_dump.py with
# this tree's venv ($PYTHON, default .venv/bin/python), which normalises only what differs per run:
# the run directory, probed ports and the handover secret. Exit status 0: identical; 1: the diff is
# printed. Used for issue 52's "no behaviour lost" (the result: docs/METRICS.md, "Renamed metrics").
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
[ $# -ge 1 ] && [ $# -le 2 ] || { echo "usage: $0 BEFORE [AFTER]" >&2; exit 2; }
work=$(mktemp -d /tmp/plan-diff.XXXXXX)
trees=()
cleanup() {
    for t in "${trees[@]}"; do git -C "$here" worktree remove --force "$t" >/dev/null 2>&1 || true; done
    rm -rf "$work"
}
trap cleanup EXIT

tree_of() {  # $1: a commit-ish, or "" for this work tree; prints the tree to render
    if [ -z "$1" ]; then echo "$here"; return; fi
    local t="$work/tree-$(git -C "$here" rev-parse --short "$1^{commit}")"
    git -C "$here" worktree add --detach --quiet "$t" "$1"
    echo "$t"
}
before=$(tree_of "$1"); trees+=("$before")
after=$(tree_of "${2:-}"); [ "$after" = "$here" ] || trees+=("$after")
"$python" "$here/scripts/plan_dump.py" "$before" "$work/before" >/dev/null
"$python" "$here/scripts/plan_dump.py" "$after" "$work/after" >/dev/null
echo "plans of $1 vs ${2:-the work tree}: $(ls "$work/after" | wc -l) files"
if diff -r -u "$work/before" "$work/after" | sed "s|$work/||g"; then
    echo "identical"
else
    exit 1
fi
