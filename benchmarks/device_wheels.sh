#!/usr/bin/env bash
# Downloads (here, where pip can reach a registry) the wheels that rzero needs on the lent GPU
# machine and that its image lacks, into .whl at the repository root (git-ignored through
# .git/info/exclude). benchmarks/device_check.sh installs them there with --no-index --no-deps.
# The machine's Python is 3.12; versions follow this environment's, so both run the same code.
set -eu -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
packages=()
# Absent from the H200 image (docs/gpu.md): pydantic and what it needs, tomli-w, math-verify.
for name in pydantic pydantic_core annotated-types typing-inspection typing_extensions tomli_w math-verify \
            latex2sympy2_extended antlr4-python3-runtime; do
  packages+=("$name==$(version "$name")")
done
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${packages[@]}"
ls .whl
