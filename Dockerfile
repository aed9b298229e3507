# streamlog images. `docker build .` makes the server (the last stage); docker-compose.yml also
# builds the `demo` (example producer and workers) and `spark` (the Spark job) targets.
#
# Builder stages install into virtualenvs under /opt; runtime stages copy only those venvs onto
# a clean slim Python, so nothing used to build (grpcio-tools, pip caches, the source tree)
# reaches a runtime image. Every runtime stage runs as the unprivileged user 10001.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------- build
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Code generation runs in a venv of its own, left behind in this stage.
RUN python -m venv /opt/codegen \
 && /opt/codegen/bin/pip install "grpcio-tools>=1.85,<2"
COPY protos/ protos/
RUN /opt/codegen/bin/python protos/generate.py
COPY pyproject.toml README.md ./
COPY service/ service/
COPY storage/ storage/
COPY clients/ clients/
COPY pyspark_streamlog/ pyspark_streamlog/
# A regular (not editable) install: the venv holds the package and its dependencies, nothing
# points back into /src. pip itself is removed: a runtime image installs nothing.
RUN python -m venv /opt/streamlog \
 && /opt/streamlog/bin/pip install . \
 && /opt/streamlog/bin/pip uninstall --yes pip setuptools

# The Spark job's venv: the same package with the `spark` extra (PySpark, Arrow, pandas).
FROM builder AS spark-builder
RUN python -m venv --clear /opt/streamlog \
 && /opt/streamlog/bin/pip install ".[spark]" \
 && /opt/streamlog/bin/pip uninstall --yes pip setuptools

# ---------------------------------------------------------------------------- demo: producer, workers
FROM ${PYTHON_IMAGE} AS demo
# /state: the examples' own SQLite databases (a named volume in docker-compose.yml takes its owner).
RUN groupadd --system --gid 10001 streamlog \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin streamlog \
 && mkdir /state \
 && chown 10001:10001 /state
COPY --from=builder /opt/streamlog /opt/streamlog
COPY examples/ /app/examples/
WORKDIR /app
ENV PATH="/opt/streamlog/bin:${PATH}" PYTHONPATH=/app PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
VOLUME ["/state"]

# ---------------------------------------------------------------------------- spark: the streaming job
FROM ${PYTHON_IMAGE} AS spark
# Spark runs on the JVM: a headless Java runtime, not a compiler.
# /checkpoints: Spark's checkpoint location, a volume so a restarted job resumes where it was.
RUN apt-get update \
 && apt-get install --yes --no-install-recommends openjdk-17-jre-headless \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 streamlog \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/streamlog \
      --shell /usr/sbin/nologin streamlog \
 && mkdir /checkpoints \
 && chown 10001:10001 /checkpoints
COPY --from=spark-builder /opt/streamlog /opt/streamlog
COPY examples/ /app/examples/
# Spark writes scratch files under the working directory: the user's home, not /app.
WORKDIR /home/streamlog
ENV PATH="/opt/streamlog/bin:${PATH}" PYTHONPATH=/app PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PYSPARK_PYTHON=/opt/streamlog/bin/python
USER 10001:10001
VOLUME ["/checkpoints"]

# ---------------------------------------------------------------------------- server (default)
FROM ${PYTHON_IMAGE} AS server
RUN groupadd --system --gid 10001 streamlog \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin streamlog \
 && mkdir /data \
 && chown 10001:10001 /data
COPY --from=builder /opt/streamlog /opt/streamlog
# No STREAMLOG_* settings here: variables override the TOML file (STREAMLOG_CONFIG), so a value
# baked into the image would silently beat the operator's file. Defaults come from the code.
ENV PATH="/opt/streamlog/bin:${PATH}" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001:10001
VOLUME ["/data"]
# gRPC; the optional plaintext health port (health_port); Prometheus metrics (metrics_port).
EXPOSE 7070 7071 9464
# The probe reads the same settings as the server (STREAMLOG_CONFIG, STREAMLOG_*) to find it.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-m", "service.probe", "--timeout", "4"]
# SIGTERM drains (shutdown_grace_ms), syncs and closes every stream, then exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["streamlog", "serve"]
CMD ["--data", "/data", "--host", "0.0.0.0"]
