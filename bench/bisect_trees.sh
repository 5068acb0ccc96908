#!/usr/bin/env bash
# Old versions of meshrun for a GPU call that bisects a measured change (the device machine
# gets a copy of the working tree, without .git): .bisect/SHA/{src,bench} for each SHA, then
#   run(carry=[".bisect"]): BISECT="SHA ..." bash bench/gpu_session.sh memhist OUT
# Each tree is measured with its own bench/plan_accuracy.py, so an older harness's flags hold.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: bash bench/bisect_trees.sh SHA [SHA ...]  (commits of this repository)" >&2; exit 2; }
cd "$(git rev-parse --show-toplevel)"
for sha in "$@"; do
  full=$(git rev-parse --short "$sha^{commit}" 2>/dev/null) || { echo "bisect_trees.sh: $sha is not a commit here (hint: git log --oneline)" >&2; exit 2; }
  rm -rf ".bisect/$full" && mkdir -p ".bisect/$full"
  git archive "$full" src bench | tar -x -C ".bisect/$full"
  echo ".bisect/$full"
done
