#!/usr/bin/env bash
# Start the local services the tests use when they are down (PostgreSQL on :5432,
# Redis on :6379).
set -euo pipefail

pg_up() { pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; }

if ! pg_up; then
  if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
    echo "starting PostgreSQL ..."
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  fi
  for _ in $(seq 1 30); do pg_up && break; sleep 1; done
fi
if pg_up; then
  echo "PostgreSQL is up on 127.0.0.1:5432"
else
  echo "PostgreSQL is not reachable on 127.0.0.1:5432; set INFERD_SKIP_POSTGRES=1 to skip its tests" >&2
  exit 1
fi

# Redis on :6379 (the shared rate limit tests).
redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; }
if ! redis_up && command -v redis-server >/dev/null 2>&1; then
  echo "starting Redis ..."
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no || true
  for _ in $(seq 1 30); do redis_up && break; sleep 0.5; done
fi
if redis_up; then
  echo "Redis is up on 127.0.0.1:6379"
else
  echo "Redis is not reachable on 127.0.0.1:6379; set INFERD_SKIP_REDIS=1 to skip its tests" >&2
  [ "${INFERD_SKIP_REDIS:-0}" = 1 ] || exit 1
fi

# Prometheus and promtool (Debian package): the dashboard and alert rule tests run the
# real ones. Installed from the Debian registry when missing and apt-get can.
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "installing prometheus (Debian package) ..."
    (DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1 \
      || { apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive \
           apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1; }) || true
  fi
fi
if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
  echo "Prometheus $(prometheus --version 2>&1 | head -n1 | awk '{print $3}') is installed"
else
  # Not fatal: tests/test_prometheus.py skips (saying why) rather than failing CI on a
  # machine where the package cannot be installed.
  echo "WARNING: prometheus/promtool are not installed and could not be; their tests will skip" >&2
fi

# Chromium (Debian package) at /usr/bin/chromium: the web console's browser tests drive it
# with Playwright (tests/browser.py); Playwright never downloads a browser of its own.
# Installed from the Debian registry when missing and apt-get can, with fonts-liberation
# (a recommendation of chromium-common) so that screenshots render text.
if [ ! -x /usr/bin/chromium ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "installing chromium (Debian package) ..."
    (DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium fonts-liberation >/dev/null 2>&1 \
      || { apt-get update >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive \
           apt-get install -y --no-install-recommends chromium fonts-liberation >/dev/null 2>&1; }) || true
  fi
fi
if [ -x /usr/bin/chromium ]; then
  echo "$(/usr/bin/chromium --version 2>/dev/null | head -n1 | awk '{print $1, $2}') is installed"
else
  # Not fatal here: the browser tests themselves fail loudly (tests/browser.py) unless
  # INFERD_SKIP_BROWSER=1 is set.
  echo "WARNING: /usr/bin/chromium is not installed and could not be (apt-get install chromium);" \
    "the browser tests will FAIL unless INFERD_SKIP_BROWSER=1" >&2
fi

# The Helm chart's renderer (tests/test_helm_chart.py): `helm` when installed, else
# deploy/helm/render built from Debian's Go packages into .cache/helm-render (installed
# when missing and apt-get can). Not fatal: the chart tests skip, saying why.
if ! bash "$(dirname "$0")/helm-render.sh" --build; then
  echo "WARNING: no Helm renderer (helm, or golang-go and sprig from Debian); the chart tests will skip" >&2
fi
