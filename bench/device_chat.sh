#!/usr/bin/env bash
# Issue 42's chat bar and its open questions on the lent GPU machine (../shared/gpu/README.md),
# as the second call:
#   run  carry [".gpu/a"]  command: bash .gpu/a/stash.sh
#   run  carry [".gpu/b"]  command: bash bench/device_chat.sh
# Installs MLX's CUDA backend and the project (skipped with INSTALLED=1), then: the chat bar
# (gpu_pull.py's pooled-own: expertd's loop at pools 25%, with the rows a decode token pulls),
# tests/test_prefill_whole.py stopping at its first failure (device-backed pools without a
# puller on CUDA), and with the time left graph_probe.py (a step's host time, resident and
# streamed). Each part's output is under $OUT.
set -u
if [ "${INSTALLED:-0}" != 1 ]; then
  bash /root/keep/a/install.sh > "$OUT/install.log" 2>&1 || { tail -5 "$OUT/install.log"; exit 1; }
  tail -1 "$OUT/install.log"; echo "installed at ${SECONDS}s"
fi
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
(cd bench && timeout 270 python3 gpu_pull.py --cases pooled-own --rounds "${ROUNDS:-3}" \
  --tokens 32 --out "$OUT/pull.json" > "$OUT/pull.log" 2>&1)
echo "gpu_pull rc=$? at ${SECONDS}s"; grep "^| \|^- \|Error" "$OUT/pull.log" | tail -9
left=$((520 - SECONDS))
if [ "$left" -gt 40 ]; then
  timeout "$left" python3 -m pytest -q -x -p no:cacheprovider tests/test_prefill_whole.py \
    > "$OUT/tests.log" 2>&1
  echo "tests rc=$? at ${SECONDS}s"; grep -E "^(FAILED|ERROR|E )" "$OUT/tests.log" | head -6
  tail -1 "$OUT/tests.log"
fi
left=$((570 - SECONDS))
if [ "$left" -gt 60 ]; then
  (cd bench && timeout "$left" python3 graph_probe.py --steps 24 --out "$OUT/gp.json" \
    > "$OUT/gp.log" 2>&1)
  echo "graph_probe rc=$? at ${SECONDS}s"; tail -40 "$OUT/gp.log"
fi
