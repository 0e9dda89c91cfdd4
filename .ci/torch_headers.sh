#!/usr/bin/env bash
# The torch-aware helper compiled (syntax only) against an older torch's headers, from its wheel: by default
# torch 2.6, the oldest whose access refusal the helper lifts through StorageImpl's private members (2.12 made
# the lift public), so that path must be compiled there, not compiled out by a missing torch/version.h.
# Before 2.6 torch cannot refuse access at all, and the helper compiles without the guard.
#   usage: torch_headers.sh <wheel> <folder for its headers> [lift: private|none]   (from the repository root)
set -euo pipefail
WHEEL=$1
DIR=$2
LIFT=${3:-private}
rm -rf "$DIR" && mkdir -p "$DIR"
.venv/bin/python -c '
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as wheel:
    wheel.extractall(sys.argv[2], [n for n in wheel.namelist() if n.startswith("torch/include/")])
' "$WHEEL" "$DIR"
inc="$DIR/torch/include"
pyinc=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
flags=(-std=c++17 -fvisibility=hidden -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_torch_ext '-DGPU_OFFLOAD_TORCH_EXT_RECORD="{}"'
       -I"$inc" -I"$inc/torch/csrc/api/include" -I"$pyinc" -I"$(.venv/bin/python -c 'import pybind11; print(pybind11.get_include())')"
       -Icsrc/torch_ext)
# Each file on its own (a build with a core per file compiles them so: none may lean on another's includes), and
# all of them as one unit (setup.py groups the files into one unit per core where there are fewer cores: their
# file-local names must not meet in any grouping). Each parses torch's headers, 15-30 s: as many at a time as
# there are cores.
for f in csrc/torch_ext/*.cpp; do echo "#include \"$(realpath "$f")\""; done > "$DIR/all_files.cpp"
printf '%s\0' "$DIR/all_files.cpp" csrc/torch_ext/*.cpp |
  xargs -0 -n 1 -P "$(nproc)" g++ "${flags[@]}" -Wno-subobject-linkage -fsyntax-only
found=$(g++ "${flags[@]}" -E csrc/torch_ext/torch_ext.cpp | grep -c 'template struct PrivateMember<' || true)
want=0
[ "$LIFT" = private ] && want=2
if [ "$found" != "$want" ]; then
  echo "torch_headers.sh: $found private-member instantiations in torch_ext.cpp, expected $want ($LIFT lift)" >&2
  exit 1
fi
echo "the helper compiles against $(basename "$WHEEL")'s headers ($LIFT lift)"
