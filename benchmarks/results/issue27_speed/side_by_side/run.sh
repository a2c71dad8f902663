#!/usr/bin/env bash
# Old and new code side by side: one process each on the same subset, started together, so
# that both see the same machine (these machines drift by 20-30% within hours).
# Usage, from the repository root: bash benchmarks/results/issue27_speed/side_by_side/run.sh [OLD_REV]
set -euo pipefail
old_rev=${1:-36e5242}
old_tree=$(mktemp -d)/old
git worktree add -f "$old_tree" "$old_rev" >/dev/null
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
args="--no-overhead --landscape default --landscape ppo_lam --reps 3 --reps-for gp=1 --jobs 1"
out=benchmarks/results/issue27_speed/side_by_side
python=$PWD/.venv/bin/python
(cd "$old_tree" && PYTHONPATH=$old_tree /usr/bin/time -f "old wall %e cpu %U+%S" \
  "$python" -m benchmarks.run $args --out "$old_tree/out" 2> "$OLDPWD/$out/old-$old_rev.log") &
# The pool sets GLIBC_TUNABLES itself; with --jobs 1 it is set here, as the pool would.
GLIBC_TUNABLES=glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=536870912 \
  /usr/bin/time -f "new wall %e cpu %U+%S" "$python" -m benchmarks.run $args --out "$(mktemp -d)" \
  2> "$out/new-$(git rev-parse --short HEAD).log" &
wait
git worktree remove --force "$old_tree"
