# syntax=docker/dockerfile:1
# specgate: the gateway (`specgate serve`, the same as python -m proxy). The same image runs the simulator for the `sim` profile.

FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY specgate ./specgate
COPY proxy ./proxy
COPY loadtest ./loadtest
COPY deploy/install-venv.sh ./deploy/install-venv.sh
RUN sh deploy/install-venv.sh /opt/venv /src

FROM python:3.11.11-slim-bookworm AS runtime
ENV PATH="/opt/venv/bin:$PATH" \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SPECGATE_HOST=0.0.0.0 \
    SPECGATE_PORT=8000
RUN groupadd --system --gid 10001 specgate \
    && useradd --system --uid 10001 --gid specgate --no-create-home --shell /usr/sbin/nologin specgate
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
WORKDIR /home/specgate
EXPOSE 8000
# No curl in a slim image: the health probe is a few lines of the Python already there.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os,sys,urllib.request; sys.exit(urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('SPECGATE_PORT','8000')}/health\", timeout=2).status != 200)"]
# `specgate serve`; the image also has `specgate doctor` and `specgate calibrate` for servers it can reach
# (docker run --rm --entrypoint specgate IMAGE doctor ...).
ENTRYPOINT ["specgate", "serve"]
