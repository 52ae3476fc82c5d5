# Source on the GPU machine (no network): installs carried wheels (.whl/, e.g. stevedore) and this checkout.
#   source benchmarks/device_env.sh
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/install.log 2>&1 || { cat /tmp/install.log; false; }
# The listing is informational; the device image lacks the server's wheels (uvicorn), which the CLI imports.
python3 -m deepinfer.cli backends || true
set +e
