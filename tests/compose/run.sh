#!/usr/bin/env bash
# The docker-compose demo, run for real: builds the images (FROM scratch, from
# this machine's binaries: no registry needed), starts docker-compose.yml with
# every role, drives load through both api pods, kills a worker mid-load, checks
# the outcome, and tears everything down. Exit 0 = passed.
#
# Without a Docker engine it says so and exits 0, unless CI=true: then a missing
# engine is a failure, never a skip.
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! docker info >/dev/null 2>&1; then
    if [ "${CI:-}" = "true" ]; then
        echo "compose test: FAILED: no Docker engine is reachable (docker info failed) and CI=true" >&2
        exit 1
    fi
    echo "compose test: not run: no Docker engine is reachable here (docker info failed)."
    echo "  Install Docker Engine with docker-compose to run it; under CI=true this is a failure."
    exit 0
fi
compose() {
    if command -v docker-compose >/dev/null 2>&1; then docker-compose "$@"; else docker compose "$@"; fi
}
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

project="tgcompose$$"
export COMPOSE_PROJECT_NAME=$project
export TOLLGATE_IMAGE="tollgate:$project" REDIS_IMAGE="tollgate-redis:$project"
export API1_PORT=$(free_port) API2_PORT=$(free_port) MOCK_PORT=$(free_port)
export TOLLGATE_ADMIN_TOKEN="admin-$project"

cleanup() {
    local rc=$?
    if [ $rc -ne 0 ]; then
        echo "compose test: failed; last logs:" >&2
        compose logs --tail 30 >&2 || true
    fi
    compose down -v --remove-orphans --timeout 10 >/dev/null 2>&1 || true
    left=$(docker ps -aq --filter "label=com.docker.compose.project=$project")
    docker rmi "$TOLLGATE_IMAGE" "$REDIS_IMAGE" >/dev/null 2>&1 || true
    if [ -n "$left" ]; then
        echo "compose test: FAILED: containers left after 'down': $left" >&2
        exit 1
    fi
    exit $rc
}
trap cleanup EXIT

bin=target/debug/tollgate
bench=target/debug/tollgate-bench
[ -x "$bin" ] && [ -x "$bench" ] || cargo build --workspace --bins
TOLLGATE_BIN=$bin scripts/build-images "$TOLLGATE_IMAGE" "$REDIS_IMAGE" >/dev/null
echo "compose test: images built; starting $project"
compose up -d --no-build

"$bench" compose-scenario \
    --api "http://127.0.0.1:$API1_PORT" --api "http://127.0.0.1:$API2_PORT" \
    --mock "http://127.0.0.1:$MOCK_PORT" --admin-token "$TOLLGATE_ADMIN_TOKEN" \
    --kill-worker "docker kill $(compose ps -q worker | head -n 1)"

compose down -v --remove-orphans --timeout 20 >/dev/null 2>&1
left=$(docker ps -aq --filter "label=com.docker.compose.project=$project")
if [ -n "$left" ]; then
    echo "compose test: FAILED: 'docker-compose down' left containers running: $left" >&2
    exit 1
fi
echo "compose test: passed"
