#!/usr/bin/env bash
# Installs Debian's chromium for the browser tests (tests/browser.py drives it over
# the DevTools protocol, headless).
#
# Idempotent: returns at once when /usr/bin/chromium exists.  Never fails the test
# run: when it cannot install (not root, no apt-get, apt fails) it says why, records
# the reason in .venv/.sparkcache-browser-skip and exits 0; the browser tests then
# skip with that reason.
#
#   bash scripts/install-browser.sh        # as root (CI runs as root)
#   sudo bash scripts/install-browser.sh   # on a workstation
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

CHROMIUM=/usr/bin/chromium
reason_file=.venv/.sparkcache-browser-skip
# Bounds on every apt step: a held dpkg lock or a dead mirror must not hang CI.
APT_TIMEOUT=${APT_TIMEOUT:-900}
apt_opts=(-q -q -y -o DPkg::Lock::Timeout=120 -o Acquire::Retries=2 -o Acquire::http::Timeout=30)
# Recommends pull udev, upower, mesa and a printer dialog; the tests need none of
# them.  fonts-liberation (a Recommends) is kept so that screenshots show text.
packages=(chromium fonts-liberation)

skip() {
    echo "install-browser: $1; the browser tests will skip" >&2
    mkdir -p "$(dirname "$reason_file")"
    echo "$1" >"$reason_file"
    exit 0
}

if [ -x "$CHROMIUM" ]; then
    rm -f "$reason_file"
    echo "chromium already installed: $(timeout 60 "$CHROMIUM" --version 2>/dev/null || echo "$CHROMIUM")"
    exit 0
fi
[ "$(id -u)" = 0 ] ||
    skip "$CHROMIUM is missing and installing it needs root (run: sudo bash scripts/install-browser.sh)"
command -v apt-get >/dev/null 2>&1 ||
    skip "$CHROMIUM is missing and this machine has no apt-get (install Chromium at $CHROMIUM)"

export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
run_apt() { timeout "$APT_TIMEOUT" apt-get "${apt_opts[@]}" "$@" >>"$log" 2>&1; }
last_error() { grep -E '^(E|W|Err):' "$log" | tail -n 1 || tail -n 1 "$log"; }

echo "installing chromium with apt-get (a minute or two)..."
# apt-get update only when needed: the package lists do not know chromium yet, or
# they are stale (the install fetches a version the mirror no longer has).
if ! apt-cache show chromium >/dev/null 2>&1; then
    run_apt update || skip "apt-get update failed: $(last_error)"
fi
if ! run_apt install --no-install-recommends "${packages[@]}"; then
    run_apt update || skip "apt-get update failed: $(last_error)"
    run_apt install --no-install-recommends "${packages[@]}" ||
        skip "apt-get install chromium failed: $(last_error)"
fi
# stderr apart: Debian's launcher script may warn on stderr (its /dev/shm check).
version=$(timeout 60 "$CHROMIUM" --version 2>"$log") ||
    skip "chromium was installed but $CHROMIUM --version failed: $(tail -n 1 "$log")"
rm -f "$reason_file"
echo "installed $version"
