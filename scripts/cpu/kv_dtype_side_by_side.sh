#!/usr/bin/env bash
# Two of our float32 servers side by side: KV cache float32 (auto) vs --kv-cache-dtype fp16 (issue 19),
# through scripts/cpu/ours_side_by_side.sh (anchor workload, interleaved A B, B A). NEVER RUN IN CI.
#
# usage: scripts/cpu/kv_dtype_side_by_side.sh [--concurrency 16,64] [--out DIR]
# env: as scripts/cpu/ours_side_by_side.sh
set -euo pipefail
exec "$(dirname "$0")/ours_side_by_side.sh" --labels kv-f32,kv-fp16 --b-flags "--kv-cache-dtype fp16" \
  --out /tmp/kv-dtype-side-by-side "$@"
