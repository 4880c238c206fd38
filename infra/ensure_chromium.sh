#!/usr/bin/env bash
# Debian's chromium, for infra/dashboard_screenshot.py (a real browser on the Ray dashboard). Idempotent.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "chromium is missing: install Debian's package (apt-get install chromium) as root" >&2
  exit 1
fi
apt-get install -y --no-install-recommends chromium
