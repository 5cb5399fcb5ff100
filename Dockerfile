# Trainer image: the project installed on a slim Python, entrypoint `python -m trainer.train`.
# The JAX flavour is a build argument:
#   docker build -t trainer:cpu .                                  # CPU (default): tests, multi-host CPU
#   docker build --build-arg JAX_EXTRA=cuda12 -t trainer:gpu .     # NVIDIA GPUs (CUDA 12 wheels, no CUDA base image needed)
#   docker build --build-arg JAX_EXTRA=tpu -t trainer:tpu .        # TPU VMs and the Pathways controller (head pod)
# Run: docker run --rm trainer:cpu                                 # = python -m trainer.train base.yml
#      docker run --rm trainer:cpu base.yml steps=10 model=qwen3-tiny   # any args replace the default config
# Push (Artifact Registry): see docs/running_at_scale.md.
# BASE_IMAGE: the slim Python the image is built on, pinned by digest (the official image's multi-arch
# index), so every rebuild gets the same OS and Python. 3.11 by default; the other Python constraints/ pins a
# tested set for is 3.12:
#   --build-arg BASE_IMAGE=python:3.12-slim@sha256:229a2c5bfa27522db7815ea81f9bed70af17ccb9de9fc7ad142b1877b5830d36
# A newer base: the digest `docker buildx imagetools inspect python:3.11-slim` prints; or a mirror's copy.
ARG BASE_IMAGE=python:3.11-slim@sha256:90744cff8f32887f075c47d747a173ff333e9e98801667af93c357fa9f5e28ff
FROM ${BASE_IMAGE}

ARG JAX_EXTRA=cpu
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TRAINER_CONFIGS_DIR=/app/configs \
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1
WORKDIR /app

# 1. Dependencies only (the slow, rarely changing layer): read them from pyproject.toml, so editing the
#    code does not reinstall JAX. jax[<flavour>] pulls the accelerator plugin (CUDA 12 wheels, libtpu).
#    Exact versions from constraints/<flavour>-py<X.Y>.txt (constraints/README.md): the JAX and Orbax the
#    trainer's internals were checked against, the same on every rebuild.
COPY pyproject.toml ./
COPY constraints ./constraints
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && jax_pin=$(grep -E '^jax[<>=! ]' /tmp/requirements.txt | sed 's/^jax//') \
    && pins="constraints/${JAX_EXTRA}-py$(python -c 'import sys; print(*sys.version_info[:2], sep=".")').txt" \
    && pip install -c "${pins}" "setuptools>=70.1" "jax[${JAX_EXTRA}]${jax_pin}" -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# 2. The project. Installed in editable mode so the package stays at /app/trainer and finds the bundled
#    configs/ and data/ (tokenizer, sample shards) next to it; --no-deps: step 1 installed them.
COPY README.md ./
COPY trainer ./trainer
COPY configs ./configs
COPY data ./data
COPY scripts ./scripts
RUN pip install --no-deps --no-build-isolation -e . \
    && python -c "import trainer.train, trainer.config" \
    && useradd --create-home --uid 1000 --shell /usr/sbin/nologin trainer \
    && mkdir -p /app/runs && chown trainer:trainer /app/runs

# Runs as an unprivileged user. Default outputs go to /app/runs (mount a volume there, or pass
# base_output_directory=gs://...). Kubernetes pods that need root can set securityContext.runAsUser: 0.
USER trainer
ENTRYPOINT ["python", "-m", "trainer.train"]
CMD ["base.yml"]
