#!/usr/bin/env bash
# `make demo`: bring up specs/local.yaml, publish a checkpoint into node1's agent, sync
# it to node2 and node3 (pulled by reference: node3 may read from node2 while node2 is
# still receiving), show it, tear it down (always, even on failure).
set -euo pipefail
cd "$(dirname "$0")/.."
TH=.venv/bin/th
SPEC=specs/local.yaml
CKPT=$(mktemp -d)/demo.safetensors
trap '$TH down -c demo >/dev/null 2>&1 || true; rm -rf "$(dirname "$CKPT")"' EXIT
.venv/bin/python - "$CKPT" <<'PY'
import sys, torch
from safetensors.torch import save_file
g = torch.Generator().manual_seed(0)
save_file({f"layers.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(8)}, sys.argv[1])
PY
$TH up "$SPEC"
$TH publish policy --from "$CKPT" --node node1 -c demo
$TH sync policy --node node2 -c demo
$TH sync policy --node node3 -c demo
$TH versions policy -c demo
$TH status -c demo
$TH down -c demo
trap - EXIT
rm -rf "$(dirname "$CKPT")"
