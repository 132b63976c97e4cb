#!/usr/bin/env bash
# Every GPU check and benchmark in one device call (about 8 minutes on an H200), results under ${OUT:-out}/.
# `bench/gpu_all.sh multi` runs only the 1-vs-2-GPU benchmarks (a call of their own on a 2-GPU machine: about 3
# minutes, too much beside the rest for one 10-minute call).
# `bench/gpu_all.sh processes`: the single-GPU fault check and HTTP bench with a device process (about 5 minutes).
# Needs the service wheels there (../shared/tools/gpu-wheels httptools py-spy, carried as .whl).
set -u
out=${OUT:-out}; mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$SITE$PWD
if [ "${1:-}" = processes ]; then  # one GPU served from a device process: the fault check and the HTTP bench
  {
    timeout 120 python3 bench/gpu_faults.py --server-flags=--device-processes --out "$out/gpu_faults_processes.json"
    timeout 170 python3 bench/bench_http.py --preprocess-workers 16 --server-flags=--device-processes \
      --out "$out/bench_http_processes.json"
  } 2>&1 | grep -v -i warn | tee "$out/log.txt"
  exit
fi
if [ "${1:-}" = multi ]; then
  {
    # the defaults (one GPU: a thread; two: a process each), then a process per device for one GPU too
    timeout 300 python3 bench/bench_multi_gpu.py --out "$out/multi_gpu.json"
    timeout 240 python3 bench/bench_multi_gpu.py --no-engine --server-flags=--device-processes \
      --out "$out/multi_gpu_processes.json"
  } 2>&1 | grep -v -i warn | tee "$out/log.txt"
  exit
fi
{
  python3 -m pytest -q tests/test_kernels_gpu.py tests/test_runner_gpu.py 2>&1 | tail -3
  timeout 60 python3 bench/gpu_fidelity.py --out "$out/fidelity.json" | grep -E "mixed|ALL|SOME"
  timeout 90 python3 bench/gpu_runner_check.py --batches 25 --out "$out/runner_check.json" | grep -E "images|ALL|SOME"
  timeout 260 python3 bench/bench.py --out "$out/bench.json" --plot "$out/bench.png"
  timeout 120 python3 bench/gpu_faults.py --out "$out/gpu_faults.json"
  timeout 170 python3 bench/bench_http.py --preprocess-workers 16 --out "$out/bench_http.json"
} 2>&1 | grep -v -i warn | tee "$out/log.txt"
