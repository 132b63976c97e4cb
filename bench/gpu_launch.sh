#!/usr/bin/env bash
# A lone image's launch (bench/launch.py: the device's host time to enqueue it against its run) for this tree beside
# other checkouts, in ROUNDS rounds whose order rotates (a machine drifts over one call by more than most changes
# move this figure, so each tree gets each place in the order), for each model in MODELS; then, with TESTS set, the
# GPU tests of the launch's steps once (first: a broken kernel is known before any timing). Prints per model and
# tree the lone images' median host and device ms (the median over bench_http's images of each run's medians; min /
# median / max over the runs) and a batch of 16's host ms, writes ${OUT:-out}/launch.json and runs.tgz.
#   git worktree add .t1 <commit>; then on the device (carry .whl and the trees; ~30 s a run on one H200):
#   TESTS="tests/test_runner_gpu.py tests/test_image_resize.py" ROUNDS=2 bash bench/gpu_launch.sh .t1
# MODELS: space-separated (default both families); REPEAT: launches per image and run (10); LAUNCH_FLAGS: more of
# bench/launch.py's flags for every run (e.g. --attention-backend flash); CPU=1: tiny-qwen3-vl on
# the CPU, the same steps but the graphs (e.g. CPU=1 PYTHON=.venv/bin/python bash bench/gpu_launch.sh ..).
set -u
out=$(realpath -m "${OUT:-out}"); runs=$out/runs; mkdir -p "$runs"
source "$(dirname "$0")/gpu_env.sh"
py=${PYTHON:-python3}
here=$PWD
if [ "${CPU:-0}" = 1 ]; then
  models=${MODELS:-tiny-qwen3-vl} device=cpu
else
  models=${MODELS:-Qwen/Qwen3-VL-8B-Instruct Qwen/Qwen2.5-VL-7B-Instruct} device=cuda:0
fi
if [ -n "${TESTS:-}" ]; then
  PYTHONPATH=$SITE$here timeout -k 10 "${TEST_LIMIT:-150}" $py -m pytest -q -p no:cacheprovider -p no:warnings \
    -o addopts=-ra $TESTS > "$out/tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.txt" | cut -c1-200 | tail -20
fi
trees=(here "$@")
n=${#trees[@]}
for model in $models; do
  for ((r = 0; r < ${ROUNDS:-2}; r++)); do
    for ((i = 0; i < n; i++)); do
      tree=${trees[(i + r) % n]}; dir=$here; [ "$tree" = here ] || dir=$(realpath "$tree")
      name=$(basename "$model")-$(basename "$tree")-$r
      # the tree's code under this tree's script (the script imports whichever vitserve is first on the path)
      (cd "$dir" && PYTHONPATH=$SITE$dir timeout -k 10 "${RUN_LIMIT:-120}" $py "$here/bench/launch.py" \
        --model "$model" --device "$device" --repeat "${REPEAT:-10}" ${LAUNCH_FLAGS:-} --out "$runs/$name.json" > "$runs/$name.txt" 2>&1)
      echo "round $r $(basename "$model") $tree: rc $?"
    done
  done
done
$py - "$out" "${trees[@]}" <<'EOF'
import glob, json, os, statistics, sys

out, trees = sys.argv[1], sys.argv[2:]
table = {}
for tree in trees:  # (a run's file is MODEL-TREE-ROUND.json)
    for path in sorted(glob.glob(os.path.join(out, "runs", f"*-{os.path.basename(tree)}-[0-9]*.json"))):
        run = json.load(open(path))
        lone = [r for r in run["rows"] if r["images"] == 1]
        batch = [r["host_ms"] for r in run["rows"] if r["images"] > 1]
        table.setdefault(run["model"], {}).setdefault(tree, []).append(
            {
                "host_ms": statistics.median(r["host_ms"] for r in lone),
                "device_ms": statistics.median(r["device_ms"] for r in lone),
                "batch16_host_ms": batch[0] if batch else None,
            }
        )
for model, rows in table.items():
    print(f"\na lone image's launch, {model}: medians over the images, then min / median / max over the runs")
    print(f"{'tree':<24} {'runs':>4} {'host ms':>22} {'device ms':>10} {'16: host ms':>12}")
    for tree in trees:
        runs = rows.get(tree, [])
        if not runs:
            print(f"{tree:<24} {0:>4}  (no run finished)")
            continue
        host = sorted(r["host_ms"] for r in runs)
        spread = f"{host[0]:.2f} / {statistics.median(host):.2f} / {host[-1]:.2f}"
        batch = [r["batch16_host_ms"] for r in runs if r["batch16_host_ms"] is not None]
        print(
            f"{tree:<24} {len(runs):>4} {spread:>22} {statistics.median(r['device_ms'] for r in runs):>10.2f} "
            f"{statistics.median(batch) if batch else float('nan'):>12.2f}"
        )
json.dump(table, open(os.path.join(out, "launch.json"), "w"), indent=1)
EOF
tar czf "$out/runs.tgz" -C "$out" runs && rm -rf "$runs"
