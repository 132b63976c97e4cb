# vitserve on a GPU node: docker build -t vitserve . && docker run --gpus all -p 8000:8000 vitserve --model ...
# Build stage: build the wheel (the runtime stage gets no compilers or build tools).
ARG BASE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime

FROM ${BASE} AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY vitserve ./vitserve
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE}
# torch comes with the base image; the rest from the wheel's declared dependencies, with the attention kernels,
# video decoding (PyAV, and PyNvVideoCodec for --video-decoder nvdec) and the encoder tiers (vLLM's identifiers,
# SGLang's ZMQ)
COPY --from=build /wheels /wheels
RUN python -m pip install --no-cache-dir "$(echo /wheels/vitserve-*.whl)[gpu,video,nvdec,ec,sglang]" && rm -rf /wheels \
    && useradd --create-home --uid 1000 --shell /usr/sbin/nologin vitserve \
    && mkdir -p /data && chown 1000:1000 /data
ENV HF_HOME=/data \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility,video \
    VITSERVE_HOST=0.0.0.0 \
    VITSERVE_PORT=8000 \
    PYTHONUNBUFFERED=1
# a host directory mounted at /data must be writable by uid 1000 (chown 1000:1000 DIR, or docker run --user)
VOLUME ["/data"]
USER 1000:1000
EXPOSE 8000
# healthy once /ready answers 200 on the port the server bound, whatever flags or variables set it (the check reads
# the server's command line and environment); the start period covers the weight load and graph capture
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-m", "vitserve.service.entry.healthcheck"]
ENTRYPOINT ["vitserve", "serve"]
CMD ["--model", "Qwen/Qwen2.5-VL-7B-Instruct"]
