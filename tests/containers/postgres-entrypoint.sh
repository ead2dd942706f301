#!/bin/sh
set -eu
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    printf '%s\n' "${POSTGRES_PASSWORD:?}" >/tmp/pwfile
    initdb -D "$PGDATA" --encoding=UTF8 --locale=C.UTF-8 -U "${POSTGRES_USER:-postgres}" --pwfile=/tmp/pwfile \
        --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f /tmp/pwfile
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    db=${POSTGRES_DB:-${POSTGRES_USER:-postgres}}
    if [ "$db" != postgres ]; then
        pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
        createdb -U "${POSTGRES_USER:-postgres}" "$db"
        pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
    fi
fi
exec postgres -D "$PGDATA" -c listen_addresses='*'
