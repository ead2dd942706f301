# inferd's container image: one image for every role.
#
#   docker build -t inferd .                                # base variant (no PyTorch)
#   docker build --build-arg VARIANT=llm -t inferd:llm .    # + PyTorch (CPU), GPT-2, text models
#   docker run -p 8000:8000 -v inferd-data:/data inferd serve --demo
#   docker run inferd control --listen 0.0.0.0:7070 | gateway --control HOST:7070 | replica ...
#
# Build arguments: BASE_IMAGE, a Debian bookworm image with CPython 3.11 (used by both
# stages); VARIANT, base or llm; TORCH_PIP_ARGS, where pip finds PyTorch's CPU wheel for
# the llm variant. Every Python distribution is pinned in deploy/container/requirements-*.txt
# (scripts/container-lock.sh). Podman keeps HEALTHCHECK only with --format docker.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS builder
ARG VARIANT=base
ARG TORCH_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
# The compiler is for the paged-attention kernel (and any sdist); it stays in this stage.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY deploy/container/requirements-*.txt /tmp/requirements/
RUN case "$VARIANT" in base|llm) ;; *) echo "VARIANT must be base or llm" >&2; exit 1 ;; esac \
    && python3 -m venv /opt/venv \
    && pip install -r /tmp/requirements/requirements-build.txt \
    && if [ "$VARIANT" = llm ]; then torch_args="$TORCH_PIP_ARGS"; else torch_args=; fi \
    && pip install --no-deps $torch_args -r "/tmp/requirements/requirements-$VARIANT.txt"
COPY pyproject.toml README.md /src/
COPY inferd /src/inferd
# inferd without its dependencies (all pinned above), then pip check: a lock file out of
# date with pyproject.toml fails the build here. The C kernel is compiled with portable
# flags into the package (inferd/llm/native.py loads it where there is no compiler).
RUN pip install --no-deps --no-build-isolation /src \
    && pip check \
    && python3 -m inferd.llm.native

FROM ${BASE_IMAGE}
ARG VARIANT=base
LABEL org.opencontainers.image.title="inferd" \
      org.opencontainers.image.description="inferd model server (${VARIANT} variant): serve, control, gateway, replica" \
      org.opencontainers.image.licenses="Apache-2.0"
# libgomp1: the OpenMP runtime LightGBM (and scikit-learn's wheels) load.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/inferd \
        --shell /usr/sbin/nologin inferd \
    && mkdir -p /data \
    && chown inferd:inferd /data
COPY --from=builder /opt/venv /opt/venv
COPY deploy/container/healthcheck.py /opt/inferd/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    INFERD_DATA_DIR=/data \
    INFERD_HOST=0.0.0.0
# The registry (SQLite by default), the artifact cache and the demo models live here.
VOLUME ["/data"]
WORKDIR /home/inferd
USER 10001:10001
# HTTP, gRPC, the control channel (inferd control), a joining replica (inferd replica)
EXPOSE 8000 8001 7070 9100
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["/opt/venv/bin/python3", "-I", "-S", "/opt/inferd/healthcheck.py"]
ENTRYPOINT ["inferd"]
CMD ["serve"]
