#!/usr/bin/env bash
# Stop the hpcmem single-node Slurm test cluster started by slurm-up.sh. Packages, config and state stay in place
# (job history, accounting database), so slurm-up.sh brings the same cluster back.
#
#   bash tests/cluster/slurm-down.sh            # stop slurmd, slurmctld, slurmdbd, MariaDB, and munged if slurm-up started it
#   bash tests/cluster/slurm-down.sh --purge    # also delete the state directory (logs, job state, accounting DB)
set -euo pipefail

STATE=${HPCMEM_CLUSTER_DIR:-/var/lib/hpcmem-testcluster}
RUNDIR=$STATE/run
MYSOCK=$STATE/mysql-run/mysqld.sock
PURGE=
for a in "$@"; do
    case $a in
        --purge) PURGE=1 ;;
        -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
        *) echo "slurm-down: unknown argument $a" >&2; exit 2 ;;
    esac
done
export PATH=$PATH:/usr/sbin:/sbin
unset SLURM_CONF SLURM_CLUSTERS 2>/dev/null || true

if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        exec sudo -n HPCMEM_CLUSTER_DIR="$STATE" bash "$0" "$@"
    fi
    echo "slurm-down: ERROR: must run as root (or with password-less sudo)" >&2
    exit 1
fi

# Not while slurm-up.sh runs.
mkdir -p /run/lock && exec 9>/run/lock/hpcmem-testcluster.lock
flock -w 300 9 || { echo "slurm-down: ERROR: slurm-up.sh holds the lock" >&2; exit 1; }

log() { echo "[slurm-down $(date +%T)] $*"; }
# live PID: the process exists and is not a zombie (this machine's init may reap late).
live() { local st; st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1); [ -n "$st" ] && [ "$st" != Z ]; }

# pids_of NAME PIDFILE: the pid in PIDFILE if it runs NAME, plus any other process named exactly NAME.
pids_of() {
    local name=$1 pidfile=$2 pid out=""
    if [ -r "$pidfile" ]; then
        pid=$(tr -dc 0-9 <"$pidfile" 2>/dev/null || true)
        if [ -n "$pid" ] && live "$pid" && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ]; then out=$pid; fi
    fi
    for pid in $(pgrep -x "$name" 2>/dev/null || true); do
        live "$pid" || continue
        case " $out " in *" $pid "*) ;; *) out="$out $pid" ;; esac
    done
    echo "${out# }"
}

# stop NAME PID...: SIGTERM, wait up to 20 s, then SIGKILL.
stop() {
    local name=$1; shift
    local pid alive
    [ $# -gt 0 ] || return 0
    log "stopping $name (pid $*)"
    kill -TERM "$@" 2>/dev/null || true
    for _ in $(seq 1 40); do
        alive=
        for pid in "$@"; do live "$pid" && alive=1; done
        [ -z "$alive" ] && return 0
        sleep 0.5
    done
    log "$name still running after 20 s: SIGKILL"
    kill -KILL "$@" 2>/dev/null || true
}

# slurmctld and slurmd: ask politely first (scontrol shutdown stops both), then make sure.
if [ -n "$(pids_of slurmctld "$RUNDIR/slurmctld.pid")" ]; then
    log "scontrol shutdown"
    timeout 10 scontrol shutdown >/dev/null 2>&1 || true
    for _ in $(seq 1 20); do
        [ -z "$(pids_of slurmctld "$RUNDIR/slurmctld.pid")$(pids_of slurmd "$RUNDIR/slurmd.pid")" ] && break
        sleep 0.5
    done
fi
# shellcheck disable=SC2046
stop slurmd $(pids_of slurmd "$RUNDIR/slurmd.pid")
# shellcheck disable=SC2046
stop slurmctld $(pids_of slurmctld "$RUNDIR/slurmctld.pid")
# shellcheck disable=SC2046
stop slurmdbd $(pids_of slurmdbd "$RUNDIR/slurmdbd.pid")

# Our private MariaDB (only the one using this state directory; a system MariaDB is left alone).
if [ -S "$MYSOCK" ]; then
    log "stopping MariaDB"
    timeout 60 mariadb-admin --no-defaults --socket="$MYSOCK" -uroot shutdown >/dev/null 2>&1 || true
fi
if [ -r "$STATE/mysql-run/mysqld.pid" ]; then
    pid=$(tr -dc 0-9 <"$STATE/mysql-run/mysqld.pid" 2>/dev/null || true)
    case "$(cat "/proc/$pid/comm" 2>/dev/null)" in mariadbd|mysqld) stop mariadbd "$pid" ;; esac
fi
for pid in $(pgrep -x mysqld_safe 2>/dev/null || true); do
    grep -qa -- "$STATE/conf/my.cnf" "/proc/$pid/cmdline" 2>/dev/null && stop mysqld_safe "$pid"
done

# munged: only if slurm-up.sh started it (a munged started by the system stays).
if [ -e "$RUNDIR/munged.ours" ]; then
    if pid=$(tr -dc 0-9 </run/munge/munged.pid 2>/dev/null) && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = munged ]; then
        stop munged "$pid"
    fi
    rm -f "$RUNDIR/munged.ours"
fi
rm -f "$RUNDIR/slurm.sha" "$RUNDIR/slurmdbd.sha" "$RUNDIR/mysqld.sha"

if [ -n "$PURGE" ]; then
    log "removing $STATE"
    rm -rf --one-file-system "$STATE"
fi
log "test cluster stopped (packages and /etc/slurm config left in place)"
