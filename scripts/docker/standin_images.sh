#!/usr/bin/env bash
# Local stand-ins for the official base images of docker-compose.yml, built from Debian
# packages, for a Docker engine that reaches the Debian and Python package registries but
# no image registry (this project's CI machine). Needs root (debootstrap) and a running
# Docker engine (DOCKER_HOST); the docker CLI is $DOCKER (default: docker).
#
#   bash scripts/docker/standin_images.sh        # builds what is missing, prints the env to use
#
#   rlstream-standin/debian:bookworm  debootstrap --variant=minbase bookworm, `docker import`ed
#   rlstream-standin/python:3.11      + python3 (3.11), venv            for python:3.11-slim
#   rlstream-standin/redis:7          + redis-server, runs as redis     for redis:7.4
#   rlstream-standin/etcd:3           + etcd server and etcdctl         for quay.io/coreos/etcd
#
# The Debian image is made once (a label records the suite); the others are `docker build`s
# that the build cache answers in a second when nothing changed. No CA bundle goes in: apt
# uses the plain-http Debian mirror, and the rlstream build gets the CA as a build secret.
set -euo pipefail
DOCKER="${DOCKER:-docker}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
PREFIX=rlstream-standin
log() { echo "[standin] $*" >&2; }

debian="$PREFIX/debian:$SUITE"
if [ "$("$DOCKER" image inspect -f '{{index .Config.Labels "rlstream.standin"}}' "$debian" 2>/dev/null)" != "$SUITE-minbase" ]; then
  command -v debootstrap >/dev/null || { log "debootstrap not found: apt-get install -y debootstrap"; exit 1; }
  rootfs="$(mktemp -d /var/tmp/rlstream-rootfs.XXXXXX)"
  trap 'rm -rf "$rootfs"' EXIT
  log "debootstrap --variant=minbase $SUITE ($MIRROR) ..."
  debootstrap --variant=minbase "$SUITE" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 \
    || { tail -20 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
  rm -f "$rootfs.log"
  # Like the official Debian images: services never start during `apt-get install`, no caches.
  printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
  chmod 755 "$rootfs/usr/sbin/policy-rc.d"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | "$DOCKER" import \
    --change 'ENV LANG=C.UTF-8' --change "LABEL rlstream.standin=$SUITE-minbase" --change 'CMD ["bash"]' \
    - "$debian" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
  log "imported $debian"
fi

build() {  # build TAG (Dockerfile on stdin, no context)
  log "docker build $1"
  DOCKER_BUILDKIT=1 "$DOCKER" build -q -t "$1" - >/dev/null
}
APT='apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends'

build "$PREFIX/python:3.11" <<EOF
FROM $debian
RUN $APT python3 python3-venv python-is-python3 ca-certificates && rm -rf /var/lib/apt/lists/*
CMD ["python3"]
EOF

build "$PREFIX/redis:7" <<EOF
FROM $debian
RUN $APT redis-server redis-tools && rm -rf /var/lib/apt/lists/* \\
 && mkdir /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server"]
EOF

build "$PREFIX/etcd:3" <<EOF
FROM $debian
RUN $APT etcd-server etcd-client && rm -rf /var/lib/apt/lists/* \\
 && mkdir /etcd-data && chown etcd:etcd /etcd-data
USER etcd
EXPOSE 2379 2380
CMD ["etcd"]
EOF

echo "RLSTREAM_BASE_IMAGE=$PREFIX/python:3.11"
echo "REDIS_IMAGE=$PREFIX/redis:7"
echo "ETCD_IMAGE=$PREFIX/etcd:3"
