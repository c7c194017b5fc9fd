#!/usr/bin/env bash
# The one install step of both images (docker/Dockerfile, docker/Dockerfile.cpu), usable on a bare
# machine too:   docker/install.sh SRC_DIR [EXTRAS]      e.g. docker/install.sh /opt/toolkit test
#
# 1. torch alone, at the version pinned in requirements/constraints.txt: a range in another
#    package's metadata must never be what picks the torch build (PyPI's Linux wheel is the
#    multi-GB CUDA build). Its source: PIP_FIND_LINKS when set (a folder holding the wheel),
#    else TORCH_INDEX_URL when set (the CPU image sets PyTorch's CPU index), else PyPI.
# 2. optional (any DS_BUILD_* set, as in the GPU image): DeepSpeed built against that torch with
#    those ops prebuilt.
# 3. the toolkit, editable (ds_configs/ and megatron_configs/ are read from the source tree),
#    with every version from the same constraints file.
#
# Pip reads PIP_CERT, PIP_FIND_LINKS, PIP_CONSTRAINT from the environment; PIP overrides the pip
# command (tests set PIP=echo to see the plan without installing).
set -euo pipefail

src=$(cd "${1:?usage: install.sh SRC_DIR [EXTRAS]}" && pwd)
extras=${2:-}
pins="$src/requirements/constraints.txt"
read -r -a pip <<< "${PIP:-python3 -m pip}"

# Build args that were not given arrive as empty variables; pip would take an empty PIP_CERT as
# a path, so unset them.
for var in PIP_CERT PIP_FIND_LINKS PIP_CONSTRAINT TORCH_INDEX_URL; do
  if [ -z "${!var:-}" ]; then unset "$var"; fi
done

torch_pin=$(grep -E '^torch==' "$pins") || { echo "install.sh: no torch== line in $pins" >&2; exit 1; }
torch_source=()
if [ -z "${PIP_FIND_LINKS:-}" ] && [ -n "${TORCH_INDEX_URL:-}" ]; then
  torch_source=(--index-url "$TORCH_INDEX_URL")
fi
"${pip[@]}" install --no-cache-dir "${torch_source[@]}" "$torch_pin"

if env | grep -q '^DS_BUILD_'; then
  # DeepSpeed ships as an sdist; its setup.py prebuilds the ops named by DS_BUILD_* only when it can
  # import torch, which an isolated build environment lacks (and there it fails outright): build it
  # here without isolation, before step 2 would build it the isolated way.
  "${pip[@]}" install --no-cache-dir -c "$pins" setuptools wheel ninja packaging py-cpuinfo
  "${pip[@]}" install --no-cache-dir --no-build-isolation -c "$pins" deepspeed
fi

target="$src"
if [ -n "$extras" ]; then target="$src[$extras]"; fi
"${pip[@]}" install --no-cache-dir -c "$pins" -e "$target"
