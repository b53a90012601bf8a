#!/bin/bash
# Entry point of a Slurm node container (scripts/docker/slurm_node.Dockerfile; run with
# `docker run --init` so that tini reaps the job's processes): munged with the cluster's key,
# slurmctld on the head (SLURM_ROLE=head), then slurmd in the foreground, logging to stderr
# (`docker logs`). /cluster holds munge.key and slurm.conf, the same on every node.
set -euo pipefail
install -o munge -g munge -m 0400 /cluster/munge.key /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
runuser -u munge -- /usr/sbin/munged
install -m 0644 /cluster/slurm.conf /etc/slurm/slurm.conf
mkdir -p /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
if [ "${SLURM_ROLE:-node}" = head ]; then
  slurmctld
fi
exec slurmd -D
