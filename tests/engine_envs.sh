#!/usr/bin/env bash
# The LLM engines' own code for tests/test_engine_contracts.py, on the CPU, without their CUDA dependencies: each
# engine's released wheel installed --no-deps into .engines/<engine>/ (with the few pure-Python packages its modules
# import that this project's test environment lacks), imported beside this project's venv (its CPU torch,
# transformers, numpy, Pillow, safetensors, pydantic). Never lets pip resolve an engine's own dependencies: that would
# bring a CUDA torch. Idempotent: an engine already there is kept.
#   bash tests/engine_envs.sh [PYTHON]    (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-.venv/bin/python}
pip=("$py" -m pip install -q --disable-pip-version-check)
if [ ! -f .engines/vllm/.done ]; then
  rm -rf .engines/vllm
  # vLLM 0.34.0 (the current release): its hasher, media loader, EC connector and Qwen parsers
  "${pip[@]}" --no-deps --target .engines/vllm vllm==0.34.0 psutil pyzmq cachetools cbor2 msgspec cloudpickle \
    py-cpuinfo "llguidance>=1.7,<1.8" xgrammar==0.2.8 apache-tvm-ffi==0.1.11 partial-json-parser einops \
    torchvision==0.29.1
  "${pip[@]}" --target .engines/vllm-deps aiohttp requests
  touch .engines/vllm/.done
fi
if [ ! -f .engines/sglang/.done ]; then
  rm -rf .engines/sglang
  # SGLang 0.5.23 (the current release): its encoder receiver (sglang.srt.utils.common imports triton, which
  # imports without a GPU)
  "${pip[@]}" --no-deps --target .engines/sglang sglang==0.5.23 ipython traitlets triton orjson psutil msgspec pyzmq \
    aiohttp aiohappyeyeballs aiosignal frozenlist multidict propcache yarl dill apache-tvm-ffi sentencepiece \
    compressed-tensors loguru gguf partial-json-parser torchvision==0.28.0
  touch .engines/sglang/.done
fi
