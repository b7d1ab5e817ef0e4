#!/usr/bin/env bash
# Issue 42's serving runs on the lent GPU machine (../shared/gpu/README.md), as the second call:
#   run  carry [".gpu/a"]  command: bash .gpu/a/stash.sh
#   run  carry [".gpu/b"]  command: bash bench/device_serve.sh
# Installs MLX's CUDA backend and the project (skipped on a warm machine with INSTALLED=1), then
# TESTS=1: the batch exactness tests on the device (its own pull too; TEST_ARGS: other pytest
# arguments in their place, e.g. "tests/test_batch.py -k sampled -s"; TEST_TIMEOUT, default
# 240 s); CASES (serve_load.py's, default "pooled"; "none": the tests alone), CLIENTS (default 1,4,8,16), ROUNDS (3), TOKENS
# (64); PULL=CASES also runs gpu_pull.py's cases (PULL=1: pooled-own, expertd's loop, which
# chat decodes on; e.g. PULL=pooled-own,warm for the single-sequence bars), after the serve runs;
# BATCH=N first runs batch_cpu.py --gpu with N sequences (one process, side by side, compiled and
# plain).
set -u
source "$(dirname "$0")/device_install.sh"
if [ "${TESTS:-0}" = 1 ]; then
  # shellcheck disable=SC2086  # TEST_ARGS is several words on purpose
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider \
    ${TEST_ARGS:--x tests/test_batch.py} \
    > "$OUT/tests.log" 2>&1
  echo "tests rc=$? at ${SECONDS}s"; grep -E "^(PROBE|FAILED|ERROR)" "$OUT/tests.log"
  tail -2 "$OUT/tests.log"
fi
cd bench
if [ "${BATCH:-0}" != 0 ]; then
  timeout 300 python3 batch_cpu.py --gpu --batch "$BATCH" --rounds "${ROUNDS:-3}" --tokens 32 \
    --out "$OUT/batch.json" > "$OUT/batch.log" 2>&1
  echo "batch_cpu rc=$? at ${SECONDS}s"; grep "^| \|Error\|error" "$OUT/batch.log" | tail -8
fi
if [ "${CASES:-pooled}" != none ]; then
  timeout $(( 570 - SECONDS )) python3 serve_load.py --cases "${CASES:-pooled}" \
    --clients "${CLIENTS:-1,4,8,16}" --rounds "${ROUNDS:-3}" --tokens "${TOKENS:-64}" \
    --out "$OUT/serve.json" --logs "$OUT/logs" > "$OUT/serve.log" 2>&1
  echo "serve_load rc=$? at ${SECONDS}s"; grep "^| \|clients\|Error\|error" "$OUT/serve.log" | tail -20
fi
if [ "${PULL:-0}" != 0 ]; then
  [ "$PULL" = 1 ] && PULL=pooled-own
  timeout $(( 585 - SECONDS )) python3 gpu_pull.py --cases "$PULL" --rounds "${ROUNDS:-3}" \
    --tokens 32 --out "$OUT/pull.json" > "$OUT/pull.log" 2>&1
  echo "gpu_pull rc=$? at ${SECONDS}s"; grep "^| \|Error\|error" "$OUT/pull.log" | tail -6
fi
