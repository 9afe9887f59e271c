#!/usr/bin/env bash
# Start (or reuse) the hpcmem single-node Slurm test cluster "testcluster".
#
#   bash tests/cluster/slurm-up.sh        # idempotent; a second call while it is up returns in about a second
#
# What it does, each step only when needed: installs Debian's slurm/munge/mariadb packages, makes dummy GPU
# device files, writes /etc/slurm/{slurm,gres,cgroup,slurmdbd}.conf from tests/cluster/conf/*.in, starts munged,
# a private MariaDB (mysqld_safe), slurmdbd, slurmctld and slurmd, registers cluster/account/users in accounting,
# and waits until the node is idle. A changed slurm.conf/gres.conf/cgroup.conf restarts both slurmctld and slurmd.
# All state and logs live under $HPCMEM_CLUSTER_DIR (default /var/lib/hpcmem-testcluster). See README.md.
#
# Environment: HPCMEM_CLUSTER_DIR (state dir), HPCMEM_CLUSTER_DBPORT (MariaDB TCP port on 127.0.0.1, default 3316),
#              HPCMEM_CLUSTER_TIMEOUT (seconds to wait for each daemon, default 60),
#              HPCMEM_CLUSTER_NO_APT=1 (fail instead of installing missing packages).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CONF_IN=$HERE/conf
STATE=${HPCMEM_CLUSTER_DIR:-/var/lib/hpcmem-testcluster}
DBPORT=${HPCMEM_CLUSTER_DBPORT:-3316}
TMO=${HPCMEM_CLUSTER_TIMEOUT:-60}
ETC=/etc/slurm
LOGDIR=$STATE/log
RUNDIR=$STATE/run
MYCNF=$STATE/conf/my.cnf
MYSOCK=$STATE/mysql-run/mysqld.sock
NVME=/tmp/hpcmem-nvme
CLUSTER=testcluster
ACCOUNT=hpcmem
PKGS=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server libaio-dev procps)
START_MS=$(date +%s%3N)
export DEBIAN_FRONTEND=noninteractive
export PATH=$PATH:/usr/sbin:/sbin
# A job environment (SLURM_*) must not leak into the client commands used here.
unset SLURM_CONF SLURM_CLUSTERS SLURM_JOB_ID SLURM_JOBID 2>/dev/null || true

log() { echo "[slurm-up $(date +%T)] $*"; }

show_logs() {
    local f
    for f in "$LOGDIR"/slurmctld.log "$LOGDIR"/slurmd.log "$LOGDIR"/slurmdbd.log "$LOGDIR"/mysqld.log \
             "$LOGDIR"/munged.log "$LOGDIR"/*.out; do
        [ -s "$f" ] || continue
        echo "----- last lines of $f -----" >&2
        tail -n 25 "$f" >&2 || true
    done
}

die() {
    echo "slurm-up: ERROR: $*" >&2
    show_logs
    echo "slurm-up: logs are in $LOGDIR; config in $ETC" >&2
    exit 1
}

# wait_for DESCRIPTION SECONDS COMMAND... : poll COMMAND (every 0.5 s) until it succeeds or time runs out.
wait_for() {
    local what=$1 secs=$2; shift 2
    local deadline=$(( $(date +%s) + secs ))
    while ! "$@" >/dev/null 2>&1; do
        if [ "$(date +%s)" -ge "$deadline" ]; then
            die "timed out after ${secs}s waiting for $what"
        fi
        sleep 0.5
    done
}

# live PID: the process exists and is not a zombie (this machine's init may reap late).
live() { local st; st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1); [ -n "$st" ] && [ "$st" != Z ]; }

# pid_alive PIDFILE NAME...: the pid in PIDFILE is alive and its command name is one of NAME...
pid_alive() {
    local pidfile=$1; shift
    local pid comm n
    [ -r "$pidfile" ] || return 1
    pid=$(tr -dc '0-9' <"$pidfile" 2>/dev/null) || return 1
    [ -n "$pid" ] && live "$pid" || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    for n in "$@"; do [ "$comm" = "$n" ] && return 0; done
    return 1
}

# stop_pids NAME PID...: SIGTERM, wait up to 20 s, then SIGKILL.
# stop_strays NAME KEEP: stop every NAME daemon except, when KEEP is set, the one in $RUNDIR/NAME.pid
stop_strays() {
    local name=$1 keep=$2 old="" p
    for p in $(daemon_pids "$name"); do
        [ -n "$keep" ] && [ "$p" = "$(tr -dc 0-9 <"$RUNDIR/$name.pid")" ] && continue
        old="$old $p"
    done
    # shellcheck disable=SC2086
    if [ -n "${old// /}" ]; then stop_pids "$name" $old; fi
}

stop_pids() {
    local name=$1; shift
    local pid
    [ $# -gt 0 ] || return 0
    log "stopping $name (pid $*)"
    kill -TERM "$@" 2>/dev/null || true
    for _ in $(seq 1 40); do
        local alive=0
        for pid in "$@"; do live "$pid" && alive=1; done
        [ "$alive" = 0 ] && return 0
        sleep 0.5
    done
    log "$name did not stop in 20 s, sending SIGKILL"
    kill -KILL "$@" 2>/dev/null || true
    sleep 0.5
}

# daemon_pids NAME: pids of processes whose command name is exactly NAME (left over from any earlier run).
daemon_pids() {
    local p
    for p in $(pgrep -x "$1" 2>/dev/null || true); do live "$p" && printf '%s ' "$p"; done
    return 0
}

sha() { cat "$@" 2>/dev/null | sha256sum | cut -d' ' -f1; }

# ---------------------------------------------------------------------------------------------- root
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        exec sudo -n HPCMEM_CLUSTER_DIR="$STATE" HPCMEM_CLUSTER_DBPORT="$DBPORT" HPCMEM_CLUSTER_TIMEOUT="$TMO" \
            HPCMEM_CLUSTER_NO_APT="${HPCMEM_CLUSTER_NO_APT:-}" bash "$0" "$@"
    fi
    echo "slurm-up: ERROR: must run as root (or with password-less sudo)" >&2
    exit 1
fi
# One slurm-up/slurm-down at a time (tests started in parallel all call slurm-up). Daemons are started
# with fd 9 closed so that they do not hold this lock.
mkdir -p /run/lock && exec 9>/run/lock/hpcmem-testcluster.lock
flock -w 1800 9 || die "another slurm-up/slurm-down held the lock for 30 min"
EXTRA_USER=${SUDO_USER:-}
[ "$EXTRA_USER" = root ] && EXTRA_USER=

# ---------------------------------------------------------------------------------------------- packages
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    [ -n "${HPCMEM_CLUSTER_NO_APT:-}" ] && die "missing packages: ${missing[*]} (HPCMEM_CLUSTER_NO_APT is set)"
    command -v apt-get >/dev/null || die "missing packages ${missing[*]} and no apt-get"
    log "installing ${missing[*]} with apt-get"
    # Another apt/dpkg (e.g. started by someone else) holds the lock: wait for it, bounded.
    deadline=$(( $(date +%s) + 1200 ))
    while pgrep -x apt-get >/dev/null || pgrep -x dpkg >/dev/null || pgrep -x apt >/dev/null; do
        [ "$(date +%s)" -ge "$deadline" ] && die "another apt-get/dpkg is still running after 20 min"
        sleep 2
    done
    # Keep package scripts from starting the default munge/mariadb services: this script starts its own.
    policy_made=
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && policy_made=1
    fi
    apt_ok=
    aptopts=(-y -q -o DPkg::Lock::Timeout=600 -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
    if ls /var/lib/apt/lists/*_Packages >/dev/null 2>&1 \
        && timeout 1800 apt-get install "${aptopts[@]}" "${missing[@]}" </dev/null; then
        apt_ok=1
    else
        timeout 600 apt-get update -q </dev/null || true
        timeout 1800 apt-get install "${aptopts[@]}" "${missing[@]}" </dev/null && apt_ok=1
    fi
    [ -n "$policy_made" ] && rm -f /usr/sbin/policy-rc.d
    [ -n "$apt_ok" ] || die "apt-get install ${missing[*]} failed"
fi
for c in slurmctld slurmd slurmdbd sinfo sacctmgr munged mysqld_safe; do
    command -v "$c" >/dev/null || [ -x "/usr/sbin/$c" ] || die "$c not found after install"
done

# ---------------------------------------------------------------------------------------------- dirs, devices
mkdir -p "$STATE" "$LOGDIR" "$STATE/conf" "$STATE/ctld" "$STATE/spool" "$RUNDIR" "$STATE/mysql" "$STATE/mysql-run"
chmod 755 "$STATE" "$LOGDIR" "$STATE/conf"
chown slurm:slurm "$STATE/ctld" "$RUNDIR"
chown mysql:mysql "$STATE/mysql" "$STATE/mysql-run"
touch "$LOGDIR/slurmctld.log" "$LOGDIR/slurmdbd.log" "$LOGDIR/slurmd.log" "$LOGDIR/mysqld.log" "$LOGDIR/munged.log"
chown slurm:slurm "$LOGDIR/slurmctld.log" "$LOGDIR/slurmdbd.log"
chown mysql:mysql "$LOGDIR/mysqld.log"
chown munge:munge "$LOGDIR/munged.log"
chmod 640 "$LOGDIR/munged.log"
mkdir -p "$NVME" && chmod 1777 "$NVME"
for i in 0 1 2 3; do
    d=/dev/hpcmem-gpu$i
    if [ ! -c "$d" ]; then
        rm -f "$d"
        mknod -m 666 "$d" c 1 3 || die "mknod $d failed"
    fi
done

# ---------------------------------------------------------------------------------------------- config
NODE=$(hostname -s)
[ -n "$NODE" ] || die "hostname -s is empty"
if [ -f /sys/fs/cgroup/memory/memory.memsw.limit_in_bytes ]; then SWAP=yes; else SWAP=no; fi
if [ -f /sys/fs/cgroup/memory/memory.limit_in_bytes ]; then
    CGPLUGIN=cgroup/v1
else
    CGPLUGIN=autodetect   # not verified: this cluster was only tried on cgroup v1
    log "WARNING: no cgroup v1 memory controller at /sys/fs/cgroup/memory; using CgroupPlugin=autodetect (untested)"
fi
if [ ! -s "$STATE/dbpass" ]; then
    (umask 077; head -c 18 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$STATE/dbpass")
fi
DBPASS=$(cat "$STATE/dbpass")
NEW=$STATE/conf/new
rm -rf "$NEW" && mkdir -p "$NEW"
for f in slurm.conf gres.conf cgroup.conf slurmdbd.conf my.cnf; do
    sed -e "s|@NODE@|$NODE|g" -e "s|@STATE@|$STATE|g" -e "s|@DBPORT@|$DBPORT|g" -e "s|@DBPASS@|$DBPASS|g" \
        -e "s|@SWAP@|$SWAP|g" -e "s|@CGPLUGIN@|$CGPLUGIN|g" "$CONF_IN/$f.in" >"$NEW/$f"
    if grep -q '@[A-Z]*@' "$NEW/$f"; then die "unsubstituted placeholder in $NEW/$f"; fi
done
mkdir -p "$ETC"
SLURM_CHANGED=
for f in slurm.conf gres.conf cgroup.conf; do
    if ! cmp -s "$NEW/$f" "$ETC/$f"; then
        install -m 644 -o root -g root "$NEW/$f" "$ETC/$f"
        SLURM_CHANGED=1
    fi
done
DBD_CHANGED=
if ! cmp -s "$NEW/slurmdbd.conf" "$ETC/slurmdbd.conf"; then
    install -m 600 -o slurm -g slurm "$NEW/slurmdbd.conf" "$ETC/slurmdbd.conf"
    DBD_CHANGED=1
fi
chown slurm:slurm "$ETC/slurmdbd.conf"; chmod 600 "$ETC/slurmdbd.conf"
MY_CHANGED=
if ! cmp -s "$NEW/my.cnf" "$MYCNF"; then
    install -m 644 "$NEW/my.cnf" "$MYCNF"
    MY_CHANGED=1
fi
rm -rf "$NEW"
SLURM_SHA=$(sha "$ETC/slurm.conf" "$ETC/gres.conf" "$ETC/cgroup.conf")
DBD_SHA=$(sha "$ETC/slurmdbd.conf")
MY_SHA=$(sha "$MYCNF")

# ---------------------------------------------------------------------------------------------- munge
munge_ok() { timeout 5 munge -n </dev/null 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1; }
if ! munge_ok; then
    log "starting munged"
    mkdir -p /run/munge /var/lib/munge /var/log/munge /etc/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    chmod 755 /run/munge; chmod 700 /var/lib/munge /var/log/munge
    if [ ! -s /etc/munge/munge.key ]; then
        log "creating /etc/munge/munge.key"
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile=/etc/munge/munge.key --force
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        fi
    fi
    chown munge:munge /etc/munge /etc/munge/munge.key
    chmod 700 /etc/munge; chmod 400 /etc/munge/munge.key
    # A munged that no longer answers (or a stale socket) is replaced.
    if pid_alive /run/munge/munged.pid munged; then stop_pids munged "$(cat /run/munge/munged.pid)"; fi
    timeout 20 runuser -u munge -- munged --force --log-file="$LOGDIR/munged.log" \
        </dev/null >>"$LOGDIR/munged.out" 2>&1 9>&- || die "munged failed to start"
    echo started >"$RUNDIR/munged.ours"
    wait_for "munged to answer" "$TMO" munge_ok
fi

# ---------------------------------------------------------------------------------------------- MariaDB
my() { timeout 20 mariadb --no-defaults --socket="$MYSOCK" -uroot; }
my_ok() { timeout 5 mariadb-admin --no-defaults --socket="$MYSOCK" -uroot ping >/dev/null 2>&1; }
my_up=
if my_ok && pid_alive "$STATE/mysql-run/mysqld.pid" mariadbd mysqld; then
    if [ -z "$MY_CHANGED" ] && [ "$(cat "$RUNDIR/mysqld.sha" 2>/dev/null)" = "$MY_SHA" ]; then
        my_up=1
    else
        log "MariaDB config changed: restarting it"
        timeout 60 mariadb-admin --no-defaults --socket="$MYSOCK" -uroot shutdown || true
    fi
fi
if [ -z "$my_up" ]; then
    # mysqld_safe or mariadbd left from an earlier run of this script (same pid file) but not answering.
    if pid_alive "$STATE/mysql-run/mysqld.pid" mariadbd mysqld; then
        stop_pids mariadbd "$(cat "$STATE/mysql-run/mysqld.pid")"
    fi
    # ... or one started with our my.cnf whose pid file is gone: it would hold the port.
    for p in $(daemon_pids mariadbd) $(daemon_pids mysqld) $(daemon_pids mysqld_safe); do
        if grep -qa -- "$MYCNF" "/proc/$p/cmdline" 2>/dev/null; then stop_pids "mariadb leftover" "$p"; fi
    done
    if [ ! -d "$STATE/mysql/mysql" ]; then
        log "initialising MariaDB data directory $STATE/mysql"
        timeout 300 mariadb-install-db --defaults-file="$MYCNF" --user=mysql --datadir="$STATE/mysql" \
            --auth-root-authentication-method=socket --skip-test-db </dev/null >>"$LOGDIR/mysql-install.out" 2>&1 \
            || die "mariadb-install-db failed (see $LOGDIR/mysql-install.out)"
    fi
    log "starting MariaDB (mysqld_safe) on 127.0.0.1:$DBPORT"
    rm -f "$MYSOCK"
    setsid mysqld_safe --defaults-file="$MYCNF" </dev/null >>"$LOGDIR/mysqld_safe.out" 2>&1 9>&- &
    wait_for "MariaDB to answer on $MYSOCK" "$TMO" my_ok
    echo "$MY_SHA" >"$RUNDIR/mysqld.sha"
    DBD_CHANGED=1   # the database (user, password) is (re)checked below and slurmdbd restarted
fi

# ---------------------------------------------------------------------------------------------- slurmdbd
dbd_ok() { timeout 5 sacctmgr -n -P list cluster format=cluster >/dev/null 2>&1; }
dbd_up=
if pid_alive "$RUNDIR/slurmdbd.pid" slurmdbd && [ -z "$DBD_CHANGED" ] \
    && [ "$(cat "$RUNDIR/slurmdbd.sha" 2>/dev/null)" = "$DBD_SHA" ] && dbd_ok; then
    dbd_up=1
fi
if [ -z "$dbd_up" ]; then
    log "granting slurmdbd access to MariaDB"
    my <<SQL || die "could not create the slurm database user"
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DBPASS';
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DBPASS';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$DBPASS';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DBPASS';
GRANT ALL PRIVILEGES ON slurm_acct_db.* TO 'slurm'@'localhost';
GRANT ALL PRIVILEGES ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
SQL
    old="$(daemon_pids slurmdbd)"
    # shellcheck disable=SC2086
    [ -n "${old// /}" ] && stop_pids slurmdbd $old
    log "starting slurmdbd"
    timeout 30 slurmdbd </dev/null >>"$LOGDIR/slurmdbd.out" 2>&1 9>&- || die "slurmdbd failed to start"
    wait_for "slurmdbd to answer (sacctmgr list cluster)" "$TMO" dbd_ok
    echo "$DBD_SHA" >"$RUNDIR/slurmdbd.sha"
fi

# Cluster, account and users in accounting (checked cheaply; added only when absent).
assoc_users=$(timeout 10 sacctmgr -n -P show assoc cluster=$CLUSTER account=$ACCOUNT format=user 2>/dev/null || true)
if ! timeout 10 sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER"; then
    log "adding cluster $CLUSTER to accounting"
    timeout 30 sacctmgr -i add cluster "$CLUSTER" >/dev/null || die "sacctmgr add cluster failed"
fi
if ! timeout 10 sacctmgr -n -P list account format=account 2>/dev/null | grep -qx "$ACCOUNT"; then
    log "adding account $ACCOUNT"
    timeout 30 sacctmgr -i add account "$ACCOUNT" cluster="$CLUSTER" description="hpcmem tests" \
        organization=hpcmem >/dev/null || die "sacctmgr add account failed"
fi
for u in root ${EXTRA_USER:+"$EXTRA_USER"}; do
    if ! grep -qx "$u" <<<"$assoc_users"; then
        log "adding user $u to account $ACCOUNT"
        timeout 30 sacctmgr -i add user "$u" account="$ACCOUNT" cluster="$CLUSTER" defaultaccount="$ACCOUNT" \
            >/dev/null || die "sacctmgr add user $u failed"
    fi
done

# ---------------------------------------------------------------------------------------------- slurmctld, slurmd
ctld_ok() { timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP'; }
node_state() { timeout 5 sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -n1; }
node_idle() { [ "$(node_state)" = idle ] || [ "$(node_state)" = mixed ] || [ "$(node_state)" = allocated ]; }

restart=
if [ -n "$SLURM_CHANGED" ]; then
    restart="config in $ETC changed"
elif [ "$(cat "$RUNDIR/slurm.sha" 2>/dev/null)" != "$SLURM_SHA" ]; then
    restart="daemons were not started with this config"
fi
ctld_up=; slurmd_up=
pid_alive "$RUNDIR/slurmctld.pid" slurmctld && ctld_up=1
pid_alive "$RUNDIR/slurmd.pid" slurmd && slurmd_up=1
if [ -n "$ctld_up" ] && [ -n "$slurmd_up" ] && [ -z "$restart" ] && ctld_ok && node_idle; then
    :   # all up with this config: reuse
else
    if [ -n "$restart" ] && { [ -n "$ctld_up" ] || [ -n "$slurmd_up" ]; }; then
        log "restarting slurmctld and slurmd: $restart"
        ctld_up=; slurmd_up=
    fi
    # Stop what is not ours or must restart (leftovers of earlier runs hold the ports).
    stop_strays slurmctld "$ctld_up"
    stop_strays slurmd "$slurmd_up"
    if [ -z "$ctld_up" ]; then
        log "starting slurmctld"
        timeout 30 slurmctld </dev/null >>"$LOGDIR/slurmctld.out" 2>&1 9>&- || die "slurmctld failed to start"
    fi
    wait_for "slurmctld to answer (scontrol ping)" "$TMO" ctld_ok
    if [ -z "$slurmd_up" ]; then
        log "starting slurmd"
        timeout 30 slurmd </dev/null >>"$LOGDIR/slurmd.out" 2>&1 9>&- || die "slurmd failed to start"
    fi
    echo "$SLURM_SHA" >"$RUNDIR/slurm.sha"
    # Wait for the node to be usable; a node left DOWN/DRAINED by an earlier run is resumed once.
    deadline=$(( $(date +%s) + TMO )); resumed=
    until node_idle; do
        st=$(node_state)
        if [ -z "$resumed" ] && [[ "$st" =~ ^(down|drain|drained|draining|fail|failing) ]]; then
            sleep 2; st=$(node_state)
            if [[ "$st" =~ ^(down|drain|drained|draining|fail|failing) ]]; then
                log "node $NODE is $st: resuming it"
                timeout 10 scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
                resumed=1
            fi
        fi
        if [ "$(date +%s)" -ge "$deadline" ]; then
            timeout 5 scontrol show node "$NODE" >&2 || true
            die "node $NODE is '${st:-unknown}' not idle after ${TMO}s"
        fi
        sleep 0.5
    done
fi

ms=$(( $(date +%s%3N) - START_MS )); elapsed=$(printf '%d.%03d' $((ms / 1000)) $((ms % 1000)))
log "cluster $CLUSTER is up: node $NODE $(node_state); partitions: $(timeout 5 sinfo -h -o '%P' | tr '\n' ' ')(${elapsed}s)"
log "config: $ETC/{slurm,gres,cgroup,slurmdbd}.conf   logs: $LOGDIR   state: $STATE"
