#!/usr/bin/env bash
# graph_probe.py on the lent GPU machine (../shared/gpu/README.md), as the second call:
#   run  carry [".gpu/a"]  command: bash .gpu/a/stash.sh
#   run  carry [".gpu/b"]  command: bash bench/device_graphs.sh
# Installs MLX's CUDA backend and the project (skipped with INSTALLED=1), then runs the probe
# under each of VARIANTS (space-separated; "default" or NAME=VALUE of MLX's environment), and
# once with MLX_SAVE_CUDA_GRAPHS_DOT_FILE for the CUDA graphs' counts (DOTS=0 skips it).
set -u
source "$(dirname "$0")/device_install.sh"
cd bench
summary() {  # one line a phase: build / encode / wait / check ms, graphs and nodes a step
  python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))
for k in ('resident', 'streamed', 'streamed_again', 'resident_again'):
    p = r.get(k)
    if p:
        print(sys.argv[2], k, ' '.join(f'{n}={v:.2f}' for n, v in p.items() if isinstance(v, float)))
" "$1" "$2"
}
for v in ${VARIANTS:-default MLX_USE_CUDA_GRAPHS=0 MLX_MAX_OPS_PER_BUFFER=400}; do
  if [ "$v" = default ]; then e=(); else e=("$v"); fi
  env "${e[@]}" timeout "${PROBE_TIMEOUT:-150}" python3 graph_probe.py --out "$OUT/gp_$v.json" \
    > "$OUT/gp_$v.log" 2>&1
  echo "$v rc=$? at ${SECONDS}s"; summary "$OUT/gp_$v.json" "$v" 2>/dev/null || tail -3 "$OUT/gp_$v.log"
done
if [ "${DOTS:-1}" = 1 ]; then
  rm -rf /tmp/dots && mkdir -p /tmp/dots
  MLX_SAVE_CUDA_GRAPHS_DOT_FILE=/tmp/dots/g timeout 150 python3 graph_probe.py --steps 8 \
    --out "$OUT/gp_dots.json" > "$OUT/gp_dots.log" 2>&1
  echo "dots rc=$? at ${SECONDS}s"; summary "$OUT/gp_dots.json" dots 2>/dev/null || tail -3 "$OUT/gp_dots.log"
  ls /tmp/dots | tail -3 | while read -r f; do cp "/tmp/dots/$f" "$OUT/"; done
fi
