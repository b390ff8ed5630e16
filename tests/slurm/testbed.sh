#!/usr/bin/env bash
# One-node SLURM cluster (slurmctld + slurmd + slurmdbd, munge, MariaDB) for hp_tool's tests.
#
#   bash tests/slurm/testbed.sh start    # install if needed, configure, start; idempotent
#   bash tests/slurm/testbed.sh status   # exit 0 only when the cluster accepts jobs
#   bash tests/slurm/testbed.sh stop     # stop the daemons (by their PID files)
#
# Meant for a disposable Debian 12 machine or container where we are root and there is no systemd.
# It writes /etc/slurm/{slurm,gres,slurmdbd}.conf and creates /dev/fakegpu0 and /dev/fakegpu1.
#
# Environment:
#   TESTBED_CLUSTER_NAME   cluster name (default: hptest)
#   TESTBED_PARTITION      partition name (default: debug)
#   TESTBED_GPUS           fake GPUs on the node (default: 2)
#   TESTBED_KILL_WAIT      seconds between SIGTERM and SIGKILL at time limit or cancel (default: 10)
#   TESTBED_WAIT_S         seconds to wait for the cluster to come up (default: 90)
set -euo pipefail

CLUSTER_NAME=${TESTBED_CLUSTER_NAME:-hptest}
PARTITION=${TESTBED_PARTITION:-debug}
NGPUS=${TESTBED_GPUS:-2}
KILL_WAIT=${TESTBED_KILL_WAIT:-10}
WAIT_S=${TESTBED_WAIT_S:-90}

NODE=$(hostname -s)
CONF_DIR=/etc/slurm
RUN_DIR=/run/slurm
LOG_DIR=/var/log/slurm
CTLD_SPOOL=/var/spool/slurmctld
SLURMD_SPOOL=/var/spool/slurmd
CTLD_PID=$RUN_DIR/slurmctld.pid
SLURMD_PID=$RUN_DIR/slurmd.pid
DBD_PID=$RUN_DIR/slurmdbd.pid
MUNGE_PID=/run/munge/munged.pid
LOCK=/run/hp_tool-slurm-testbed.lock

DB_NAME=slurm_acct_db
DB_USER=slurm
DB_PASS=slurm-testbed

PACKAGES=(slurmctld slurmd slurm-client munge mariadb-server slurmdbd)

export DEBIAN_FRONTEND=noninteractive

log() { printf '[testbed] %s\n' "$*" >&2; }
die() { printf '[testbed] ERROR: %s\n' "$*" >&2; exit 1; }

need_root() { [ "$(id -u)" -eq 0 ] || die "must run as root (it installs packages and starts daemons)"; }

# --- process helpers ---------------------------------------------------------------------------

pid_of() { # pid from a PID file, empty when the file is missing or the process is gone
    local f=$1 pid
    [ -s "$f" ] || return 0
    pid=$(tr -dc '0-9' <"$f")
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
    return 0
}

alive() { [ -n "$(pid_of "$1")" ]; }

mariadb_pidfile() {
    local f
    for f in /run/mysqld/mysqld.pid /var/run/mysqld/mysqld.pid; do
        [ -s "$f" ] && { echo "$f"; return 0; }
    done
    echo /run/mysqld/mysqld.pid
}

mariadb_alive() { alive "$(mariadb_pidfile)"; }

# Run a daemon detached from our session, our stdio (so callers that capture output do not hang) and
# our lock file descriptor (a daemon inheriting it would hold the lock for its whole life).
spawn() { setsid "$@" </dev/null >>"$LOG_DIR/spawn.log" 2>&1 9>&-; }

take_lock() { # take_lock SECONDS: serialise start/stop between concurrent callers
    exec 9>"$LOCK"
    flock -w "$1" 9
}

wait_for() { # wait_for SECONDS DESCRIPTION COMMAND...
    local secs=$1 what=$2; shift 2
    local end=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $end ] || return 1
        sleep 0.3
    done
}

stop_pidfile() { # stop_pidfile NAME PIDFILE
    local name=$1 f=$2 pid i
    pid=$(pid_of "$f")
    if [ -z "$pid" ]; then
        rm -f "$f"
        return 0
    fi
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        log "$name did not stop in 10 s; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        sleep 0.2
    fi
    rm -f "$f"
}

# --- cluster checks ----------------------------------------------------------------------------

node_state() { sinfo -h -n "$NODE" -o '%T' 2>/dev/null | head -n1; }

partition_up() { [ "$(sinfo -h -p "$PARTITION" -o '%a' 2>/dev/null | head -n1)" = up ]; }

node_usable() {
    case "$(node_state)" in
        idle|mixed|allocated|completing) return 0 ;;
        *) return 1 ;;
    esac
}

sacct_works() { sacct -n -X -S now-1minutes -o JobID >/dev/null 2>&1; }

accepts_jobs() { sbatch --test-only -p "$PARTITION" -t 1 --wrap true >/dev/null 2>&1; }

all_alive() {
    [ -S /run/munge/munge.socket.2 ] && alive "$MUNGE_PID" && mariadb_alive \
        && alive "$DBD_PID" && alive "$CTLD_PID" && alive "$SLURMD_PID"
}

cluster_ready() {
    all_alive && command -v sinfo >/dev/null && partition_up && node_usable && sacct_works && accepts_jobs
}

# --- installation and configuration --------------------------------------------------------------

install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "installing: ${missing[*]}"
    apt-get update -qq </dev/null >/dev/null
    apt-get install -y -qq --no-install-recommends -o Dpkg::Options::=--force-confold \
        "${missing[@]}" </dev/null >/dev/null
}

CHANGED=0
# put_file PATH MODE CONTENT: write only when different; sets CHANGED=1 when it wrote
put_file() {
    local path=$1 mode=$2 content=$3 tmp
    tmp=$(mktemp "$path.XXXXXX")
    printf '%s\n' "$content" >"$tmp"
    chmod "$mode" "$tmp"
    if [ -f "$path" ] && cmp -s "$tmp" "$path"; then
        rm -f "$tmp"
        chmod "$mode" "$path"
    else
        mv -f "$tmp" "$path"
        CHANGED=1
    fi
}

ensure_hostname_resolves() {
    # jobs (torch.distributed via submitit) reach the node by the name in SLURM_JOB_NODELIST
    getent hosts "$NODE" >/dev/null 2>&1 && return 0
    log "adding '$NODE' to /etc/hosts (127.0.1.1)"
    printf '127.0.1.1\t%s\n' "$NODE" >>/etc/hosts
}

make_fake_gpus() {
    local i minor=3
    for ((i = 0; i < NGPUS; i++)); do
        if [ ! -c "/dev/fakegpu$i" ]; then
            rm -f "/dev/fakegpu$i"
            # character devices (the same numbers as /dev/null): slurmd rejects plain files
            mknod "/dev/fakegpu$i" c 1 "$minor" || die "cannot create /dev/fakegpu$i (mknod not allowed?)"
            chmod 666 "/dev/fakegpu$i"
        fi
    done
}

node_topology() { # CPUs=.. Boards=.. SocketsPerBoard=.. CoresPerSocket=.. ThreadsPerCore=..
    slurmd -C 2>/dev/null | head -n1 | tr ' ' '\n' \
        | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=' | tr '\n' ' '
}

real_memory_mb() { awk '/^MemTotal:/ { printf "%d\n", $2 / 1024 * 0.9 }' /proc/meminfo; }

write_configs() {
    local topo mem gpus_range
    install -d -m 755 "$CONF_DIR" "$RUN_DIR" "$LOG_DIR" "$CTLD_SPOOL" "$SLURMD_SPOOL"
    topo=$(node_topology)
    [ -n "$topo" ] || die "slurmd -C did not report the node topology"
    mem=$(real_memory_mb)
    gpus_range="[0-$((NGPUS - 1))]"
    [ "$NGPUS" -eq 1 ] && gpus_range=0

    put_file "$CONF_DIR/slurm.conf" 644 "# Written by tests/slurm/testbed.sh (one-node test cluster); edits are overwritten.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
SlurmctldPort=6817
SlurmdPort=6818
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
StateSaveLocation=$CTLD_SPOOL
SlurmdSpoolDir=$SLURMD_SPOOL
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
ReturnToService=2
KillWait=$KILL_WAIT
MinJobAge=300
MailProg=/bin/true
GresTypes=gpu
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStorageTRES=gres/gpu
JobCompType=jobcomp/none
NodeName=$NODE NodeAddr=127.0.0.1 ${topo}RealMemory=$mem Gres=gpu:$NGPUS State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP"

    put_file "$CONF_DIR/gres.conf" 644 "# Written by tests/slurm/testbed.sh: fake GPUs are character devices (plain files are rejected).
NodeName=$NODE Name=gpu File=/dev/fakegpu$gpus_range"

    put_file "$CONF_DIR/slurmdbd.conf" 600 "# Written by tests/slurm/testbed.sh
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
PidFile=$DBD_PID
LogFile=$LOG_DIR/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StoragePort=3306
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=$DB_NAME"
    chown root:root "$CONF_DIR/slurmdbd.conf"
    chmod 600 "$CONF_DIR/slurmdbd.conf"
}

# --- daemons ------------------------------------------------------------------------------------

start_munge() {
    if alive "$MUNGE_PID" && [ -S /run/munge/munge.socket.2 ]; then return 0; fi
    [ -s /etc/munge/munge.key ] || die "/etc/munge/munge.key is missing (munge package not configured?)"
    install -d -o munge -g munge -m 755 /run/munge
    install -d -o munge -g munge -m 700 /var/log/munge /var/lib/munge 2>/dev/null || true
    log "starting munged"
    spawn runuser -u munge -- /usr/sbin/munged --force
    wait_for 15 munged bash -c 'munge -n | unmunge' || die "munged did not come up"
}

start_mariadb() {
    if ! mariadb_alive; then
        log "starting mariadb"
        install -d -o mysql -g mysql /run/mysqld
        spawn /etc/init.d/mariadb start || true
    fi
    wait_for 30 mariadb mysqladmin ping || die "mariadb did not come up"
    mysql -u root <<SQL || die "cannot create the accounting database user"
CREATE DATABASE IF NOT EXISTS \`$DB_NAME\`;
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL PRIVILEGES ON \`$DB_NAME\`.* TO '$DB_USER'@'localhost';
FLUSH PRIVILEGES;
SQL
}

start_slurmdbd() {
    if [ "$CHANGED" = 1 ]; then stop_pidfile slurmdbd "$DBD_PID"; fi
    if ! alive "$DBD_PID"; then
        log "starting slurmdbd"
        spawn /usr/sbin/slurmdbd
    fi
    wait_for 30 slurmdbd sacctmgr -n -i list cluster || die "slurmdbd did not come up; see $LOG_DIR/slurmdbd.log"
}

start_slurmctld() {
    if [ "$CHANGED" = 1 ]; then stop_pidfile slurmctld "$CTLD_PID"; fi
    if ! alive "$CTLD_PID"; then
        log "starting slurmctld"
        spawn /usr/sbin/slurmctld
    fi
    wait_for 30 slurmctld scontrol ping || die "slurmctld did not come up; see $LOG_DIR/slurmctld.log"
}

start_slurmd() {
    if [ "$CHANGED" = 1 ]; then stop_pidfile slurmd "$SLURMD_PID"; fi
    if ! alive "$SLURMD_PID"; then
        log "starting slurmd"
        spawn /usr/sbin/slurmd
    fi
    wait_for 15 slurmd alive "$SLURMD_PID" || die "slurmd did not come up; see $LOG_DIR/slurmd.log"
}

wait_until_ready() {
    local end=$((SECONDS + WAIT_S)) state resumed=0
    while :; do
        state=$(node_state || true)
        case "$state" in
            *drain*|*inval*|down*|*fail*)
                if [ $resumed -lt 3 ]; then
                    log "node $NODE is '$state'; resuming it"
                    scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
                    resumed=$((resumed + 1))
                fi
                ;;
        esac
        if node_usable && sacct_works && accepts_jobs; then return 0; fi
        if [ $SECONDS -ge $end ]; then
            sinfo -N -l >&2 || true
            scontrol show node "$NODE" | grep -i reason >&2 || true
            die "cluster not ready after ${WAIT_S}s (node state: '${state:-unknown}'); see $LOG_DIR/"
        fi
        sleep 0.5
    done
}

cmd_start() {
    need_root
    if command -v sinfo >/dev/null 2>&1 && cluster_ready; then
        log "already up: node $NODE idle in partition $PARTITION"
        return 0
    fi
    take_lock 300 || die "another testbed.sh has held $LOCK for 5 minutes"
    # someone may have finished starting it while we waited for the lock
    if command -v sinfo >/dev/null 2>&1 && cluster_ready; then return 0; fi

    local t0=$SECONDS
    install_packages
    ensure_hostname_resolves
    make_fake_gpus
    write_configs
    start_munge
    start_mariadb
    start_slurmdbd
    start_slurmctld
    start_slurmd
    wait_until_ready
    log "up in $((SECONDS - t0))s: node $NODE, partition $PARTITION, gpu:$NGPUS"
}

cmd_stop() {
    need_root
    take_lock 60 || log "WARNING: $LOCK still held after 60 s; stopping anyway"
    stop_pidfile slurmd "$SLURMD_PID"
    stop_pidfile slurmctld "$CTLD_PID"
    stop_pidfile slurmdbd "$DBD_PID"
    if mariadb_alive; then
        log "stopping mariadb"
        /etc/init.d/mariadb stop </dev/null >>"$LOG_DIR/spawn.log" 2>&1 9>&- || stop_pidfile mariadb "$(mariadb_pidfile)"
    fi
    stop_pidfile munged "$MUNGE_PID"
    log "stopped"
}

cmd_status() {
    local rc=0 name f pid
    for name in munged mariadb slurmdbd slurmctld slurmd; do
        case $name in
            munged) f=$MUNGE_PID ;;
            mariadb) f=$(mariadb_pidfile) ;;
            slurmdbd) f=$DBD_PID ;;
            slurmctld) f=$CTLD_PID ;;
            slurmd) f=$SLURMD_PID ;;
        esac
        pid=$(pid_of "$f")
        if [ -n "$pid" ]; then
            printf '%-10s running (pid %s)\n' "$name" "$pid"
        else
            printf '%-10s not running\n' "$name"
            rc=1
        fi
    done
    if ! command -v sinfo >/dev/null 2>&1; then
        echo "sinfo: not installed"
        return 1
    fi
    if [ $rc -ne 0 ]; then
        echo "cluster: not accepting jobs (run: bash tests/slurm/testbed.sh start)"
        return 1
    fi
    printf '%-10s %s\n' node "$NODE $(node_state || echo unknown)"
    printf '%-10s %s\n' partition "$PARTITION $(sinfo -h -p "$PARTITION" -o '%a' 2>/dev/null | head -n1)"
    if sacct_works; then printf '%-10s ok\n' sacct; else printf '%-10s failing\n' sacct; rc=1; fi
    if partition_up && node_usable && accepts_jobs; then
        echo "cluster: accepting jobs"
    else
        echo "cluster: not accepting jobs (run: bash tests/slurm/testbed.sh start)"
        rc=1
    fi
    return $rc
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    restart) cmd_stop; cmd_start ;;
    *) echo "usage: $0 start|stop|status|restart" >&2; exit 2 ;;
esac
