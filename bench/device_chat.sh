#!/usr/bin/env bash
# Issue 42's chat bar on the lent GPU machine (../shared/gpu/README.md), as the second call:
#   run  carry [".gpu/a"]  command: bash .gpu/a/stash.sh
#   run  carry [".gpu/b"]  command: bash bench/device_chat.sh
# Installs MLX's CUDA backend and the project (skipped with INSTALLED=1), then:
#   1. graph_probe.py: a decode step's host time (build, encode, check) resident and streamed,
#      and streamed with the statuses joined by mx.concatenate instead of CudaPuller.join
#      (MLX_SAVE_CUDA_GRAPHS_DOT_FILE set: the graph nodes a step encodes);
#   2. the chat bar: gpu_pull.py's pooled-own (expertd's loop at pools 25%), ROUNDS rounds of
#      TOKENS tokens (default 7 of 128: rounds of 32 tokens, about 0.1 s each, ranged 0.70-0.92
#      on one code);
#   3. unless GRAPHS_OFF=0, the chat bar again (3 rounds) with MLX_USE_CUDA_GRAPHS=0 for both
#      models: graph_probe's encode fell from 4.93 to 3.28 ms a resident step without CUDA
#      graphs on 2026-12-07, but that run wrote the graphs' DOT files, which the run without
#      graphs did not;
#   4. with TESTS=1 and the time left, tests/test_prefill_whole.py on CUDA (6 of its 16 cases
#      passed there in 275 s on 2026-12-07).
# Each part's output is under $OUT.
set -u
source "$(dirname "$0")/device_install.sh"
mkdir -p "$OUT/dots"
(cd bench && MLX_SAVE_CUDA_GRAPHS_DOT_FILE="$OUT/dots/g" timeout 150 python3 graph_probe.py \
  --steps 24 --out "$OUT/gp.json" > "$OUT/gp.log" 2>&1)
echo "graph_probe rc=$? at ${SECONDS}s"
rm -rf "$OUT/dots"
python3 - "$OUT/gp.json" <<'PY' || true
import json, sys
for k, v in json.load(open(sys.argv[1])).items():
    if isinstance(v, dict) and "build_ms" in v:
        print(k, {a: round(b, 3) for a, b in v.items()})
PY
chat_bar() {  # NAME ROUNDS UNTIL (seconds into the script), in the environment given
  (cd bench && timeout $(($3 - SECONDS)) python3 gpu_pull.py --cases pooled-own --rounds "$2" \
    --tokens "${TOKENS:-128}" --out "$OUT/$1.json" > "$OUT/$1.log" 2>&1)
  echo "$1 rc=$? at ${SECONDS}s"; grep "^| \|^- \|Error" "$OUT/$1.log" | tail -9
}
chat_bar pull "${ROUNDS:-7}" 420
if [ "${GRAPHS_OFF:-1}" = 1 ] && [ $((560 - SECONDS)) -gt 120 ]; then
  MLX_USE_CUDA_GRAPHS=0 chat_bar pull_nographs 3 560
fi
left=$((580 - SECONDS))
if [ "${TESTS:-0}" = 1 ] && [ "$left" -gt 40 ]; then
  timeout "$left" python3 -m pytest -q -x -p no:cacheprovider tests/test_prefill_whole.py \
    > "$OUT/tests.log" 2>&1
  echo "tests rc=$? at ${SECONDS}s"; grep -E "^(FAILED|ERROR|E )" "$OUT/tests.log" | head -6
  tail -1 "$OUT/tests.log"
fi
