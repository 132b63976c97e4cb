#!/usr/bin/env bash
# A/B of two trees of the project on a 2-GPU machine, in one device call (about 4 minutes): this one and OTHER (a
# worktree of another branch, carried along), each serving one GPU then two, every device in a process of its own.
#   git worktree add ab <branch>; then on the device: bash bench/gpu_ab.sh ab   (carry: .whl and ab)
# Further arguments go to both trees' bench_multi_gpu.py: `bash bench/gpu_ab.sh ab --legs cuda:0 --depth 4` compares
# the front ends' ceilings on a single GPU.
set -u
other=${1:?usage: bench/gpu_ab.sh OTHER_TREE [bench_multi_gpu.py args]}; shift
out=$(realpath -m "${OUT:-out}"); mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
for round in 1 2; do  # alternated, so that a drift of the machine does not favour one side
  for tree in . "$other"; do
    name=$([ "$tree" = . ] && echo this || echo other)
    (cd "$tree" && PYTHONPATH=$SITE$PWD timeout 150 python3 bench/bench_multi_gpu.py --no-engine --requests 2048 \
      --server-flags=--device-processes "$@" --out "$out/$name-$round.json" 2>&1 | grep -v -i warn | grep -v "{" | tail -6 \
      | sed "s|^|$name $round: |")
  done
done | tee "$out/log.txt"
