# instcls training image: CUDA-capable through the CUDA libraries that the pinned torch, DALI and
# NCCL wheels carry (CUDA 13.0: the host needs only an NVIDIA driver of the R580 branch or newer and the
# container toolkit; k8s/README.md "GPU nodes"); runs CPU-only too.
# Build from the repository root (`make image` does, passing the same build arguments):
#   docker build --build-arg INSTCLS_GIT_COMMIT=$(git rev-parse HEAD) \
#     --build-arg INSTCLS_GIT_DIRTY=$(git diff --quiet HEAD && echo false || echo true) -t instcls:0.2.0 .
FROM python:3.11-slim-bookworm

# tar: DALI's index writer; g++: inductor compiles CO2's fused chunk math to C++ on CPU ranks (DeepSpeed's
# CPU shared-memory op, which it would JIT-compile too, is skipped: trainer/engine/deepspeed_setup.py).
RUN apt-get update \
    && apt-get install -y --no-install-recommends tar g++ \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PYTHONUTF8=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/instcls
# Dependencies first (pinned in pyproject.toml), so code edits reuse this layer; with MLflow's client, so
# that logging.mlflow works in the image.
COPY pyproject.toml README.md ./
RUN mkdir -p trainer data_pipeline \
    && touch trainer/__init__.py data_pipeline/__init__.py \
    && pip install '.[mlflow]' \
    && pip uninstall -y instcls \
    && rm -rf build instcls.egg-info
COPY trainer ./trainer
COPY data_pipeline ./data_pipeline
COPY configs ./configs
COPY ds_configs ./ds_configs
# pip builds in the source tree: its build/ and egg-info are not part of the image.
RUN pip install --no-deps . && rm -rf build instcls.egg-info

RUN useradd --create-home --uid 1000 instcls \
    && mkdir -p /data /checkpoints \
    && chown instcls:instcls /data /checkpoints
USER instcls
# JIT-built code goes to /tmp, which the k8s manifests mount writable under their read-only root
# filesystem: C++ extensions (DeepSpeed's ops), inductor's kernels (CO2's fused chunk math) and
# Triton's cache.
ENV TORCH_EXTENSIONS_DIR=/tmp/torch_extensions \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    TRITON_CACHE_DIR=/tmp/triton

# The commit the image is built from: .dockerignore keeps .git out of the context, so the build is told
# it, and instcls reads it wherever it runs from no checkout (run.json, the model card, `instcls --version`;
# trainer/code_identity.py). DIRTY: true when tracked files differ from the commit. Declared last, so a
# new commit rebuilds no layer above.
ARG INSTCLS_GIT_COMMIT=""
ARG INSTCLS_GIT_DIRTY=""
ENV INSTCLS_GIT_COMMIT=${INSTCLS_GIT_COMMIT} \
    INSTCLS_GIT_DIRTY=${INSTCLS_GIT_DIRTY}
LABEL org.opencontainers.image.revision=${INSTCLS_GIT_COMMIT}

# `instcls launch ...` is torchrun with Kubernetes-friendly exit codes (see k8s/).
ENTRYPOINT ["instcls"]
CMD ["--help"]
