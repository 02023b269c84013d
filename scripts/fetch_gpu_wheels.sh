#!/usr/bin/env bash
# Downloads, here, the wheels scripts/gpu_check.sh installs on the lent GPU machine, into .whl/ (ignored by
# git; the device tool carries it with carry=[".whl"]). That machine cannot fetch anything; its image has
# jax/jaxlib 0.11.2 with CUDA 13, flax, optax, orbax, chex, protobuf, etils, jaxtyping, absl-py and tqdm on
# Python 3.12 (the device tool's KINDS.md), but not tokamax. These are tokamax 0.0.17 (needs jax >= 0.11.1)
# and what `import tokamax` needs beyond that image. Left out on purpose: xprof's own dependencies duckdb
# (25 MB) and google-cloud-storage, which `import tokamax` does not reach (checked on CPU with jax 0.11.2 by
# making them unimportable), so the carried tree stays under the tool's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=(
  tokamax==0.0.17 einshape==1.0 qwix==0.1.8 immutabledict==4.3.1
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  xprof==2.24.2 fire==0.7.1 termcolor==3.1.0
)
rm -rf .whl
"${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${wheels[@]}"
du -sh .whl
