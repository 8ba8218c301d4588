#!/usr/bin/env bash
# `make demo`: bring up specs/local.yaml, show it, tear it down (always, even on failure).
set -euo pipefail
cd "$(dirname "$0")/.."
TH=.venv/bin/th
SPEC=specs/local.yaml
trap '$TH down -c demo >/dev/null 2>&1 || true' EXIT
$TH up "$SPEC"
$TH status -c demo
# The publish → sync step joins here once the data plane lands (`th publish`, `th sync`).
$TH down -c demo
trap - EXIT
