#!/bin/sh
# PostgreSQL for the compose stack: a cluster in $PGDATA (a volume) made on first start, listening on
# 127.0.0.1:$PGPORT (host networking), the database $PGDATABASE, trust for local connections only.
set -e
: "${PGDATA:=/var/lib/tiergate-postgres}" "${PGPORT:=25432}" "${PGDATABASE:=tiergate}"
BIN=/usr/lib/postgresql/15/bin
mkdir -p "$PGDATA" /var/run/postgresql && chown -R postgres:postgres "$PGDATA" /var/run/postgresql
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  runuser -u postgres -- "$BIN/initdb" -D "$PGDATA" -U postgres --auth=trust --encoding=UTF8 >/dev/null
  runuser -u postgres -- "$BIN/pg_ctl" -D "$PGDATA" -o "-p $PGPORT -c listen_addresses=127.0.0.1" -w start >/dev/null
  runuser -u postgres -- "$BIN/createdb" -h 127.0.0.1 -p "$PGPORT" -U postgres "$PGDATABASE"
  runuser -u postgres -- "$BIN/pg_ctl" -D "$PGDATA" -w stop >/dev/null
fi
exec runuser -u postgres -- "$BIN/postgres" -D "$PGDATA" -p "$PGPORT" -c listen_addresses=127.0.0.1 \
  -c max_connections=200
