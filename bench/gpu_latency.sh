#!/usr/bin/env bash
# Interactive latency, in one device call (about 9 minutes on an H200): the fast preprocessing's GPU tests, then
# bench/bench_http.py (the 26-image mix, 1 client, then 128) against the server of OTHER (an older checkout, carried
# along), beside this tree's exact and fast preprocessing. Results under ${OUT:-out}/.
#   git worktree add .baseline <commit>; then on the device: bash bench/gpu_latency.sh .baseline
#   (carry .whl and .baseline; the wheels: ../shared/tools/gpu-wheels httptools pybase64 nvidia-cudnn-frontend)
set -u
other=${1:-}
out=$(realpath -m "${OUT:-out}"); mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$SITE$PWD
bench() {  # name, then bench_http.py arguments
  local name=$1; shift
  timeout 240 python3 bench/bench_http.py --decode-workers 16 --out "$out/$name.json" "$@" 2>&1 \
    | grep -E "low load|saturating|engine only|CPU ms|HTTP /|Error|error" | sed "s|^|$name: |"
}
{
  python3 -m pytest -q -p no:warnings -s tests/test_preprocess_fast_gpu.py tests/test_runner_gpu.py 2>&1 \
    | grep -E "nvJPEG|largest|passed|failed|Error" | tail -20
  for round in 1 2; do  # alternated, so that a drift of the machine favours no side
    [ -n "$other" ] && bench before-$round --server-tree "$other" --no-engine
    bench exact-$round $([ $round = 2 ] && echo --no-engine)
    bench fast-$round --no-engine --server-flags="--preprocess fast"
  done
} 2>&1 | grep -v -i warn | tee "$out/log.txt"
