#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for tests/test_slurm.py and for trying the SLURM launcher
# (docs/scale_out.md) before a real cluster:
#
#   scripts/slurm_local.sh start    install slurmctld slurmd slurm-client munge when missing (Debian, apt; as root),
#                                   write the config under $SLURM_LOCAL_DIR, start munged, slurmctld, slurmd and
#                                   wait until the node is idle (idempotent: a running cluster is left as it is)
#   scripts/slurm_local.sh stop     stop exactly the daemons `start` started (by their pid files)
#   scripts/slurm_local.sh status   "up" (exit 0) or "down" (exit 1), with the partition and node states
#   scripts/slurm_local.sh env      the line to source for the clients: export SLURM_CONF=...
#
# Clients (sinfo, sbatch, squeue, scancel; the submitit launcher) find this cluster through SLURM_CONF:
#   eval "$(scripts/slurm_local.sh env)"
#
# Layout of $SLURM_LOCAL_DIR (default /tmp/blockpilot-slurm): etc/slurm.conf, munge/ (key, socket, pid, log; owned
# by the munge user), state/ (slurmctld), spool/ (slurmd), log/ (slurmctld.log, slurmd.log), run/ (pid files).
# The config: one node (this host, all its CPUs), one default partition $SLURM_LOCAL_PARTITION (default "local"),
# proctrack/linuxproc, task/none, select/cons_tres with CR_Core, SlurmUser=root, no cgroup.conf, no accounting
# database (so `sacct` is unavailable; squeue/scontrol work). Ports: $SLURM_LOCAL_PORT (slurmctld, default 6817)
# and the next one (slurmd).
#
# Exit codes: 0 ok; 1 status says down; 2 cannot start here (not root, no apt, a daemon failed; the reason on stderr).
set -euo pipefail

DIR="${SLURM_LOCAL_DIR:-/tmp/blockpilot-slurm}"
PARTITION="${SLURM_LOCAL_PARTITION:-local}"
PORT="${SLURM_LOCAL_PORT:-6817}"
CONF="$DIR/etc/slurm.conf"
MUNGE="$DIR/munge"
RUN="$DIR/run"
LOG="$DIR/log"
PACKAGES=(slurmctld slurmd slurm-client munge)
HOST="$(hostname -s)"

die() { echo "slurm_local: $*" >&2; exit 2; }
say() { echo "slurm_local: $*" >&2; }

# the pid in pid file $RUN/$1.pid if that process is alive and is $1 (a stale file's pid may name another process)
live_pid() {
  local pid file="$RUN/$1.pid"
  [ -f "$file" ] || return 1
  pid="$(tr -dc 0-9 <"$file")"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] && echo "$pid"
}

node_state() { SLURM_CONF="$CONF" sinfo -h -N -n "$HOST" -o %T 2>/dev/null | head -n 1; }

is_up() {
  live_pid munged >/dev/null && live_pid slurmctld >/dev/null \
    && live_pid slurmd >/dev/null || return 1
  case "$(node_state)" in idle|mixed|allocated|completing) return 0 ;; esac
  return 1
}

install_packages() {
  local missing=()
  command -v slurmctld >/dev/null || missing+=(slurmctld)
  command -v slurmd >/dev/null || missing+=(slurmd)
  command -v sinfo >/dev/null || missing+=(slurm-client)
  command -v munged >/dev/null || missing+=(munge)
  [ "${#missing[@]}" -eq 0 ] && return 0
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them (Debian/Ubuntu only)"
  say "installing ${PACKAGES[*]} (apt-get; missing: ${missing[*]})"
  # the packages' init scripts must not start the system's own daemons: a policy-rc.d refuses, as in Docker images
  local policy=/usr/sbin/policy-rc.d added=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && added=1
  fi
  local rc=0
  { DEBIAN_FRONTEND=noninteractive apt-get update -qq \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}"; } \
    >"${TMPDIR:-/tmp}/slurm_local-apt.log" 2>&1 || rc=$?
  [ "$added" -eq 1 ] && rm -f "$policy"
  [ "$rc" -eq 0 ] || die "apt-get install ${PACKAGES[*]} failed (exit $rc); see ${TMPDIR:-/tmp}/slurm_local-apt.log"
}

write_config() {
  local cpus mem_mb
  cpus="$(nproc)"
  mem_mb="$(awk '/MemTotal/ { printf "%d", $2 / 1024 * 0.9 }' /proc/meminfo)"
  mkdir -p "$DIR/etc" "$DIR/state" "$DIR/spool" "$LOG" "$RUN"
  cat >"$CONF" <<EOF
# written by scripts/slurm_local.sh: a single-node cluster for tests and trials (no accounting database)
ClusterName=blockpilot
SlurmctldHost=$HOST
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
# a cancelled job is killed right after its SIGTERM (submitit ignores SIGTERM, expecting a requeue; default 30 s)
KillWait=0
SlurmdTimeout=60
InactiveLimit=0
MinJobAge=300
NodeName=$HOST CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=$PARTITION Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
}

start_munged() {
  live_pid munged >/dev/null && return 0
  getent passwd munge >/dev/null || die "no munge user (the munge package creates it)"
  install -d -m 0755 -o munge -g munge "$MUNGE"  # the socket needs x for all; the key itself is 0400
  if [ ! -s "$MUNGE/munge.key" ]; then
    dd if=/dev/urandom of="$MUNGE/munge.key" bs=1024 count=1 status=none
  fi
  chown munge:munge "$MUNGE/munge.key" && chmod 0400 "$MUNGE/munge.key"
  rm -f "$MUNGE/munge.pid"
  # munged refuses group/world-writable parents; /tmp is sticky, which it accepts
  runuser -u munge -- munged --key-file="$MUNGE/munge.key" --socket="$MUNGE/munge.socket" \
    --pid-file="$MUNGE/munge.pid" --log-file="$MUNGE/munged.log" --seed-file="$MUNGE/munge.seed" \
    || die "munged did not start; see $MUNGE/munged.log"
  for _ in $(seq 50); do [ -s "$MUNGE/munge.pid" ] && break; sleep 0.1; done
  [ -s "$MUNGE/munge.pid" ] || die "munged wrote no pid file; see $MUNGE/munged.log"
  cp "$MUNGE/munge.pid" "$RUN/munged.pid"
}

start_daemon() {  # $1: slurmctld | slurmd
  local name="$1"
  live_pid "$name" >/dev/null && return 0
  rm -f "$RUN/$name.pid"
  "$name" -f "$CONF" >>"$LOG/$name.out" 2>&1 || die "$name did not start; see $LOG/$name.log and $LOG/$name.out"
  for _ in $(seq 100); do live_pid "$name" >/dev/null && return 0; sleep 0.1; done
  local why=""
  live_pid slurmctld >/dev/null || why=" (slurmctld exited: port $PORT in use? set SLURM_LOCAL_PORT; see $LOG/slurmctld.log)"
  die "$name did not come up; see $LOG/$name.log$why"
}

cmd_start() {
  if [ -f "$CONF" ] && is_up; then
    say "already up ($CONF, partition $PARTITION)"
    return 0
  fi
  [ "$(id -u)" -eq 0 ] || die "needs root (to install the packages, run munged as the munge user and slurmd)"
  install_packages
  # a failed start leaves nothing running: stop the daemons of this folder (started by this script) on any error
  trap 'rc=$?; if [ "$rc" -ne 0 ]; then cmd_stop; fi; exit "$rc"' EXIT
  write_config
  start_munged
  start_daemon slurmctld
  sleep 0.5
  live_pid slurmctld >/dev/null || die "slurmctld exited after starting (port $PORT in use? SLURM_LOCAL_PORT); see $LOG/slurmctld.log"
  start_daemon slurmd
  local state=""
  for i in $(seq 120); do
    for d in slurmctld slurmd; do
      live_pid "$d" >/dev/null || die "$d exited while the node came up; see $LOG/$d.log"
    done
    state="$(node_state || true)"
    case "$state" in
      idle|mixed|allocated) say "up: node $HOST $state, partition $PARTITION, SLURM_CONF=$CONF"; trap - EXIT; return 0 ;;
      down*|drain*|fail*) [ "$i" -gt 10 ] && SLURM_CONF="$CONF" scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.5
  done
  die "node $HOST is not idle after 60 s (state '${state}'); see $LOG/slurmctld.log and $LOG/slurmd.log"
}

stop_pidfile() {  # $1: name; kill the process of $RUN/$1.pid and wait for it
  local pid
  if pid="$(live_pid "$1")"; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true
    say "stopped $1 (pid $pid)"
  fi
  rm -f "$RUN/$1.pid"
}

cmd_stop() {
  stop_pidfile slurmd
  stop_pidfile slurmctld
  stop_pidfile munged
}

cmd_status() {
  if [ -f "$CONF" ] && is_up; then
    echo "up: SLURM_CONF=$CONF"
    SLURM_CONF="$CONF" sinfo
    return 0
  fi
  local daemons=""
  for d in munged slurmctld slurmd; do
    live_pid "$d" >/dev/null && daemons+=" $d"
  done
  echo "down (running:${daemons:- none}; config $CONF)"
  return 1
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 64 ;;
esac
