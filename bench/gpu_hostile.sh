#!/usr/bin/env bash
# The hardening of issue 25 on a GPU, in two device calls of under 10 minutes each; results under ${OUT:-out}/.
#   bash bench/gpu_hostile.sh checks   GPU pytest (runner, kernels, attention, fast preprocessing); the hostile-load
#                                      and same-image tests against real servers, which there run the tiny tower on
#                                      cuda:0 in bf16 from CUDA graphs; the runner's graph-against-eager check
#   bash bench/gpu_hostile.sh http OTHER
#                                      bench/bench_http.py for Qwen3-VL-8B and Qwen2.5-VL-7B (dummy weights): this
#                                      tree's server beside OTHER's (an older checkout, carried along), alternated
# (carry .whl, and .baseline for http; the wheels: ../shared/tools/gpu-wheels httptools pybase64 nvidia-cudnn-frontend;
#  the baseline: git worktree add .baseline <commit>)
set -u
out=$(realpath -m "${OUT:-out}"); mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$SITE$PWD
case "${1:-checks}" in
  checks)
    {
      python3 -m pytest -q -p no:warnings tests/test_runner_gpu.py tests/test_kernels_gpu.py tests/test_attention_gpu.py \
        tests/test_preprocess_fast_gpu.py 2>&1 | tail -3
      timeout 240 python3 -m pytest -q -p no:warnings tests/test_hostile.py tests/test_hostile_decode.py \
        "tests/test_api.py::test_the_same_image_twice_in_a_request_is_answered_whole_every_way" 2>&1 | tail -3
      timeout 200 python3 bench/gpu_runner_check.py --batches 25 --out "$out/runner_check.json" | grep -E "images|ALL|SOME"
    } 2>&1 | grep -v -i warn | tee "$out/log.txt"
    ;;
  http)
    other=${2:?an older checkout to compare with}
    bench() {  # name, then bench_http.py arguments
      local name=$1; shift
      timeout 200 python3 bench/bench_http.py --decode-workers 16 --requests 1024 --out "$out/$name.json" "$@" 2>&1 \
        | grep -E "low load|saturating|engine only|HTTP /|Error|error" | sed "s|^|$name: |"
    }
    {
      bench qwen3-before --model Qwen/Qwen3-VL-8B-Instruct --server-tree "$other" --no-engine
      bench qwen3-after --model Qwen/Qwen3-VL-8B-Instruct
      bench qwen25-after --model Qwen/Qwen2.5-VL-7B-Instruct
      bench qwen25-before --model Qwen/Qwen2.5-VL-7B-Instruct --server-tree "$other" --no-engine
    } 2>&1 | grep -v -i warn | tee "$out/log.txt"
    ;;
esac
