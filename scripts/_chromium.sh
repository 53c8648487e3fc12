# Sourced by scripts/test: the browser tests (tests/console/test_browser.py)
# drive the distribution's Chromium. When none is installed and we may use apt
# (root, Debian or Ubuntu), install Debian's package; otherwise the tests say
# why they skip — and under CI=true they fail instead.
if [ -z "${HOSTCALL_CHROMIUM:-}" ] && ! command -v chromium >/dev/null 2>&1 \
    && ! command -v chromium-browser >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "scripts: installing Debian's chromium for the browser tests" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 \
                 && apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; } \
            || echo "scripts: could not install chromium; the browser tests will say so" >&2
    else
        echo "scripts: no chromium; the browser tests will be skipped (install Debian's chromium)" >&2
    fi
fi
