#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine (Debian/Ubuntu, root, no systemd needed):
# munge + slurmctld + slurmd with a scratch configuration, for the tests and for learning.
#
#   scripts/slurm/local-cluster.sh install          # apt packages (once)
#   scripts/slurm/local-cluster.sh start DIR [CPUS] # prints: export SLURM_CONF=DIR/slurm.conf
#   scripts/slurm/local-cluster.sh stop DIR
#
# CPUS (default 8) is what the node advertises: more than the machine has, so that a
# 2-task job with several threads each is scheduled at once (jobs overcommit, they never wait).
set -euo pipefail
cmd=${1:-}; dir=${2:-}

case "$cmd" in
install)
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  ;;
start)
  [ -n "$dir" ] || { echo "usage: $0 start DIR [CPUS]" >&2; exit 2; }
  cpus=${3:-8}
  for bin in slurmctld slurmd sinfo munged; do
    command -v "$bin" >/dev/null || { echo "missing $bin: run '$0 install' (needs apt and root)" >&2; exit 3; }
  done
  mkdir -p "$dir/state" "$dir/spool" "$dir/log"
  dir=$(cd "$dir" && pwd)
  host=$(hostname -s)
  port=${SLURMCTLD_PORT:-6817}
  cat > "$dir/slurm.conf" <<CONF
ClusterName=jaxpar
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
KillWait=5
InactiveLimit=30
MinJobAge=30
ReturnToService=2
MailProg=/bin/true
SlurmdParameters=config_overrides
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
  if ! munge -n >/dev/null 2>&1 </dev/null; then     # no munged answering yet: start one
    mkdir -p /run/munge && chown munge:munge /run/munge
    runuser -u munge -- munged --force
    touch "$dir/munged.started-here"
  fi
  export SLURM_CONF="$dir/slurm.conf"
  slurmctld -c -i -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF"
  for _ in $(seq 100); do
    state=$(sinfo -h -o %T 2>/dev/null || true)
    if [ "$state" = idle ]; then echo "export SLURM_CONF=$SLURM_CONF"; exit 0; fi
    sleep 0.2
  done
  echo "slurm did not come up (node state '${state:-none}'); see $dir/log/" >&2
  exit 1
  ;;
stop)
  [ -n "$dir" ] || { echo "usage: $0 stop DIR" >&2; exit 2; }
  for daemon in slurmd slurmctld; do
    if [ -f "$dir/$daemon.pid" ]; then kill "$(cat "$dir/$daemon.pid")" 2>/dev/null || true; fi
  done
  if [ -f "$dir/munged.started-here" ] && [ -f /run/munge/munged.pid ]; then
    kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
    rm -f "$dir/munged.started-here"
  fi
  ;;
*)
  echo "usage: $0 install | start DIR [CPUS] | stop DIR" >&2; exit 2 ;;
esac
