#!/usr/bin/env bash
# Issue 27's video figures on the device: bench/video.py for each MODEL given (default: Qwen/Qwen3-VL-8B-Instruct)
# with the published video processor settings (dummy weights written as a checkpoint), each run capped at RUN_LIMIT
# seconds (280); VIDEO_FLAGS are more bench/video.py flags. OTHER=DIR (another checkout, carried) runs OTHER's
# bench/video.py too, per model, in alternated order (a drift favours no side). Clips are taken from
# build/video-clips where carried (`python3 bench/video.py --make-clips --clip-dir build/video-clips` here), else
# made there. Results under ${OUT:-out}/: video-MODEL.json (and other-video-MODEL.json) per model, log.txt.
#   bash bench/gpu_video.sh Qwen/Qwen3-VL-8B-Instruct Qwen/Qwen2.5-VL-7B-Instruct   (carry .whl and build/video-clips;
#   the wheels: ../shared/tools/gpu-wheels httptools pybase64 nvidia-cudnn-frontend av)
#   OTHER=.baseline VIDEO_FLAGS="--phases single,throughput --seconds 30" bash bench/gpu_video.sh
set -u
out=$(realpath -m "${OUT:-out}"); mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
clips=$(realpath -m build/video-clips)
run() {  # side (this or other), model, short name
  local tree=$PWD prefix=""
  [ "$1" = other ] && tree=$(realpath "$OTHER") prefix=other-
  (cd "$tree" && PYTHONPATH=$SITE$tree timeout -k 20 "${RUN_LIMIT:-280}" python3 bench/video.py --model "$2" \
    --video-config published --clip-dir "$clips" --out "$out/${prefix}video-$3.json" ${VIDEO_FLAGS:-} 2>&1 |
    grep -v -i warn | sed "s|^|$prefix$3: |")
}
{
  first=this
  for model in "${@:-Qwen/Qwen3-VL-8B-Instruct}"; do
    short=$(basename "$model" | sed -E 's/-Instruct$//' | tr 'A-Z' 'a-z')
    if [ -z "${OTHER:-}" ]; then
      run this "$model" "$short"
      continue
    fi
    for side in $first $([ $first = this ] && echo other || echo this); do
      run "$side" "$model" "$short"
    done
    first=$([ $first = this ] && echo other || echo this)
  done
} 2>&1 | tee "$out/log.txt"
