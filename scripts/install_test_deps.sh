#!/bin/sh
# Test dependencies outside Python that some tests use when present (they skip with a reason otherwise):
# Debian's chromium, for rendering `titans inspect` reports headless (tests/test_inspect.py).
# Installs only as root with apt-get available and chromium missing; quiet, bounded in time, and never
# fails the caller: a machine without network or root just runs the tests that do not need it.
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_test_deps: chromium missing (not root or no apt-get): its tests will skip" >&2
    exit 0
fi
echo "install_test_deps: installing chromium (apt-get, at most 10 min)" >&2
export DEBIAN_FRONTEND=noninteractive
timeout 300 apt-get update -qq >/dev/null 2>&1 || true
timeout 600 apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 \
    || echo "install_test_deps: chromium could not be installed: its tests will skip" >&2
exit 0
