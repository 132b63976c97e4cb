# Sourced by the device scripts: the wheels carried as .whl (../shared/tools/gpu-wheels httptools
# nvidia-cudnn-frontend, for the service and the cuDNN attention backend), and in any .whl-* folder beside it (wheels
# that one call's 64 MiB cannot carry together, split between calls: bench/gpu_suite.sh), installed under /tmp/site,
# which $SITE (empty without wheels) puts first on a PYTHONPATH; PYTHONUNBUFFERED for live logs. The CuTe DSL behind
# flash-attn-4 finds its packages through a .pth file, which a --target install does not run: its folder joins $SITE.
# A warm machine keeps /tmp/site between calls: wheels installed there by an earlier call (those too large to travel
# with .whl, e.g. fa4's, docs/decisions.md) stay on the path of a call that carries no .whl.
SITE=
wheels=$(ls .whl/*.whl .whl-*/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels || exit 1
fi
if [ -d /tmp/site ]; then
  SITE=/tmp/site:
  [ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ] && SITE=$SITE/tmp/site/nvidia_cutlass_dsl/dsl_packages:
  export PATH=/tmp/site/bin:$PATH
fi
export PYTHONUNBUFFERED=1
