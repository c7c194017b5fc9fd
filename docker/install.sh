#!/usr/bin/env bash
# The one install step of both images (docker/Dockerfile, docker/Dockerfile.cpu), usable on a bare
# machine too:   docker/install.sh SRC_DIR [EXTRAS]      e.g. docker/install.sh /opt/toolkit test
#
# 1. torch alone, at the version pinned in requirements/constraints.txt: a range in another
#    package's metadata must never be what picks the torch build (PyPI's Linux wheel is the
#    multi-GB CUDA build). Its source: PIP_FIND_LINKS when set (a folder holding the wheel),
#    else TORCH_INDEX_URL when set (the CPU image sets PyTorch's CPU index), else PyPI.
#    TORCH_BUILD=cuda|cpu (optional): fail unless the installed torch is that build. A local
#    wheel folder can hold torch's CPU wheel (2.13.0+cpu satisfies torch==2.13.0 and sorts above
#    it), which must not end up in the GPU image.
# 2. optional, DeepSpeed built against that torch with ops prebuilt: any DS_BUILD_* set (the CPU
#    image's CPU ops), or CUDA_OPS (the GPU image, e.g. "FUSED_ADAM") when a CUDA toolkit (nvcc)
#    of torch's CUDA major version is present; without one, it says what runs instead.
# 3. the toolkit, editable (ds_configs/ and megatron_configs/ are read from the source tree),
#    with every version from the same constraints file.
#
# Pip reads PIP_CERT, PIP_FIND_LINKS, PIP_CONSTRAINT from the environment; PYTHON is the
# interpreter (default python3), PIP overrides the pip command (tests set PIP=echo to see the plan
# without installing).
set -euo pipefail

src=$(cd "${1:?usage: install.sh SRC_DIR [EXTRAS]}" && pwd)
extras=${2:-}
pins="$src/requirements/constraints.txt"
python=${PYTHON:-python3}
read -r -a pip <<< "${PIP:-$python -m pip}"

# Build args that were not given arrive as empty variables; pip would take an empty PIP_CERT as
# a path, so unset them.
for var in PIP_CERT PIP_FIND_LINKS PIP_CONSTRAINT TORCH_INDEX_URL TORCH_BUILD CUDA_OPS; do
  if [ -z "${!var:-}" ]; then unset "$var"; fi
done

torch_pin=$(grep -E '^torch==' "$pins") || { echo "install.sh: no torch== line in $pins" >&2; exit 1; }
torch_source=()
if [ -z "${PIP_FIND_LINKS:-}" ] && [ -n "${TORCH_INDEX_URL:-}" ]; then
  torch_source=(--index-url "$TORCH_INDEX_URL")
fi
"${pip[@]}" install --no-cache-dir "${torch_source[@]}" "$torch_pin"

# torch's CUDA version ("" for a CPU build).
torch_cuda() { "$python" -c 'import torch; print(torch.version.cuda or "")'; }

if [ -n "${TORCH_BUILD:-}" ]; then
  cuda=$(torch_cuda)
  if [ "$TORCH_BUILD" = cuda ] && [ -z "$cuda" ]; then
    echo "install.sh: TORCH_BUILD=cuda, but the installed $torch_pin is a CPU build (torch.version.cuda is None)." \
         "PIP_FIND_LINKS=${PIP_FIND_LINKS:-} holds torch's CPU wheel, which pip prefers (a +cpu local version" \
         "sorts above PyPI's CUDA build): leave PIP_FIND_LINKS unset, or put the CUDA wheel there." >&2
    exit 1
  elif [ "$TORCH_BUILD" = cpu ] && [ -n "$cuda" ]; then
    echo "install.sh: TORCH_BUILD=cpu, but the installed $torch_pin is a CUDA $cuda build: set TORCH_INDEX_URL" \
         "to PyTorch's CPU index or put the CPU wheel in PIP_FIND_LINKS." >&2
    exit 1
  fi
  echo "install.sh: $torch_pin, ${cuda:+CUDA $cuda}${cuda:-CPU build}"
fi

# The GPU image's ops: prebuilt only with an nvcc of torch's CUDA major version (PyPI's torch brings
# the CUDA runtime, not the compiler). DeepSpeed's own version table stops at CUDA 12 (0.19.8), so a
# matching major is checked here and its check skipped; the build has no GPU, so DeepSpeed is told
# the accelerator (it would pick its CPU one and build CPU ops).
if [ -n "${CUDA_OPS:-}" ]; then
  nvcc=$(command -v nvcc || true)
  if [ -z "$nvcc" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then nvcc="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"; fi
  cuda=$(torch_cuda)
  nvcc_cuda=""
  if [ -n "$nvcc" ]; then nvcc_cuda=$("$nvcc" --version | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p'); fi
  if [ -n "$cuda" ] && [ -n "$nvcc_cuda" ] && [ "${nvcc_cuda%%.*}" = "${cuda%%.*}" ]; then
    echo "install.sh: prebuilding DeepSpeed's ${CUDA_OPS} with $nvcc (CUDA $nvcc_cuda; torch's CUDA $cuda)" \
         "for TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-the default of torch}"
    for op in $CUDA_OPS; do export "DS_BUILD_${op}=1"; done
    export DS_ACCELERATOR=cuda DS_SKIP_CUDA_CHECK=1
  else
    why="no CUDA toolkit (nvcc) in this image"
    if [ -z "$cuda" ]; then why="torch is a CPU build";
    elif [ -n "$nvcc_cuda" ]; then why="nvcc is CUDA $nvcc_cuda, torch's CUDA is $cuda (another major version)"; fi
    echo "install.sh: NOT prebuilding DeepSpeed's ${CUDA_OPS}: $why. At run time DeepSpeed tries a JIT build" \
         "(it needs nvcc of torch's CUDA version); where it cannot, the toolkit steps the parameters with" \
         "torch.optim.AdamW(fused=True) and the same hyperparameters, and says so (toolkit/adapters/deepspeed/optimizer.py)."
  fi
fi

if env | grep -q '^DS_BUILD_'; then
  # DeepSpeed ships as an sdist; its setup.py prebuilds the ops named by DS_BUILD_* only when it can
  # import torch, which an isolated build environment lacks (and there it fails outright): build it
  # here without isolation, before step 3 would build it the isolated way.
  "${pip[@]}" install --no-cache-dir -c "$pins" setuptools wheel ninja packaging py-cpuinfo
  "${pip[@]}" install --no-cache-dir --no-build-isolation -c "$pins" deepspeed
fi

target="$src"
if [ -n "$extras" ]; then target="$src[$extras]"; fi
"${pip[@]}" install --no-cache-dir -c "$pins" -e "$target"
