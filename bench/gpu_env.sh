# Sourced by the device scripts: the service wheels carried as .whl (../shared/tools/gpu-wheels) installed under
# /tmp/site, which $SITE (empty without wheels) puts first on a PYTHONPATH; PYTHONUNBUFFERED for live logs.
SITE=
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  SITE=/tmp/site:
  export PATH=/tmp/site/bin:$PATH
fi
export PYTHONUNBUFFERED=1
