#!/usr/bin/env bash
# The one install step of both images (docker/Dockerfile, docker/Dockerfile.cpu), usable on a bare
# machine too:   docker/install.sh SRC_DIR [EXTRAS]      e.g. docker/install.sh /opt/toolkit test
#
# 1. torch alone, at the version pinned in requirements/constraints.txt: a range in another
#    package's metadata must never be what picks the torch build (PyPI's Linux wheel is the
#    multi-GB CUDA build). Its source: PIP_FIND_LINKS when set (a folder holding the wheel),
#    else TORCH_INDEX_URL when set (the CPU image sets PyTorch's CPU index), else PyPI.
# 2. the toolkit, editable (ds_configs/ and megatron_configs/ are read from the source tree),
#    with every version from the same constraints file.
# 3. optional: DeepSpeed rebuilt against that torch with the ops named by DS_BUILD_* prebuilt.
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

target="$src"
if [ -n "$extras" ]; then target="$src[$extras]"; fi
"${pip[@]}" install --no-cache-dir -c "$pins" -e "$target"

if env | grep -q '^DS_BUILD_'; then
  # setup.py only prebuilds ops when it can import the installed torch: no build isolation.
  "${pip[@]}" install --no-cache-dir -c "$pins" ninja packaging py-cpuinfo
  "${pip[@]}" install --no-cache-dir --no-build-isolation --force-reinstall --no-deps -c "$pins" deepspeed
fi
