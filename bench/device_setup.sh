# Source on a lent GPU machine (repository root): installs the wheels ../shared/device/pack.sh put in
# .devwheels/ (Ray, DeepSpeed, TRL and their pure-Python deps) into /tmp/site and puts it and this
# checkout on PYTHONPATH. The machine's own torch and transformers are used.
mkdir -p /tmp/site && tar -xJf .devwheels/ray-*-slim.tar.xz -C /tmp/site \
  && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devwheels/*.whl \
  && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .devwheels/deepspeed-*.tar.gz \
  && export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH
