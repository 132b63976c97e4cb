#!/usr/bin/env bash
# Every GPU check and benchmark, results under ${OUT:-out}/: `tower` (GPU pytest, fidelity, runner check, the bench
# table; about 9 minutes on an H200) and `service` (OOM fault, HTTP bench; about 3) fit one 10-minute call each;
# no argument runs both.
# `bench/gpu_all.sh multi` runs only the 1-vs-2-GPU benchmarks (a call of their own on a 2-GPU machine: about 4
# minutes, too much beside the rest for one 10-minute call); `bench/gpu_all.sh attention` the attention backends and
# the GEMM alternatives alone (bench/attention_probe.py, bench/gemm_probe.py).
# Needs the wheels there (../shared/tools/gpu-wheels httptools py-spy nvidia-cudnn-frontend, carried as .whl).
set -u
out=${OUT:-out}; mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$SITE$PWD
if [ "${1:-}" = attention ]; then
  # the attention backends alone (correctness in graphs, speed against unused capacity) and the GEMM alternatives
  {
    python3 -m pytest -q -p no:warnings tests/test_attention_gpu.py tests/test_runner_gpu.py 2>&1 | tail -15
    timeout 240 python3 bench/attention_probe.py --out "$out/attention_probe.json"
    timeout 150 python3 bench/gemm_probe.py --out "$out/gemm_probe.json"
  } 2>&1 | grep -v -i warn | tee "$out/log.txt"
  exit
fi
if [ "${1:-}" = multi ]; then
  {
    # the defaults (a process per GPU); then one GPU with the tower cut to half its blocks, about two GPUs' worth
    # of capacity behind one device: what the same front end does when nothing is split between devices
    timeout 300 python3 bench/bench_multi_gpu.py --out "$out/multi_gpu.json"
    timeout 150 python3 bench/bench_multi_gpu.py --legs cuda:0 --depth 16 --out "$out/multi_gpu_depth16.json"
  } 2>&1 | grep -v -i warn | tee "$out/log.txt"
  exit
fi
if [ "${1:-}" != service ]; then
  {
    python3 -m pytest -q -p no:warnings tests/test_kernels_gpu.py tests/test_runner_gpu.py tests/test_attention_gpu.py \
      2>&1 | tail -3  # no "warnings" in the summary line, which the filter below would drop
    timeout 120 python3 bench/gpu_fidelity.py --out "$out/fidelity.json" | grep -E "mixed|ALL|SOME|unavailable"
    timeout 200 python3 bench/gpu_runner_check.py --batches 25 --out "$out/runner_check.json" | grep -E "images|ALL|SOME"
    timeout 300 python3 bench/bench.py --out "$out/bench.json" --plot "$out/bench.png"
  } 2>&1 | grep -v -i warn | tee "$out/log.txt"
fi
if [ "${1:-}" != tower ]; then
  {
    timeout 120 python3 bench/gpu_faults.py --out "$out/gpu_faults.json"
    timeout 170 python3 bench/bench_http.py --decode-workers 16 --out "$out/bench_http.json"
  } 2>&1 | grep -v -i warn | tee -a "$out/log.txt"
fi
