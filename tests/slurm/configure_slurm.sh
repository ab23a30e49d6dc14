#!/usr/bin/env bash
# Writes the configuration of a throwaway Slurm cluster on emulated hosts
# (tests/testing/emulated_hosts.h): slurmctld and slurmdbd on host0, one slurmd
# per host, munge for authentication, MariaDB behind slurmdbd so that `sacct`
# answers. Everything lives under DIR; nothing under /etc is read or written.
#
#   configure_slurm.sh DIR HOST_COUNT CPUS_PER_HOST
#
# Writes DIR/etc/{slurm.conf,gres.conf,slurmdbd.conf,munge.key} and an empty
# MariaDB data directory DIR/db. Host k is "host<k>" at 198.18.0.(k+1), the
# emulated hosts' names and addresses. Each node declares one GPU whose device
# file is /dev/null (slurmd drops a GPU without a file):
# deploy/slurm/zeroshard.sbatch asks for one GPU per task, and the workers here
# train on CPUs (ZS_BACKEND=gloo), so only Slurm's bookkeeping of the GPU is
# exercised.
set -euo pipefail
if [[ $# -ne 3 ]]; then
  echo "usage: configure_slurm.sh DIR HOST_COUNT CPUS_PER_HOST" >&2
  exit 2
fi
dir=$1 hosts=$2 cpus=$3
[[ "$hosts" =~ ^[1-9]$ ]] || { echo "HOST_COUNT must be 1..9, not '$hosts'" >&2; exit 2; }
[[ "$cpus" =~ ^[1-9][0-9]*$ ]] || { echo "CPUS_PER_HOST must be a positive integer, not '$cpus'" >&2; exit 2; }
mkdir -p "$dir/etc" "$dir/ctld" "$dir/log" "$dir/run"
for ((k = 0; k < hosts; k++)); do mkdir -p "$dir/spool/host$k"; done
chmod 0755 "$dir" "$dir/etc"

# munged refuses a key anyone else can read.
head -c 1024 /dev/urandom >"$dir/etc/munge.key"
chmod 0600 "$dir/etc/munge.key"

nodes=""
for ((k = 0; k < hosts; k++)); do
  nodes+="NodeName=host$k NodeAddr=198.18.0.$((k + 1)) CPUs=$cpus Gres=gpu:1 State=UNKNOWN"$'\n'
done

cat >"$dir/etc/slurm.conf" <<EOT
ClusterName=zstest
SlurmctldHost=host0(198.18.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/run/munge.sock
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: the emulated hosts share one cgroup tree (and this machine's
# refuses delegation); processes are tracked by their parent chain.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=198.18.0.1
# slurmctld's connection to slurmdbd takes its munge socket from here, not
# from AuthInfo.
AccountingStoragePass=$dir/run/munge.sock
AccountingStorageTRES=gres/gpu
JobCompType=jobcomp/none
# A node whose slurmd stops answering is DOWN after SlurmdTimeout; its jobs
# fail with NODE_FAIL (and a --requeue job runs again). Short, for the test.
SlurmdTimeout=5
SlurmctldTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
ReturnToService=2
MessageTimeout=4
SchedulerParameters=batch_sched_delay=0
$nodes
PartitionName=zs Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOT

# slurmd loads a cgroup plugin even with proctrack/linuxproc and task/none;
# its autodetection fails on this tmpfs-over-v1 layout, so name v1.
cat >"$dir/etc/cgroup.conf" <<EOT
CgroupPlugin=cgroup/v1
EOT

cat >"$dir/etc/gres.conf" <<EOT
Name=gpu File=/dev/null
EOT

# slurmdbd refuses a configuration file others can read (it may hold a
# password; this one holds none: MariaDB runs with --skip-grant-tables).
cat >"$dir/etc/slurmdbd.conf" <<EOT
AuthType=auth/munge
AuthInfo=socket=$dir/run/munge.sock
DbdHost=host0
DbdAddr=198.18.0.1
SlurmUser=root
PidFile=$dir/run/slurmdbd.pid
LogFile=$dir/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3306
StorageUser=root
StorageLoc=slurm_acct_db
EOT
chmod 0600 "$dir/etc/slurmdbd.conf"

# A small InnoDB: the database holds a few jobs.
mariadb-install-db --no-defaults --datadir="$dir/db" --user=root --skip-test-db \
  --auth-root-authentication-method=normal >"$dir/log/mariadb-install.log" 2>&1 ||
  { echo "mariadb-install-db failed:" >&2; cat "$dir/log/mariadb-install.log" >&2; exit 1; }
