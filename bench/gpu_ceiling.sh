#!/usr/bin/env bash
# The front-end ceiling alone (bench/frontend.py --parts ceiling: the tower cut to one block, cache off) for this
# tree beside other checkouts, in ROUNDS rounds whose order rotates, so that a machine's drift over the call falls
# on every tree alike (one pass in a fixed order ranked trees by their place in it). Prints each tree's min /
# median / max images/s and server cores, writes ${OUT:-out}/ceiling.json and runs.tgz (each run's JSON and table:
# a device call returns at most 8 files).
#   git worktree add .t1 <commit>; then on the device (carry .whl and the trees; ~20 s a run on one H200):
#   MODEL=Qwen/Qwen3-VL-8B-Instruct ROUNDS=3 bash bench/gpu_ceiling.sh .baseline .t1
# An entry TREE::FLAGS runs TREE's servers with those extra flags too, as a run of its own (`here` is this tree):
#   bash bench/gpu_ceiling.sh "here::--devices cuda:0,cuda:0"   (this tree with one and with two device processes)
# REQUESTS: requests a run (6144); FLAGS: extra `vitserve serve` flags for every tree's servers; CPU=1: the tiny
# tower on the CPU with tiny counts (the same logic, e.g. CPU=1 PYTHON=.venv/bin/python bash bench/gpu_ceiling.sh ..).
set -u
out=$(realpath -m "${OUT:-out}"); runs=$out/runs; mkdir -p "$runs"
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$SITE$PWD
py=${PYTHON:-python3}
trees=(here "$@")
if [ "${CPU:-0}" = 1 ]; then
  model=${MODEL:-tiny-qwen3-vl} args=(--device cpu --ceiling-requests "${REQUESTS:-96}" --ceiling-concurrency 8
                                      --ceiling-processes 2)
else
  model=${MODEL:-Qwen/Qwen3-VL-8B-Instruct} args=(--device cuda:0 --ceiling-requests "${REQUESTS:-6144}")
fi
n=${#trees[@]}
label() {  # an entry's name in file names: the tree's folder name, and its flags' words joined by _
  local t=${1%%::*} extra=; [ "$1" = "$t" ] || extra=${1#*::}
  echo "$(basename "$t")$(echo " $extra" | tr -s ' ' '_' | tr -cd 'A-Za-z0-9_.,=-' | sed 's/_$//')"
}
for ((r = 0; r < ${ROUNDS:-3}; r++)); do
  for ((i = 0; i < n; i++)); do
    entry=${trees[(i + r) % n]}
    t=${entry%%::*} extra=; [ "$entry" = "$t" ] || extra=${entry#*::}
    name=$(label "$entry")-$r
    tree_args=(); [ "$t" = here ] || tree_args=(--server-tree "$t")
    timeout -k 10 "${RUN_LIMIT:-90}" $py bench/frontend.py "${args[@]}" --model "$model" --parts ceiling \
      --server-flags "${FLAGS:-} $extra" "${tree_args[@]}" --out "$runs/ceiling-$name.json" \
      > "$runs/ceiling-$name.txt" 2>&1
    echo "round $r $entry: $(grep -E 'ceiling: images' "$runs/ceiling-$name.txt" | tail -1 | tr -s ' ')"
  done
done
labels=(); for entry in "${trees[@]}"; do labels+=("$entry" "$(label "$entry")"); done
$py - "$out" "$model" "${labels[@]}" <<'EOF'
import glob, json, os, statistics, sys

out, model, pairs = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = {}
for tree, label in zip(pairs[::2], pairs[1::2]):
    runs = []
    for path in sorted(glob.glob(os.path.join(out, "runs", f"ceiling-{label}-[0-9]*.json"))):
        ceiling = json.load(open(path))["parts"].get("ceiling") or {}
        if "images_per_s" in ceiling:
            runs.append({"images_per_s": ceiling["images_per_s"], "server_cores": ceiling.get("server_cores")})
    rows[tree] = runs
print(f"\nfront-end ceiling, {model}: images/s (server cores), per tree over its runs")
print(f"{'tree':<40} {'runs':>4} {'min':>8} {'median':>8} {'max':>8} {'cores':>6}")
for tree, runs in rows.items():
    rates = [r["images_per_s"] for r in runs]
    cores = [r["server_cores"] for r in runs if r["server_cores"] is not None]
    if rates:
        print(f"{tree:<40} {len(rates):>4} {min(rates):>8.1f} {statistics.median(rates):>8.1f} {max(rates):>8.1f} "
              f"{statistics.median(cores) if cores else float('nan'):>6.1f}")
    else:
        print(f"{tree:<40} {0:>4}  (no run finished)")
json.dump({"model": model, "trees": rows}, open(os.path.join(out, "ceiling.json"), "w"), indent=1)
EOF
tar czf "$out/runs.tgz" -C "$out" runs && rm -rf "$runs"
