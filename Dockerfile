# phi2-server on PyTorch (CPU). Run it with `make docker-run` or `docker compose up -d`
# (README, "Docker"). RUN --mount needs BuildKit (Docker's default builder) or podman.
FROM python:3.11-slim

# Where packages come from, overridable per builder with --build-arg (the image's history
# records them: no credentials in these URLs). torch comes from the PyTorch CPU index: on Linux
# x86-64, PyPI's torch is the multi-GB CUDA build. Wheels put in wheels/ are candidates too
# (CI here cannot reach the PyTorch index: see .ci/run).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL=https://pypi.org/simple

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# g++: the CPU kernels for llama.cpp's block types (a GGUF file served as stored, PHI2_QUANTIZE=q8_0
# and kin) are compiled at the first start that needs them, for the machine the container runs on
# (backends/torch/cpu/kernels.py); they cannot be built into the image for a CPU not known yet.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
 && rm -rf /var/lib/apt/lists/*

# uid 1000 owns ~/.cache/huggingface on most Linux hosts, so the mounted cache is writable.
RUN useradd --create-home --uid 1000 --user-group phi2 \
 && install -d -o phi2 -g phi2 /home/phi2/.cache /home/phi2/.cache/huggingface /var/log/phi2-server

WORKDIR /app
COPY requirements-linux.txt ./
# torch alone first, at the version requirements-linux.txt pins (read as a constraint), from
# TORCH_INDEX_URL; then the rest from PIP_INDEX_URL, which finds torch already installed.
RUN --mount=type=bind,source=wheels,target=/wheels \
    pip install --no-cache-dir --find-links /wheels --index-url "$TORCH_INDEX_URL" \
        --constraint requirements-linux.txt torch \
 && pip install --no-cache-dir --find-links /wheels -r requirements-linux.txt

COPY backends/ backends/
COPY phi2_server.py ./
# The answers' schemas /openapi.json serves (phi2_server.py loads them when it makes the app).
COPY docs/openapi-answers.json docs/

# Listen on all interfaces inside the container; publish the port on the host's loopback only.
ENV HOST=0.0.0.0 \
    PORT=8000 \
    LOG_DIR=/var/log/phi2-server \
    HF_HOME=/home/phi2/.cache/huggingface
# Numeric, so runtimes that verify a non-root user (Kubernetes runAsNonRoot) can.
USER 1000:1000
EXPOSE 8000
# No curl in the slim image: urllib raises on /ready's 503, so the check fails until the model
# is loaded. The long start period covers a first start that downloads Phi-2's 5.6 GB.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ[\"PORT\"]}/ready', timeout=4)"]
CMD ["python", "phi2_server.py"]
