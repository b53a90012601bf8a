# rlstream image: the `rlstream` CLI in a virtualenv, CPU (default) or CUDA torch, run as a
# non-root user. Needs BuildKit (the default of `docker compose` v2 and of `docker build`
# with buildx; Debian's docker 20.10 and compose v1: DOCKER_BUILDKIT=1).
#
#   docker build -t rlstream .                       # CPU torch from the CPU wheel index
#   docker build -t rlstream:cu124 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 .
#
# Behind a TLS-intercepting proxy, or with torch from a local wheel folder instead of an index
# (what tests/launcher/test_compose_up.py does; docs/launcher.md):
#
#   docker build -t rlstream-torch-wheels -f scripts/docker/wheels.Dockerfile /opt/wheels
#   docker build -t rlstream --secret id=ca_bundle,src=/etc/ssl/certs/ca-certificates.crt \
#     --build-arg TORCH_WHEELS_IMAGE=rlstream-torch-wheels --build-arg RLSTREAM_BASE_IMAGE=... .
#
# The CA bundle is a build secret: mounted for the pip runs of the build stage only, it is
# in no layer and no build argument of the image. docker-compose.yml builds this file for
# the prepare/engine/producer/trainer/report/inspect services.
ARG RLSTREAM_BASE_IMAGE=python:3.11-slim
# An image holding torch wheels at its root (scripts/docker/wheels.Dockerfile); the default,
# an empty stage, means torch comes from TORCH_INDEX.
ARG TORCH_WHEELS_IMAGE=no-local-wheels

FROM scratch AS no-local-wheels
FROM ${TORCH_WHEELS_IMAGE} AS torch-wheels

# ---------------------------------------------------------------- requirements.txt
# What pip installs besides rlstream, read from pyproject.toml. COPY --from below is cached by
# content, so the install layer only reruns when this list changes.
FROM ${RLSTREAM_BASE_IMAGE} AS requirements
COPY pyproject.toml /tmp/pyproject.toml
RUN python3 -c "import tomllib; t = tomllib.load(open('/tmp/pyproject.toml', 'rb')); p = t['project']; \
print('\n'.join(t['build-system']['requires'] + p['dependencies'] + p['optional-dependencies']['etcd'] \
+ p['optional-dependencies']['math']))" > /tmp/requirements.txt

# ---------------------------------------------------------------- build: the virtualenv
FROM ${RLSTREAM_BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
# The CPU wheel index keeps the image small; a CUDA index gives a GPU trainer.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=120 PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv

# torch first and pinned (a bare `torch` from PyPI is the multi-GB CUDA build): from the
# local wheels when there is one for this version (its dependencies then come from PyPI),
# else from TORCH_INDEX; never torch itself from PyPI.
RUN --mount=type=bind,from=torch-wheels,target=/wheels \
    --mount=type=secret,id=ca_bundle \
    --mount=type=cache,target=/root/.cache/pip \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi; \
    if ls /wheels/torch-"${TORCH_VERSION}"[+-]*.whl >/dev/null 2>&1; then \
      pip install --no-deps --no-index --find-links /wheels "torch==${TORCH_VERSION}" \
      && pip install "torch==${TORCH_VERSION}"; \
    else \
      pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"; \
    fi

# The dependencies and build requirements (from the requirements stage): an edit of the code
# or of pyproject.toml that leaves them alone reinstalls nothing (rlstream itself is
# installed in the last stage).
COPY --from=requirements /tmp/requirements.txt /tmp/requirements.txt
RUN --mount=type=secret,id=ca_bundle \
    --mount=type=cache,target=/root/.cache/pip \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi; \
    pip install -r /tmp/requirements.txt "torch==${TORCH_VERSION}"

# ---------------------------------------------------------------- the image
FROM ${RLSTREAM_BASE_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    OMP_NUM_THREADS=1 \
    MPLCONFIGDIR=/tmp/matplotlib
# Runs, checkpoints and shared weights live on a volume mounted at /work/runs; a fresh named
# volume takes this folder's owner, so the non-root user can write it.
RUN useradd --create-home --uid 10001 --user-group rlstream \
 && mkdir -p /work/runs && chown -R rlstream:rlstream /work
COPY --from=build /opt/venv /opt/venv
# The whole checkout (pyproject names README.md; configs at /opt/rlstream/configs, where
# RLSTREAM_CONFIG in docker-compose.yml points); .dockerignore keeps runs, venvs, .git out.
# Installed offline: the build requirements are in the virtualenv already.
COPY . /opt/rlstream
RUN pip install --no-deps --no-build-isolation --no-cache-dir /opt/rlstream \
 && rm -rf /opt/rlstream/build /opt/rlstream/*.egg-info
USER rlstream
WORKDIR /work
ENTRYPOINT ["rlstream"]
CMD ["--help"]
