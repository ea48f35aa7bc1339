#!/bin/sh
# The image's install steps, in one place: the Dockerfile's build stage runs this file, and
# tests/deploy/test_image.py runs the same Dockerfile line into a fresh virtualenv and starts
# the gateway from it, so what CI proves is what the image ships.
#
#   sh deploy/image/install.sh VENV   (from a directory holding what the Dockerfile copies)
#
# 1. VENV without pip or setuptools: the gateway needs neither at run time.
# 2. Every dependency at the version and hash of requirements/runtime.txt (resolved under
#    requirements/test.txt's pins: the versions CI tests). A file whose hash is not there, or a
#    dependency missing from the lock, fails the install; wheels only (the slim image has no
#    compiler, and a source build would run code the hashes do not cover).
# 3. The project as a wheel, built by the setuptools already beside $PYTHON (pinned: by the base
#    image's digest in the image, by requirements/test.txt in CI), not by one downloaded into an
#    isolated build environment; then installed with --no-deps. The directory holds gateway/ and
#    not loadtests/, so the wheel carries the gateway only.
set -eu
venv=$1
python=${PYTHON:-python3}
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT

"$python" -m venv --without-pip "$venv"
"$python" -m pip --python "$venv/bin/python" install --require-hashes --only-binary :all: \
  -r requirements/runtime.txt
"$python" -m pip wheel --no-deps --no-build-isolation --wheel-dir "$wheels" .
"$python" -m pip --python "$venv/bin/python" install --no-deps "$wheels"/*.whl
