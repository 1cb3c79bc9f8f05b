#!/usr/bin/env bash
# `make deploy-smoke`: build the images, start the compose stack (deploy/docker-compose.yml), send
# traffic through the proxy and kill a replica under load (deploy/smoke.py), tear the stack down.
# Exits non-zero on any failure. Run from the repo root, as root (it may apt-get install and start
# dockerd). No image registry is needed: the base image is made with debootstrap from Debian's
# packages and imported once (cached in $TIERGATE_SMOKE_CACHE and as $BASE_IMAGE).
#   TIERGATE_SMOKE_KEEP=1   leave the stack running afterwards (tear down: see the last lines)
set -euo pipefail

PROJECT=tiergate-smoke
COMPOSE_FILE=deploy/docker-compose.yml
BASE_IMAGE=${TIERGATE_BASE_IMAGE:-tiergate/debian:bookworm}
CACHE=${TIERGATE_SMOKE_CACHE:-/var/cache/tiergate-deploy}
MIRROR=${TIERGATE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
PY=${PY:-.venv/bin/python}
export TIERGATE_BASE_IMAGE=$BASE_IMAGE
export TIERGATE_ADMIN_KEY=${TIERGATE_ADMIN_KEY:-smoke-admin-$RANDOM$RANDOM}
compose() { docker-compose -p "$PROJECT" -f "$COMPOSE_FILE" -f deploy/docker-compose.smoke.yml "$@"; }
step() { printf '\n== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }
T0=$(date +%s)

step "docker"
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v docker-compose >/dev/null || missing+=(docker-compose)
if ((${#missing[@]})); then
  echo "installing ${missing[*]} from Debian"
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi
if ! docker info >/dev/null 2>&1; then
  echo "starting dockerd (log: /var/log/tiergate-dockerd.log)"
  nohup dockerd >/var/log/tiergate-dockerd.log 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
docker version --format 'docker server {{.Server.Version}}, client {{.Client.Version}}'
docker-compose version --short

step "base image $BASE_IMAGE"
if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  echo "cached"
else
  if [ ! -x "$CACHE/rootfs/bin/bash" ]; then
    rm -rf "$CACHE/rootfs" && mkdir -p "$CACHE"
    debootstrap --variant=minbase bookworm "$CACHE/rootfs" "$MIRROR"
    printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb http://deb.debian.org/debian-security bookworm-security main\n' \
      "$MIRROR" "$MIRROR" > "$CACHE/rootfs/etc/apt/sources.list"
    rm -f "$CACHE"/rootfs/var/cache/apt/archives/*.deb
  fi
  tar -C "$CACHE/rootfs" -c . | docker import --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase bookworm" - "$BASE_IMAGE"
fi

step "torch wheel"
# The pin is torch==2.13.0+cpu. PyPI has only the CUDA build of 2.13.0; the CPU wheel comes from
# this machine's pip configuration (find-links / a local index) into the build context.
if ls deploy/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  ls deploy/wheels/torch-2.13.0+cpu-*.whl
elif "$PY" -m pip download -q --no-deps --only-binary :all: -d deploy/wheels "torch==2.13.0+cpu"; then
  ls deploy/wheels/torch-2.13.0+cpu-*.whl
else
  echo "no local torch 2.13.0+cpu wheel: the build needs PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"
fi

step "CA certificates"
# A network whose HTTPS goes through an inspecting proxy: the image's pip must trust its CA too.
CA_DIR=${TIERGATE_SMOKE_CA_DIR:-/usr/local/share/ca-certificates}
if ls "$CA_DIR"/*.crt >/dev/null 2>&1; then cp "$CA_DIR"/*.crt deploy/certs/; fi
ls deploy/certs/*.crt 2>/dev/null || echo "none"

step "images"
build() {
  local tag=$1 file=$2; local t=$SECONDS
  DOCKER_BUILDKIT=0 docker build -q --network host --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg PIP_EXTRA_INDEX_URL="${PIP_EXTRA_INDEX_URL:-}" -t "$tag" -f "$file" . 2>&1 >/dev/null | { grep -v -e DEPRECATED -e 'legacy builder' -e buildx -e BuildKit -e 'environment-variable' -e '^ *$' || true; }
  echo "$tag ($file): $((SECONDS - t)) s, $(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}')"
}
build tiergate/services:latest deploy/services/Dockerfile
build tiergate/proxy:latest deploy/proxy/Dockerfile
build tiergate/gateway:latest deploy/Dockerfile
docker run --rm --network host tiergate/gateway:latest sh -c \
  'python3 --version && python3 -c "import torch; print(\"torch\", torch.__version__)" && ls $TIERGATE_NATIVE_CACHE'

teardown() {
  rc=$?
  if [ "${TIERGATE_SMOKE_KEEP:-0}" = 1 ]; then
    echo "stack left running: docker-compose -p $PROJECT -f $COMPOSE_FILE -f deploy/docker-compose.smoke.yml down -v"
  else
    step "tear down"
    compose down -v --remove-orphans 2>&1 | tail -n 3 || true
  fi
  echo "deploy-smoke: $((($(date +%s) - T0))) s, exit $rc"
  exit $rc
}
trap teardown EXIT

step "compose up"
# gateway-1's config: the image's, with its ledger commits 2 s apart (deploy/docker-compose.smoke.yml).
mkdir -p var/deploy-smoke
export TIERGATE_SMOKE_GATEWAY1_CONFIG=$PWD/var/deploy-smoke/gateway-1.yaml
"$PY" -c 'import sys, yaml; c = yaml.safe_load(open("deploy/config.yaml")); c["ledger"]["flush_interval_ms"] = 2000
yaml.safe_dump(c, open(sys.argv[1], "w"), sort_keys=False)' "$TIERGATE_SMOKE_GATEWAY1_CONFIG"
compose down -v --remove-orphans >/dev/null 2>&1 || true
# Host networking: the stack's ports must be free on this machine.
busy=$(ss -Htln | awk '{print $4}' | grep -E ':(25432|26379|26672|26673|24369|28080|28081|28082)$' || true)
[ -z "$busy" ] || { echo "ports in use on this machine: $busy"; exit 1; }
compose up -d --no-build
echo "waiting for the proxy and both replicas (/readyz)"
for port in 28081 28082 28080; do
  ok=
  for _ in $(seq 240); do
    if curl -fs -o /dev/null "http://127.0.0.1:$port/readyz"; then ok=1; break; fi
    sleep 1
  done
  [ -n "$ok" ] || { echo "127.0.0.1:$port/readyz never answered 200"; compose ps; compose logs --tail 40; exit 1; }
done
compose ps
echo "migrations: $(docker inspect -f '{{.State.ExitCode}}' "$(compose ps -q migrate)") (exit code of the migrate service, run once)"

step "tenant and key"
compose exec -T gateway-1 tiergate tenants create smoke
KEY=$(compose exec -T gateway-1 tiergate keys create --tenant smoke --name deploy-smoke 2>/dev/null | tail -n 1 | tr -d '\r')
echo "key ${KEY:0:8}..."

step "traffic through the proxy"
"$PY" deploy/smoke.py --key "$KEY" --project "$PROJECT"
