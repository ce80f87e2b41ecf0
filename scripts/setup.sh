#!/usr/bin/env bash
# Installs what kvserve builds and tests with: Debian packages and the Python test dependencies.
# Idempotent and quiet when everything is already there.
set -euo pipefail
python=${PYTHON:-python3}

# chromium and chromium-driver: the headless browser the web page's end-to-end test drives;
# nutcracker (twemproxy): the proxy in front of Redis shards (make cluster, the sharded tier's tests)
apt_pkgs=(build-essential pkg-config clang libclang-rt-14-dev libcriterion-dev libjansson-dev
          libmicrohttpd-dev liburing-dev libssl-dev libhiredis-dev libexpat1-dev redis-server
          nutcracker chromium chromium-driver)
missing=()
for p in "${apt_pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -ne 0 ] && sudo=sudo
    echo "setup: installing ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# pytest runs the end-to-end tests; openai is the official client they drive the server with;
# requests sends the raw (malformed, oversized) bodies a client library would refuse to send;
# jsonschema validates the structured outputs' answers against their schemas; langchain-openai
# is the agent framework whose structured output and tool calls the e2e tests drive; selenium
# drives chromium (through chromium-driver, above: it downloads no browser) in the web page's test;
# anthropic is the official client the Messages API's e2e tests drive the server with.
# openai 1.66 is the first with the Responses API (client.responses, its stream helper).
# gguf and numpy write the draft-model tests' model (scripts/make_draft_model.py: the default
# model requantized), which make test builds before the tests.
# sglang-router and vllm-router are the routers the e2e tests put in front of two instances
# (tests/e2e/test_router.py); pinned, as each reads GET /get_load in a shape of its own and
# the shapes changed between versions (README, "Behind a router").
py_pkgs=(pytest "openai>=1.66" requests jsonschema langchain-openai selenium anthropic gguf numpy
         "sglang-router==0.3.2" "vllm-router==0.1.17")
if ! "$python" -c "import pytest, openai, requests, jsonschema, langchain_openai, selenium, anthropic
import gguf, numpy
from openai.resources.responses import Responses
from importlib.metadata import version
assert version('sglang-router') == '0.3.2' and version('vllm-router') == '0.1.17'" 2>/dev/null; then
    echo "setup: installing Python test dependencies: ${py_pkgs[*]}"
    "$python" -m pip install --quiet --disable-pip-version-check "${py_pkgs[@]}"
fi
