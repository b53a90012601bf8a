# A Slurm node for tests/launcher/test_slurm_nodes.py: the rlstream image plus munge, slurmd,
# slurmctld, the Slurm client tools and redis-server (the job starts its own Redis on a node).
# Built on the rlstream image the compose test builds, so both tests share its layers:
#
#   docker build -t rlstream-slurm-node --build-arg RLSTREAM_IMAGE=rlstream:latest \
#     -f scripts/docker/slurm_node.Dockerfile scripts/docker
#
# Run one container per node on a user-defined bridge network, with --hostname equal to the
# container name (Slurm node names resolve through Docker's DNS) and /cluster holding the
# cluster's munge.key and slurm.conf (the same files on every node); SLURM_ROLE=head also
# starts slurmctld. Slurm and the tasks run as root here: a test cluster, not a login setup.
ARG RLSTREAM_IMAGE=rlstream:latest
FROM ${RLSTREAM_IMAGE}
USER root
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      munge slurmd slurmctld slurm-client redis-server procps iproute2 \
 && rm -rf /var/lib/apt/lists/*
COPY slurm_node.sh /usr/local/bin/slurm-node
WORKDIR /root
ENTRYPOINT ["/usr/local/bin/slurm-node"]
