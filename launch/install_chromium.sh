#!/usr/bin/env bash
# Debian's Chromium for the browser test (tests/component/test_view_browser.py, driven by Playwright with the
# system browser: Playwright never downloads one). `make test` runs this where /usr/bin/chromium is missing;
# about 45 s on a fresh machine (apt-get update included). Without root or apt-get it says so and the test
# skips (it fails under CI=true instead).
set -euo pipefail
if [[ -x /usr/bin/chromium ]]; then exit 0; fi
if [[ "$(id -u)" != "0" ]] || ! command -v apt-get >/dev/null; then
  echo "install_chromium.sh: /usr/bin/chromium is missing and apt-get cannot run here (not root?): the browser test will skip" >&2
  exit 0
fi
start=$(date +%s)
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null
echo "install_chromium.sh: $(/usr/bin/chromium --version 2>/dev/null | head -1) installed in $(( $(date +%s) - start )) s" >&2
