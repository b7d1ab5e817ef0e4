#!/usr/bin/env bash
# Issue 24's prefill pulls on the lent GPU machine (../shared/gpu/README.md), as the second call:
#   run  carry [".gpu/a"]  command: bash .gpu/a/stash.sh
#   run  carry [".gpu/b"]  command: bash bench/device_prefill.sh
# Installs MLX's CUDA backend and the project, then gpu_pull.py's cases (CASES, default the
# pools-25% one): decode and a 512-token prompt's first token next to resident mlx-lm, the
# prompt both speculative (one wait) and waiting per layer, in alternating rounds. ROUNDS
# (default 5) sets the rounds; TESTS (pytest's -k and the like) runs the pull tests there
# first, and PROBE (a family) bench/resident_probe.py before them (a fresh machine builds MLX's
# CUDA kernels for about 200 s; CASES=none then skips gpu_pull.py); a warm machine skips the
# install when INSTALLED=1.
set -u
source "$(dirname "$0")/device_install.sh"
if [ -n "${PROBE:-}" ]; then  # resident mlx-lm twice on a family's tiny model, e.g. PROBE=deepseek_v3
  timeout 330 python3 bench/resident_probe.py --family "$PROBE" > "$OUT/probe.log" 2>&1
  echo "probe rc=$? at ${SECONDS}s"; grep -v INFO "$OUT/probe.log" | cut -c1-300 | tail -12
fi
if [ -n "${TESTS:-}" ]; then  # the device's pulls in the suite's exactness tests, e.g. TESTS=-k device
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_prompt_pull.py tests/test_pull.py \
    $TESTS > "$OUT/tests.log" 2>&1; echo "tests rc=$? at ${SECONDS}s"; tail -3 "$OUT/tests.log"
fi
[ "${CASES:-}" = none ] && exit 0  # the probe or the tests alone
cd bench
timeout $(( 585 - SECONDS )) python3 gpu_pull.py --cases "${CASES:-pooled-own}" \
  --rounds "${ROUNDS:-5}" --tokens 32 --out "$OUT/prefill.json" > "$OUT/prefill.log" 2>&1
echo "gpu_pull rc=$? at ${SECONDS}s"
grep "^| \|^- \|Error\|error" "$OUT/prefill.log" | tail -12
