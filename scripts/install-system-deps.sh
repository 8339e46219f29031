#!/usr/bin/env bash
# Install the system programs the tests use when they are missing: etcd (worker registry
# tests against a real server), iproute2 (network-namespace tests) and a C compiler (the
# optional topkv._copycrc extension, built by `make install`) and kubectl (Debian's
# kubernetes-client: `kubectl kustomize` renders deploy/ in the manifest tests). Needs apt-get and root;
# without them it says what is missing and the affected tests skip with a reason.
set -uo pipefail
missing=()
command -v etcd >/dev/null 2>&1 || missing+=(etcd-server)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v cc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
command -v kubectl >/dev/null 2>&1 || missing+=(kubernetes-client)
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" -ne 0 ]; then
  echo "install-system-deps: missing ${missing[*]} (need root and apt-get); those tests will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 \
  || { apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null; } \
  || echo "install-system-deps: could not install ${missing[*]}; those tests will skip" >&2
exit 0
