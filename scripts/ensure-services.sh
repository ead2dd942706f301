#!/usr/bin/env bash
# Start the local services the tests use when they are down (PostgreSQL on :5432).
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
