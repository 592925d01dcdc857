#!/usr/bin/env bash
# The server's packages that the device image lacks (FastAPI, uvicorn, pydantic and their needs), as
# wheels for its Python 3.12, into .whl/ (git-ignored). A device call that starts `coserve serve`
# (first_call.sh's jobs_replay) carries them: run(..., carry=[".traces", ".whl"]); first_call.sh
# installs them when .whl/ is there. Versions: those installed on the dev VM in session 26.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
rm -rf .whl
for pkg in fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic_core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 python-multipart==0.0.34 opentelemetry-api==1.45.2 \
    typing_extensions==4.16.0 annotated-doc==0.0.7; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$pkg"
done
ls .whl
