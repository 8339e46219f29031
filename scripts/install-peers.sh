#!/usr/bin/env bash
# Install the optional peer engines (NIXL, Mooncake Transfer Engine) into .venv, the way
# that works here. Idempotent: re-running only checks. Used by CI and by developers.
#
#   scripts/install-peers.sh            # both
#   scripts/install-peers.sh nixl       # one of: nixl mooncake
#
# * NIXL: `pip install --no-deps nixl-cu12` - its declared dependencies pull a multi-GB
#   CUDA build of torch, which the DRAM/UCX path does not need (numpy is already in .venv).
# * Mooncake TE: `mooncake-transfer-engine-non-cuda` needs the Debian libraries
#   libibverbs1, libnl-3-200 and libnl-route-3-200 even for its TCP protocol.
# Both bind every interface for their data ports: tests and benchmarks run them inside a
# private network namespace (unshare -n), which needs root (or CAP_SYS_ADMIN).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
NIXL_PKG="nixl-cu12==1.5.1"
MOONCAKE_PKG="mooncake-transfer-engine-non-cuda==0.3.13.post1"
DEBIAN_LIBS=(libibverbs1 libnl-3-200 libnl-route-3-200)
WANT=("$@")
[ ${#WANT[@]} -eq 0 ] && WANT=(nixl mooncake)

if [ ! -x "$PY" ]; then
    echo "install-peers: $PY not found; run 'make install' first" >&2
    exit 1
fi

have_module() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }

install_debian_libs() {
    local missing=()
    for lib in "${DEBIAN_LIBS[@]}"; do
        dpkg-query -W -f='${Status}' "$lib" 2>/dev/null | grep -q "install ok installed" || missing+=("$lib")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if ! command -v apt-get >/dev/null; then
        echo "install-peers: need ${missing[*]} (Debian packages) but apt-get is absent" >&2
        return 1
    fi
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get install -y --no-install-recommends "${missing[@]}" \
        || { $sudo apt-get update && $sudo apt-get install -y --no-install-recommends "${missing[@]}"; }
}

for peer in "${WANT[@]}"; do
    case "$peer" in
        nixl)
            if have_module nixl_cu12; then
                echo "install-peers: nixl already installed"
            else
                "$PY" -m pip install --quiet --no-deps "$NIXL_PKG"
            fi
            "$PY" -c "from nixl_cu12 import nixl_agent" && echo "install-peers: nixl OK"
            ;;
        mooncake)
            install_debian_libs
            if have_module mooncake.engine; then
                echo "install-peers: mooncake already installed"
            else
                "$PY" -m pip install --quiet "$MOONCAKE_PKG"
            fi
            "$PY" -c "from mooncake.engine import TransferEngine" && echo "install-peers: mooncake OK"
            ;;
        *)
            echo "install-peers: unknown peer '$peer' (nixl | mooncake)" >&2
            exit 2
            ;;
    esac
done
