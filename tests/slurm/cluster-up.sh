#!/bin/bash
# Start a throw-away Slurm cluster on localhost: slurmctld plus one slurmd per fake node (n1, n2, ...),
# every file (config, state, logs, pid files) under DIR, auth/none (no munged). Needs root and the Debian
# packages slurmctld, slurmd and slurm-client (installed with apt-get when sinfo is missing).
#   tests/slurm/cluster-up.sh DIR [NODES]      then: export SLURM_CONF=DIR/slurm.conf
set -euo pipefail
DIR=$(realpath -m "${1:?usage: cluster-up.sh DIR [NODES]}")
NODES=${2:-2}
if ! command -v sinfo >/dev/null; then
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client
fi
HOST=$(hostname -s)
# the hardware fields as slurmd sees them, e.g. "CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1"
HW=$(slurmd -C | sed -n 1p | sed -e 's/^NodeName=[^ ]* //' -e 's/ *RealMemory=[0-9]*//')
MEM_MB=$(awk '/^MemTotal:/{print int($2/1024*0.9/'"$NODES"')}' /proc/meminfo)
rm -rf "$DIR"
mkdir -p "$DIR/ctld" "$DIR/log"
NODE_LINES=""
for i in $(seq 1 "$NODES"); do
  mkdir -p "$DIR/n$i"
  # every fake node is this host (NodeAddr 127.0.0.1); each slurmd listens on its own port
  NODE_LINES+="NodeName=n$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((17000 + i)) $HW RealMemory=$MEM_MB State=UNKNOWN"$'\n'
done
cat > "$DIR/slurm.conf" <<CONF
ClusterName=ci
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
SlurmctldPort=6817
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
# no systemd, no cgroups
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
$NODE_LINES
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
export SLURM_CONF=$DIR/slurm.conf
slurmctld   # daemonizes
for i in $(seq 1 "$NODES"); do slurmd -N "n$i"; done
states=""
for _ in $(seq 300); do
  states=$(sinfo -h -N -o '%T' 2>/dev/null | sort -u | tr '\n' ' ') || true
  [ "$states" = "idle " ] && break
  sleep 0.1
done
if [ "$states" != "idle " ]; then
  echo "cluster-up: nodes not idle: $states" >&2
  tail -n 30 "$DIR"/log/*.log >&2
  exit 1
fi
sinfo -N
