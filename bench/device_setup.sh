# Source on a lent GPU machine (repository root): installs the wheels ../shared/device/pack.sh put in
# .devwheels/ (Ray, DeepSpeed, TRL and their pure-Python deps) into /tmp/site and puts it and this
# checkout on PYTHONPATH. The machine's own torch and transformers are used.
# Without .devwheels/ (a run that did not carry it) there is no liger-kernel, TRL, Ray or DeepSpeed: say so and
# stop, rather than let a benchmark run on plain torch (a census call of 2026-11-29 did, unnoticed until after).
if [ ! -d .devwheels ] || ! ls .devwheels/liger_kernel-*.whl > /dev/null 2>&1; then
  echo "bench/device_setup.sh: no .devwheels/ with liger-kernel here: build it (bash bench/device_wheels.sh) and" \
    "carry it (the run tool's carry: [\".devwheels\"])" >&2
  return 1 2> /dev/null || exit 1
fi
mkdir -p /tmp/site && tar -xJf .devwheels/ray-*-slim.tar.xz -C /tmp/site \
  && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devwheels/*.whl \
  && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .devwheels/deepspeed-*.tar.gz \
  && export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH
