#!/usr/bin/env bash
# Issue 26's front-end figures for this tree beside OTHER_TREE (an older checkout, carried along), on Qwen3-VL-8B and
# Qwen2.5-VL-7B (dummy weights), in one device call (about 7 minutes on one H200 with 16 cores; each run is capped
# at 130 s). For each model, each tree once, in alternated order: bench/frontend.py, every part (this tree's
# clients; OTHER's servers through --server-tree, so OTHER needs no bench/frontend.py): bench_http.py's loads at 1
# and 128 clients, the LLM-handoff load, the front-end ceiling (tower of one block, cache off), the JSON body costs
# and the cached large answers on cache hits, bench/cache.py's miss and hit, the 1-client load with
# `--preprocess fast`; the engine alone for this tree (the shares of both use it). Each run prints its table; the
# last table puts the four side by side. Results under ${OUT:-out}/: this-MODEL.json, other-MODEL.json,
# frontend.json (all four), log.txt, profiles.tgz (PROFILE=1: the py-spy profiles, one archive).
#   git worktree add .baseline <commit>; then on the device: bash bench/gpu_frontend.sh .baseline
#   (carry .whl and .baseline; the wheels: ../shared/tools/gpu-wheels httptools pybase64 nvidia-cudnn-frontend av)
# THIS_FLAGS: extra `vitserve serve` flags for this tree's servers (e.g. THIS_FLAGS="--api-servers 4"); OTHER_FLAGS
# for OTHER's (it may not know the new flags). RUN_LIMIT: seconds per run (130); TOTAL: seconds for the whole script
# from its start (540), a run getting at most what is left; a run cut short keeps the figures it had taken.
# MODELS: the models, space-separated (both by default). PROFILE=1: this tree's runs with --profile (py-spy over
# the ceiling and the handoff: where the cores went, the busiest threads; it costs the server CPU). STARTUP=1 adds bench/startup.py on the first model, within
# TOTAL: this tree alternated with OTHER (dummy weights, two launches each), then this tree on real weights written
# by transformers and read cold from the disk (startup-dummy.json, startup-real.json).
# CPU=1 runs the same logic on a CPU: the tiny models, tiny counts, RUN_LIMIT 300 and TOTAL 1500 (PYTHON names the
# interpreter, e.g. CPU=1 PYTHON=.venv/bin/python OUT=/tmp/frontend bash bench/gpu_frontend.sh ../old).
#   bash bench/gpu_frontend.sh checks   the correctness side instead (about 5 minutes): the GPU tests (attention,
#   runner, kernels), the several-front-end tests against GPU servers (the tiny tower on cuda:0 in bf16, graphs),
#   the same-image and hostile tests, the video tests (transformers' video processors beside ours: needs the av
#   wheel), and the runner's graph-against-eager check
set -u
other=${1:?usage: bench/gpu_frontend.sh OTHER_TREE | checks}
out=$(realpath -m "${OUT:-out}"); mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$SITE$PWD
if [ "$other" = checks ]; then
  {
    python3 -m pytest -q -p no:warnings tests/test_attention_gpu.py tests/test_runner_gpu.py tests/test_kernels_gpu.py \
      2>&1 | tail -3
    timeout 300 python3 -m pytest -q -p no:warnings tests/test_api_servers.py tests/test_hostile.py \
      "tests/test_api.py::test_the_same_image_twice_in_a_request_is_answered_whole_every_way" 2>&1 | tail -4
    # videos: transformers' video processors against ours (torchvision loads here), the towers, GPU servers
    timeout 200 python3 -m pytest -q -p no:warnings tests/test_video_processor.py tests/test_video.py \
      tests/test_video_server.py 2>&1 | tail -4
    timeout 150 python3 bench/gpu_runner_check.py --batches 25 --out "$out/runner_check.json" | grep -E "images|ALL|SOME"
  } 2>&1 | grep -v -i warn | tee "$out/log.txt"
  exit 0
fi
py=${PYTHON:-python3}
if [ "${CPU:-0}" = 1 ]; then
  models=${MODELS:-tiny-qwen3-vl tiny-qwen2.5-vl}
  limit=${RUN_LIMIT:-300} total=${TOTAL:-1500}
  common=(--device cpu --engine-images 12 --hits 3 --cache-requests 3 --low-requests 6 --ceiling-requests 96
          --ceiling-concurrency 8 --ceiling-processes 2 --http-requests 32 --http-concurrency 8 --http-processes 2
          --handoff-requests 32 --handoff-concurrency 8 --handoff-processes 2)
else
  models=${MODELS:-Qwen/Qwen3-VL-8B-Instruct Qwen/Qwen2.5-VL-7B-Instruct}
  limit=${RUN_LIMIT:-130} total=${TOTAL:-540}
  common=(--device cuda:0)
fi
run() {  # name, then bench/frontend.py arguments; within RUN_LIMIT, and within TOTAL seconds from the start
  local name=$1; shift
  local left=$(( total - SECONDS - 25 ))
  [ $left -lt 30 ] && { echo "$name: skipped, $total s nearly spent"; return; }
  timeout -k 20 $(( limit < left ? limit : left )) $py bench/frontend.py "${common[@]}" --out "$out/$name.json" "$@" \
    2>&1 | grep -v -i warn | sed "s|^|$name: |"
}
{
  columns=()
  first=this
  for model in $models; do
    short=$(basename "$model" | sed -E 's/-Instruct$//; s/^tiny-//' | tr 'A-Z' 'a-z')
    for side in $first $([ $first = this ] && echo other || echo this); do  # alternated: a drift favours no side
      if [ $side = this ]; then
        run this-$short --model "$model" --engine --server-flags="${THIS_FLAGS:-}" \
          ${PROFILE:+--profile "$out/profile-$short"}
      else
        run other-$short --model "$model" --server-tree "$other" --server-flags="${OTHER_FLAGS:-}"
      fi
      echo "$side-$short done at $SECONDS s"
    done
    columns+=(other-$short="$out/other-$short.json" this-$short="$out/this-$short.json")
    first=$([ $first = this ] && echo other || echo this)
  done
  echo "this tree's servers: ${THIS_FLAGS:-(default flags)}; $other's: ${OTHER_FLAGS:-(default flags)}"
  $py bench/frontend.py --combine "${columns[@]}" --out "$out/frontend.json"
  if [ "${STARTUP:-0}" = 1 ]; then
    first_model=${models%% *}
    for kind in dummy real; do
      left=$(( total - SECONDS - 10 ))
      [ $left -lt 30 ] && { echo "startup-$kind: skipped, $total s nearly spent"; continue; }
      if [ $kind = dummy ]; then
        flags=(--server-tree "$other")
      else
        flags=(--checkpoint "/tmp/vitserve-startup-$(basename "$first_model")" --cold)
      fi
      timeout -k 10 $left $py bench/startup.py --model "$first_model" --device "${common[1]}" --runs 2 "${flags[@]}" \
        --out "$out/startup-$kind.json" 2>&1 | grep -v -i warn | sed "s|^|startup-$kind: |"
    done
  fi
} 2>&1 | tee "$out/log.txt"
# a device call returns at most 8 files, two folders down: the profiles travel as one archive
profiles=$(cd "$out" && ls -d profile-* 2>/dev/null)
[ -n "$profiles" ] && tar czf "$out/profiles.tgz" -C "$out" $profiles && (cd "$out" && rm -rf $profiles)
