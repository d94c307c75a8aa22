#!/bin/sh
# Install specgate with its pinned runtime dependencies and the `otel` extra (the OpenTelemetry SDK:
# traces are then one OTEL_EXPORTER_OTLP_ENDPOINT away, docs/tracing.md) into a fresh virtual environment.
# The Dockerfile's build stage runs exactly this, and CI runs it too (tests/test_stack.py),
# so the image's install step is exercised on every change without a Docker engine.
# Usage: deploy/install-venv.sh VENV_DIR [SOURCE_DIR]
set -eu
venv="$1"
src="${2:-.}"
python3 -m venv "$venv"
"$venv/bin/pip" install --no-cache-dir --no-compile --disable-pip-version-check "$src[otel]"
# Smoke check: the entry points import, the settings parse, and tracing has its exporter.
"$venv/bin/python" -c "import proxy.app, proxy.config, loadtest.simulator.cli; proxy.config.Settings()"
# The command users run, installed as a console script, with every subcommand's help.
for command in serve doctor calibrate sweep compare demo; do "$venv/bin/specgate" "$command" --help >/dev/null; done
"$venv/bin/python" -c "import opentelemetry.sdk.trace, opentelemetry.exporter.otlp.proto.http.trace_exporter"
