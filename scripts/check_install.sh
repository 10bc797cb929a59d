#!/usr/bin/env bash
# Installs selfattn the way a user does and checks that it works.
#
# The test suite runs against an editable install of src/, which hides packaging mistakes: a
# subpackage missing from the wheel, py.typed left out, a runtime import of a dev-only package.
# This builds the wheel from a clean copy of the working tree, checks its contents, installs it
# (no extras) into a fresh virtualenv with torch==$TORCH_VERSION first (the CPU build on disk;
# a bare torch requirement would pull a CUDA build), and runs the library and its CLI from there.
#
#   bash scripts/check_install.sh        # or: make check-install
set -euo pipefail

PY=${PY:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
START=$SECONDS
STEP="setup"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/selfattn-install.XXXXXX")
cleanup() { rm -rf "$WORK"; }
fail() {
    echo "check_install: FAILED at step: $STEP" >&2
    cleanup
}
trap fail ERR
trap cleanup EXIT

step() {
    STEP=$1
    echo "check_install [$((SECONDS - START)) s]: $STEP"
}

# Neither the source tree nor the caller's environment may leak into the checks.
unset PYTHONPATH PYTHONHOME VIRTUAL_ENV

step "copy the working tree (tracked and untracked, without ignored build outputs)"
"$PY" - "$ROOT" "$WORK/src" <<'EOF'
import shutil
import subprocess
import sys
from pathlib import Path

root, dest = Path(sys.argv[1]), Path(sys.argv[2])
listing = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    cwd=root, check=True, capture_output=True,
).stdout.decode()
for name in filter(None, listing.split("\0")):
    if (root / name).is_file():  # a tracked file deleted in the working tree is left out
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, dest / name)
EOF

step "build the wheel"
"$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK"/dist/selfattn-*.whl)
echo "  $(basename "$WHEEL")"

step "check the wheel's contents"
"$PY" - "$WHEEL" "$WORK/src/src" <<'EOF'
import sys
import zipfile
from pathlib import Path

wheel, src = sys.argv[1], Path(sys.argv[2])
names = set(zipfile.ZipFile(wheel).namelist())
expected = {p.relative_to(src).as_posix() for p in src.glob("selfattn/**/*.py") if "__pycache__" not in p.parts}
expected.add("selfattn/py.typed")
missing = sorted(expected - names)
if missing:
    sys.exit("wheel is missing: " + ", ".join(missing))
packages = sorted(n[: -len("/__init__.py")].replace("/", ".") for n in names if n.endswith("/__init__.py"))
print(f"  {len(names)} files; packages: {', '.join(packages)}; py.typed present")
EOF

step "create a clean virtualenv"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"

step "install torch==$TORCH_VERSION first"
"$VPY" -m pip install -q "torch==$TORCH_VERSION"

step "install the wheel (no extras)"
"$VPY" -m pip install -q "$WHEEL"

cd "$WORK"   # away from the source tree

step "import selfattn from the installed wheel and run attention"
"$VPY" - "$WORK/venv" "$TORCH_VERSION" <<'EOF'
import sys
from pathlib import Path

import selfattn
import torch

venv, torch_version = Path(sys.argv[1]).resolve(), sys.argv[2]
where = Path(selfattn.__file__).resolve()
if venv not in where.parents:
    sys.exit(f"selfattn imported from {where}, not from the virtualenv {venv}")
if not (where.parent / "py.typed").is_file():
    sys.exit("py.typed is not installed")
if torch.__version__.split("+")[0] != torch_version:
    sys.exit(f"torch {torch.__version__} was installed, expected {torch_version}")
EOF
"$VPY" -c "import selfattn, torch; q=torch.randn(1,2,8,4); print(selfattn.attention(q,q,q,causal=True).shape)"

step "run the selfattn command"
"$WORK/venv/bin/selfattn" demo --help >/dev/null
"$WORK/venv/bin/selfattn" --help >/dev/null

echo "check_install: OK in $((SECONDS - START)) s"
