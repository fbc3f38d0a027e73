#!/usr/bin/env bash
# One-shot benchmark of one CUDA device (bench/gpu.py says what each section measures).
#
# Run from the repository root on the GPU machine, which has no internet, in one of two ways:
#   - on a machine with its own CUDA torch (python3), with the wheels bench/device_wheels.sh made
#     here carried in .whl/ and no .venv: this script installs them under /tmp/site and runs
#     python3 with llmflow from its wheel (the precision section needs Prefect and MLflow, which
#     the wheels leave out);
#   - with the repository's .venv (`make venv`) carried along, holding a CUDA build of torch at
#     the version constraints.txt pins in place of the CPU build `make venv` installs (the wheel
#     for the machine's driver from https://download.pytorch.org/whl/, with the nvidia-* and
#     triton wheels it depends on, installed with pip --no-index --find-links).
# Either way, optionally:
#   - liger-kernel (in the bench extra: pip install -c constraints.txt -e ".[bench]"):
#     without it the transformers side runs without Liger-Kernel and the report says so. Liger-Kernel
#     0.8.5 fails under torch.compile on torch 2.11 (a Dynamo error in its fused cross-entropy):
#     pass --no-liger there.
#   - flash-linear-attention (bench/device_wheels.sh includes it) and causal-conv1d (a CUDA
#     extension, built for that torch): the kernels section then checks their gated delta rule and
#     convolution, which llmflow's dispatch uses on CUDA in bf16, against the reference, and says
#     whether each was importable.
#
#   bench/gpu.sh                    # every section, 5 rounds, then the MoE step; --record appends the reports to bench/RESULTS.md
#   bench/gpu.sh --only train       # one section (kernels, decode, precision, train)
#   bench/gpu.sh --only moe         # the MoE training step alone (bench/moe_step.py --device cuda, 3 rounds)
#   bench/gpu.sh --only profile     # torch.profiler over llmflow's training step (bench/gpu_profile.py)
#   bench/gpu.sh --no-liger         # the transformers side without Liger-Kernel even where installed
#
# Each section runs as its own command, so none outlives a 10-minute slot, and a failed one
# does not stop the others: the script names the failed sections at the end and exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python && -d .whl ]]; then
    python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    # llmflow from its wheel (flows/, tasks/, models/ and kernels/ install as llmflow.*), bench/ from here.
    export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONSAFEPATH=1
    PY=${PY:-python3}
fi
PY=${PY:-.venv/bin/python}

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    "$PY" -c 'import torch; print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")' || true
    echo "bench/gpu.sh needs a CUDA build of torch in $PY's environment and a visible GPU (see the top of this file)" >&2
    exit 2
fi
"$PY" -c 'import liger_kernel' 2>/dev/null || echo "liger_kernel is not installed: the transformers side runs without Liger-Kernel" >&2
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit --format=csv || true

record=()
[[ " $* " == *" --record "* ]] && record=(--record)
moe=("$PY" -m bench.moe_step --device cuda --rounds 3 "${record[@]}")
profile=("$PY" -m bench.gpu_profile --device cuda "${record[@]}")
if [[ " $* " == *" --only moe "* ]]; then
    exec "${moe[@]}"
fi
if [[ " $* " == *" --only profile "* ]]; then
    exec "${profile[@]}"
fi
if [[ " $* " == *" --only "* ]]; then
    exec "$PY" -m bench.gpu --device cuda "$@"
fi
sections=(kernels decode precision train)
if ! "$PY" -c 'import prefect, mlflow' 2>/dev/null; then
    echo "Prefect or MLflow is not importable: the precision section (a Prefect flow) is left out" >&2
    sections=(kernels decode train)
fi
failed=()
for section in "${sections[@]}"; do
    "$PY" -m bench.gpu --device cuda --only "$section" "$@" || failed+=("$section")
done
"${profile[@]}" || failed+=(profile)
"${moe[@]}" || failed+=(moe)
if (( ${#failed[@]} )); then
    echo "bench/gpu.sh: failed: ${failed[*]}" >&2
    exit 1
fi
