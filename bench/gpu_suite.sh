#!/usr/bin/env bash
# The test suite on a GPU machine: `pytest` with CUDA present, as a user's checkout runs it. Servers started by the
# tests run on cuda:0 in bfloat16 there (`--device auto`) and are held to the bf16 bound against the CPU library
# (tests/helpers.py: assert_served, SERVED_REL_ERR). Files run side by side (pytest-xdist, one file per worker).
#   ../shared/tools/gpu-wheels av==18.1.0 httptools pybase64 blake3 pyzmq openai distro jiter sniffio websockets \
#     httpx2 httpcore2 truststore transformers==5.24.0 huggingface_hub tokenizers [nvidia-cudnn-frontend]
#   then on the device (carry .whl): bash bench/gpu_suite.sh         (WORKERS=6, LIMIT=400 s, TESTS=tests, SHARD=)
# The whole suite takes longer than one device call (600 s) on one H200, and its wheels are over one call's 64 MiB,
# so it runs as two shards, one call each, and each call carries what its files need (a machine can be taken back
# between calls, and a fresh one keeps nothing):
#   SHARD=videos  the files that make or decode videos (tests/videos.py, PyAV): carry .whl and .whl-av
#   SHARD=others  the rest (among them the attention backends'): carry .whl and .whl-cudnn
# with the wheels split after the download: mkdir -p .whl-av .whl-cudnn && mv .whl/av-*.whl .whl-av/ &&
# mv .whl/nvidia_cudnn_frontend-*.whl .whl-cudnn/ (bench/gpu_env.sh installs every .whl-* folder carried). Each is
# ~2100 s of test time on the H200 (bench/results/h200-suite-files.json), 6-7 minutes with WORKERS=8. SHARD=K/N
# instead deals the files to N shards by those times (longest first, each to the shard with the least so far).
# With fa4 (over one call's 64 MiB: installed into /tmp/site by earlier calls, docs/decisions.md) its kernels are
# compiled once per shape into its on-disk cache (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED), not in every server.
# Results under ${OUT:-out}/: junit.xml and log.txt; the failures and the summary line are printed.
set -u
out=$(realpath -m "${OUT:-out}"); mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh"
# the checkout itself, editable and without dependencies: the `vitserve` command and its metadata, as a user's
# `pip install -e .` gives them (the docs tests run the documented commands)
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export PYTHONPATH=$SITE$PWD FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=${FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED:-1}
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
tests=${TESTS:-tests}
if [ -n "${SHARD:-}" ]; then  # videos, others, or K/N
  tests=$(python3 - "$SHARD" <<'EOF'
# the shard's files, longest first (pytest-xdist hands files to its workers in that order): their times on the H200
# in bench/results/h200-suite-files.json, a file not there counted as the median one
import glob, json, re, statistics, sys

shard = sys.argv[1]
known = json.load(open("bench/results/h200-suite-files.json"))["seconds_by_file"]
files = sorted(glob.glob("tests/test_*.py"))
seconds = {f: known.get(f, statistics.median(known.values())) for f in files}
files.sort(key=lambda f: -seconds[f])
videos = re.compile(r"^\s*(import av\b|from videos import|import videos\b)|importorskip\(.av.\)", re.M)
if shard in ("videos", "others"):
    chosen = [f for f in files if bool(videos.search(open(f).read())) == (shard == "videos")]
else:
    k, n = (int(x) for x in shard.split("/"))
    shards, totals = [[] for _ in range(n)], [0.0] * n
    for f in files:
        i = totals.index(min(totals))
        shards[i].append(f)
        totals[i] += seconds[f]
    chosen = shards[k - 1]
print(f"shard {shard}: {len(chosen)} files, {sum(seconds[f] for f in chosen):.0f} s measured", file=sys.stderr)
print(" ".join(chosen))
EOF
  )
fi
timeout -s INT -k 20 "${LIMIT:-400}" python3 -m pytest -q -p no:cacheprovider -p no:warnings -n "${WORKERS:-6}" \
  --dist loadfile --timeout 200 -o addopts="-ra" --junitxml="$out/junit.xml" $tests > "$out/log.txt" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$out/log.txt" | cut -c1-300 | tail -60
