# Sourced by the device scripts (bench/device_*.sh) on the lent GPU machine, after the first
# call's `bash .gpu/a/stash.sh` (../shared/gpu/README.md): installs MLX's CUDA backend and the
# project (a warm machine skips it with INSTALLED=1; a failed install ends the script), then
# sets the environment the benches run in.
if [ "${INSTALLED:-0}" != 1 ]; then
  bash /root/keep/a/install.sh > "$OUT/install.log" 2>&1 || { tail -5 "$OUT/install.log"; exit 1; }
  tail -1 "$OUT/install.log"; echo "installed at ${SECONDS}s"
fi
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
