#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the Slurm launcher's end-to-end test.
#
#   tests/launcher/slurm_cluster.sh start STATE_DIR   # munged + slurmctld + slurmd, prints `export SLURM_CONF=...`
#   tests/launcher/slurm_cluster.sh stop STATE_DIR    # stops the three daemons by their PIDs
#
# Needs root and `apt-get install -y slurm-wlm munge` (slurmctld, slurmd, sbatch, munged).
# Everything lives under STATE_DIR: its own munge key and socket, slurm.conf on free ports,
# state, spool, logs and pid files — nothing of a system-wide Slurm/munge set-up is used
# or touched. ProctrackType=proctrack/linuxproc and TaskPlugin=task/none: no cgroups needed.
set -euo pipefail

cmd=${1:?usage: $0 start|stop STATE_DIR}
state=${2:?usage: $0 start|stop STATE_DIR}
mkdir -p "$state"
state=$(cd "$state" && pwd)

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

stop_pid() {  # stop_pid NAME PIDFILE: SIGTERM, wait up to 15 s, then SIGKILL
  local name=$1 f=$2 pid
  [ -s "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { echo "$name (pid $pid) ignored SIGTERM: SIGKILL" >&2; kill -KILL "$pid" || true; }
  fi
  rm -f "$f"
}

case "$cmd" in
start)
  for b in munged slurmctld slurmd sbatch scontrol; do
    command -v "$b" >/dev/null || { echo "$b not found: apt-get install -y slurm-wlm munge" >&2; exit 1; }
  done
  [ "$(id -u)" = 0 ] || { echo "the test cluster runs its daemons as root" >&2; exit 1; }
  host=$(hostname -s)
  cpus=$(nproc)
  mkdir -p "$state/munge" "$state/ctld" "$state/spool" "$state/log"
  chmod 700 "$state/munge"
  # Our own munge key and daemon (a system munged, if any, is left alone).
  if [ ! -s "$state/munge/munge.key" ]; then
    dd if=/dev/urandom of="$state/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$state/munge/munge.key"
  fi
  munged --force --key-file="$state/munge/munge.key" --socket="$state/munge/munge.socket" \
         --pid-file="$state/munge/munged.pid" --log-file="$state/log/munged.log" \
         --seed-file="$state/munge/munged.seed"
  for _ in $(seq 1 50); do [ -S "$state/munge/munge.socket" ] && break; sleep 0.1; done
  [ -S "$state/munge/munge.socket" ] || { echo "munged did not start; see $state/log/munged.log" >&2; exit 1; }

  cat > "$state/slurm.conf" <<CONF
ClusterName=rlstreamci
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$state/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=3600
InactiveLimit=0
KillWait=10
SlurmctldTimeout=60
SlurmdTimeout=60
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP
CONF
  export SLURM_CONF="$state/slurm.conf"
  slurmctld -f "$SLURM_CONF"   # daemonizes; its pid lands in slurmctld.pid
  slurmd -f "$SLURM_CONF"
  # Ready when the node is idle.
  for _ in $(seq 1 150); do
    st=$(sinfo -h -N -o '%T' 2>/dev/null | head -1 || true)
    case "$st" in idle*) break ;; esac
    sleep 0.2
  done
  case "$st" in
    idle*) ;;
    *) echo "slurm node not idle (state '${st}'); see $state/log/" >&2; exit 1 ;;
  esac
  echo "export SLURM_CONF=$SLURM_CONF"
  ;;
stop)
  export SLURM_CONF="$state/slurm.conf"
  stop_pid slurmd "$state/slurmd.pid"
  stop_pid slurmctld "$state/slurmctld.pid"
  stop_pid munged "$state/munge/munged.pid"
  ;;
*)
  echo "usage: $0 start|stop STATE_DIR" >&2; exit 2 ;;
esac
