#!/usr/bin/env bash
# Issue 24's device runs, as the second call on the lent GPU machine (../shared/gpu/README.md):
#   run  carry [".gpu/a"]  command: bash .gpu/a/stash.sh
#   run  carry [".gpu/b"]  command: bash bench/device_issue24.sh
# Installs MLX's CUDA backend and the project, then: the host's cost to build a block's call,
# compiled and plain rounds alternating (token_times.py), and the bars (gpu_pull.py). Logs
# and JSON go to $OUT; each step has a time bound, so one that hangs leaves time for the next.
set -u
bash /root/keep/a/install.sh > "$OUT/install.log" 2>&1 || { tail -5 "$OUT/install.log"; exit 1; }
tail -1 "$OUT/install.log"; echo "installed at ${SECONDS}s"
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
cd bench
timeout 150 python3 build_probe.py > "$OUT/build.log" 2>&1; echo "build_probe rc=$? (synthesizes the model the rest reuse)"
tail -4 "$OUT/build.log"
timeout 150 python3 token_times.py --rounds 8 --tokens 64 --variants default plain \
  --out "$OUT/tt.json" > "$OUT/tt.log" 2>&1; echo "token_times rc=$? at ${SECONDS}s"
grep -v slowest "$OUT/tt.log" | grep -v "median ms" | tail -10
timeout $(( 570 - SECONDS )) python3 gpu_pull.py --cases pooled-own,warm,rate --tokens 48 \
  --out "$OUT/pull.json" > "$OUT/pull.log" 2>&1; echo "gpu_pull rc=$? at ${SECONDS}s"
grep "^| \|^Resident\|^- " "$OUT/pull.log" | tail -12
