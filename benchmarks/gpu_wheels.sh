#!/usr/bin/env bash
# Wheels that benchmarks/gpu_checks.sh needs on the GPU machine and that its image lacks (it has torch, transformers,
# peft, safetensors, msgpack, xxhash, pytest, hypothesis, pytest-timeout; see /work/.library/device/KINDS.md).
# Run HERE (a machine with pip access), in the repo root; .whl/ is git-ignored and travels with `carry: [".whl"]`:
#   bash benchmarks/gpu_wheels.sh
# The GPU machine runs Python 3.12 on x86-64 (manylinux); versions are this checkout's .venv pins.
set -euo pipefail
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  pyzmq==27.3.0 orjson==3.13.0 torchdata==0.11.0 zstandard==0.25.0
ls -la .whl
