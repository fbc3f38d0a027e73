#!/usr/bin/env bash
# Wheels for a lent GPU machine, made here where pip reaches the package index, for
# bench/gpu.sh to install there: the packages llmflow's GPU benchmarks import that the
# machine's image lacks (it has its own CUDA torch, numpy, safetensors, tokenizers,
# huggingface_hub, triton and an older transformers), at the versions this .venv has, built
# for the machine's Python (PYVER, default 3.12); flash-linear-attention, so the kernels
# section checks its gated delta rule; and llmflow itself as a wheel of this working tree.
# They go to .whl/, which git ignores (.git/info/exclude); carry .whl to the machine.
#
#   bench/device_wheels.sh            # then, on the machine: bench/gpu.sh [--only ...] [--record]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYVER=${PYVER:-3.12}
OUT=.whl
mkdir -p .git/info
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf "$OUT"
mkdir -p "$OUT"
# llmflow's imports outside the image: transformers at the pinned version, pydantic and its kin.
mapfile -t pins < <("$PY" -m pip freeze | grep -i -E '^(transformers|pydantic|pydantic[-_]core|pydantic-settings|python-dotenv|annotated-types|typing-inspection|typing[-_]extensions)==')
download=("$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$OUT")
"${download[@]}" "${pins[@]}"
"${download[@]}" flash-linear-attention fla-core \
    || echo "bench/device_wheels.sh: no flash-linear-attention wheel: the kernels section runs without it" >&2
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$OUT" .
ls "$OUT"
du -sh "$OUT"
