#!/usr/bin/env bash
# Issue 27's video figures on the device: bench/video.py for each MODEL given (default: Qwen/Qwen3-VL-8B-Instruct)
# with the published video processor settings (dummy weights written as a checkpoint), each run capped at RUN_LIMIT
# seconds (280); VIDEO_FLAGS are more bench/video.py flags. Clips are taken from build/video-clips where carried
# (`python3 bench/video.py --make-clips --clip-dir build/video-clips` here), else made there. Results under
# ${OUT:-out}/: video-MODEL.json per model and log.txt.
#   bash bench/gpu_video.sh Qwen/Qwen3-VL-8B-Instruct Qwen/Qwen2.5-VL-7B-Instruct   (carry .whl and build/video-clips;
#   the wheels: ../shared/tools/gpu-wheels httptools pybase64 nvidia-cudnn-frontend av)
set -u
out=$(realpath -m "${OUT:-out}"); mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$SITE$PWD
{
  for model in "${@:-Qwen/Qwen3-VL-8B-Instruct}"; do
    short=$(basename "$model" | sed -E 's/-Instruct$//' | tr 'A-Z' 'a-z')
    timeout -k 20 "${RUN_LIMIT:-280}" python3 bench/video.py --model "$model" --video-config published \
      --clip-dir build/video-clips --out "$out/video-$short.json" ${VIDEO_FLAGS:-} 2>&1 | grep -v -i warn | sed "s|^|$short: |"
  done
} 2>&1 | tee "$out/log.txt"
