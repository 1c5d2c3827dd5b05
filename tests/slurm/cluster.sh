#!/bin/bash
# A real two-node Slurm cluster on this one machine, for the tests (Debian's slurm 22.05).
#   cluster.sh install   apt-get install slurmctld slurmd slurm-client munge (root)
#   cluster.sh start     write $STATE/slurm.conf, start munged, slurmctld, slurmd n1 and n2
#   cluster.sh stop      stop the daemons and remove $STATE
# Clients use it through SLURM_CONF=$STATE/slurm.conf; /etc/slurm is left alone.
set -euo pipefail
STATE=${MINDDP_SLURM_STATE:-/tmp/minddp-slurm}
CONF=$STATE/slurm.conf
HOST=$(hostname -s)

install() {
    command -v slurmctld >/dev/null && command -v munged >/dev/null && return 0
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

start() {
    mkdir -p "$STATE"/{ctld,n1,n2,log}
    cat > "$CONF" <<CONF
ClusterName=minddp
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire+1 s before it may start again (the old job's credential
# must expire first); Slurm's default is 120 s, too long for a test.
AuthInfo=cred_expire=5
SlurmctldPort=6817
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# the backfill pass that starts a requeued job every second, not every 30 s
SchedulerParameters=bf_interval=1
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=300
NodeName=n[1-2] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=17001-17002 CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    mkdir -p /run/munge && chown munge:munge /run/munge
    if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        runuser -u munge -- /usr/sbin/munged
        touch "$STATE/munged.ours"
    fi
    export SLURM_CONF=$CONF
    slurmctld -f "$CONF"
    slurmd -f "$CONF" -N n1
    slurmd -f "$CONF" -N n2
    for _ in $(seq 120); do
        [ "$(sinfo -h -o %T 2>/dev/null | sort -u)" = idle ] && return 0
        sleep 0.5
    done
    echo "slurm did not come up; logs in $STATE/log" >&2
    sinfo >&2 || true
    return 1
}

stop() {
    for f in "$STATE"/slurmd-n1.pid "$STATE"/slurmd-n2.pid "$STATE"/slurmctld.pid; do
        [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
    done
    if [ -f "$STATE/munged.ours" ] && [ -f /run/munge/munged.pid ]; then
        kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
    fi
    sleep 1
    rm -rf "$STATE"
}

"${1:?usage: cluster.sh install|start|stop}"
