#!/bin/sh
# Make sure Debian's Chromium is there for the browser test (never a browser download).
# Where it cannot be installed (no apt-get, not root) say so; the test then skips,
# except under CI, where it fails.
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "==> installing Debian's chromium for the browser test"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
else
  echo "==> no Chromium and no way to install it here: install 'chromium' to run the browser test"
fi
