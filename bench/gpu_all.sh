#!/usr/bin/env bash
# Every GPU check and benchmark in one device call (about 5 minutes on an H200), results under ${OUT:-out}/.
# `bench/gpu_all.sh multi` runs only the 1-vs-2-GPU benchmarks (a call of their own on a 2-GPU machine: about 4
# minutes, too much beside the rest for one 10-minute call).
# Needs the service wheels there (../shared/tools/gpu-wheels httptools py-spy, carried as .whl).
set -u
out=${OUT:-out}; mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$SITE$PWD
if [ "${1:-}" = multi ]; then
  {
    # the defaults (a process per GPU); then one GPU with the tower cut to half its blocks, about two GPUs' worth
    # of capacity behind one device: what the same front end does when nothing is split between devices
    timeout 300 python3 bench/bench_multi_gpu.py --out "$out/multi_gpu.json"
    timeout 150 python3 bench/bench_multi_gpu.py --legs cuda:0 --depth 16 --out "$out/multi_gpu_depth16.json"
  } 2>&1 | grep -v -i warn | tee "$out/log.txt"
  exit
fi
{
  python3 -m pytest -q -p no:warnings tests/test_kernels_gpu.py tests/test_runner_gpu.py 2>&1 | tail -3  # no "warnings" in the summary line, which the filter below would drop
  timeout 60 python3 bench/gpu_fidelity.py --out "$out/fidelity.json" | grep -E "mixed|ALL|SOME"
  timeout 90 python3 bench/gpu_runner_check.py --batches 25 --out "$out/runner_check.json" | grep -E "images|ALL|SOME"
  timeout 260 python3 bench/bench.py --out "$out/bench.json" --plot "$out/bench.png"
  timeout 120 python3 bench/gpu_faults.py --out "$out/gpu_faults.json"
  timeout 170 python3 bench/bench_http.py --preprocess-workers 16 --out "$out/bench_http.json"
} 2>&1 | grep -v -i warn | tee "$out/log.txt"
