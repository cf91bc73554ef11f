#!/bin/bash
# Stop the daemons cluster-up.sh started under DIR, by their pid files.
#   tests/slurm/cluster-down.sh DIR
set -uo pipefail
DIR=${1:?usage: cluster-down.sh DIR}
for f in "$DIR"/slurmd-*.pid "$DIR"/slurmctld.pid; do
  [ -s "$f" ] || continue
  pid=$(cat "$f")
  kill "$pid" 2>/dev/null || continue
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null
  rm -f "$f"
done
exit 0
