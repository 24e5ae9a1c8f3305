# syntax=docker/dockerfile:1
# The modelship image: the Prefect worker and flow runs, the approvals service, and the
# MLflow and Prefect servers of infra/. Built from the project's wheel; the final stage has
# no compilers and runs as UID 10001.
#   docker build -t modelship:0.1.0 .

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# Extras of the wheel to install: k8s (the Kubernetes worker, Postgres for MLflow), plus
# pytorch where flow runs export mlflow.pytorch models. With pytorch, pin the torch build in
# TORCH (e.g. torch==2.13.0+cpu, found on the index in TORCH_INDEX): unpinned, a resolver
# picks a CUDA build of several GB, which the export (it runs on the CPU) does not need.
#   docker build --build-arg EXTRAS=k8s,pytorch --build-arg TORCH=torch==2.13.0+cpu \
#     --build-arg TORCH_INDEX=<PyTorch's CPU wheel index URL> -t modelship:0.1.0-torch .
ARG EXTRAS=k8s
ARG TORCH=
ARG TORCH_INDEX=

# ---- build: the wheel, then a venv with it and its dependencies --------------------
FROM ${PYTHON_IMAGE} AS build
ARG EXTRAS
ARG TORCH
ARG TORCH_INDEX
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 UV_NO_CACHE=1
RUN pip install uv==0.9.*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY modelship ./modelship
COPY flows ./flows
COPY tasks ./tasks
COPY model_registry ./model_registry
RUN uv build --wheel --out-dir /dist \
 && uv venv /opt/venv --python /usr/local/bin/python3 \
 && uv pip install --python /opt/venv/bin/python --compile-bytecode \
      "$(ls /dist/modelship-*.whl)[${EXTRAS}]" ${TORCH:+"$TORCH"} \
      ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"}

# ---- runtime: the venv, the policies, nothing else ---------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    DO_NOT_TRACK=true MLFLOW_DISABLE_TELEMETRY=true \
    PREFECT_SERVER_ANALYTICS_ENABLED=false GX_ANALYTICS_ENABLED=false \
    HOME=/tmp MODELSHIP_POLICIES_DIR=/app/policies
RUN groupadd --gid 10001 modelship \
 && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin modelship
COPY --from=build /opt/venv /opt/venv
COPY policies /app/policies
COPY prefect.yaml /app/prefect.yaml
WORKDIR /app
USER 10001:10001
ENTRYPOINT ["modelship"]
CMD ["--help"]
