#!/usr/bin/env bash
# The docker-compose demo, run for real, as the docs tell a user to run it:
# the commands of the block marked for this test in docs/src/compose.md, in
# order, on the no-registry path (images FROM scratch of this machine's
# binaries, named by .env: no image name is exported here, so each command
# must work on its own). After its `docker-compose up -d` the test checks the
# monitoring profile (Prometheus on deploy/prometheus/prometheus.yml must
# scrape every pod and load the alert rules), drives load through both api
# pods, kills a worker mid-load and checks the outcome; the later commands'
# output is checked too, and the last tears everything down. Exit 0 = passed.
# With COMPOSE_CLUSTER=1, all of it on a 3-primary Redis Cluster.
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
# COMPOSE_CLUSTER=1: the same test on a 3-primary Redis Cluster
# (docker-compose.cluster.yml over docker-compose.yml).
files=(-f docker-compose.yml)
if [ "${COMPOSE_CLUSTER:-}" = 1 ]; then
    files+=(-f docker-compose.cluster.yml)
fi
compose() {
    if command -v docker-compose >/dev/null 2>&1; then docker-compose "${files[@]}" "$@"; else docker compose "${files[@]}" "$@"; fi
}
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

project="tgcompose$$"
# docker-compose 1.x gives the engine's API 60 s per request; a loaded CI
# machine has been slower than that while stopping nine containers.
export COMPOSE_HTTP_TIMEOUT=${COMPOSE_HTTP_TIMEOUT:-180}
export COMPOSE_PROJECT_NAME=$project
# The image names are .env's (tollgate:local, ...), as for a user.
unset TOLLGATE_IMAGE REDIS_IMAGE PROMETHEUS_IMAGE
image_of() { sed -n "s/^$1=//p" .env; }
TOLLGATE_IMAGE=$(image_of TOLLGATE_IMAGE) REDIS_IMAGE=$(image_of REDIS_IMAGE)
export API1_PORT=$(free_port) API2_PORT=$(free_port) MOCK_PORT=$(free_port)
export TOLLGATE_ADMIN_TOKEN="admin-$project"

# Prometheus comes from this machine's Debian package (scripts/test installs
# it); without it the monitoring check is said and skipped, unless CI=true.
PROMETHEUS_IMAGE=""
if command -v prometheus >/dev/null 2>&1; then
    PROMETHEUS_IMAGE=$(image_of PROMETHEUS_IMAGE)
    export PROMETHEUS_PORT=$(free_port)
    export COMPOSE_PROFILES=monitoring
elif [ "${CI:-}" = "true" ]; then
    echo "compose test: FAILED: prometheus (Debian package prometheus) is not installed and CI=true" >&2
    exit 1
else
    echo "compose test: prometheus not installed here: the monitoring profile is not checked"
fi

cleanup() {
    local rc=$?
    if [ $rc -ne 0 ]; then
        echo "compose test: failed; last logs:" >&2
        compose logs --tail 30 >&2 || true
    fi
    compose down -v --remove-orphans --timeout 10 >/dev/null 2>&1 || true
    left=$(docker ps -aq --filter "label=com.docker.compose.project=$project")
    docker rmi "$TOLLGATE_IMAGE" "$REDIS_IMAGE" $PROMETHEUS_IMAGE >/dev/null 2>&1 || true
    if [ -n "$left" ]; then
        echo "compose test: FAILED: containers left after 'down': $left" >&2
        exit 1
    fi
    exit $rc
}
trap cleanup EXIT

bin=${CARGO_TARGET_DIR:-target}/debug/tollgate
bench=${CARGO_TARGET_DIR:-target}/debug/tollgate-bench
[ -x "$bin" ] && [ -x "$bench" ] || cargo build --workspace --bins

# What the test checks once the stack is up: Prometheus, then the scenario.
after_up() {
    if [ -n "$PROMETHEUS_IMAGE" ]; then
        # Every api, worker and throttler scraped and up (2 + 3 + 2 targets), the
        # alert rules loaded, and the throttlers seen through the shared state.
        python3 - "http://127.0.0.1:$PROMETHEUS_PORT" <<'PY'
import json, sys, time, urllib.parse, urllib.request

base = sys.argv[1]

def get(path):
    with urllib.request.urlopen(base + path, timeout=5) as r:
        return json.load(r)["data"]

deadline = time.time() + 120
last = "no answer"
while True:
    try:
        targets = get("/api/v1/targets?state=active")["activeTargets"]
        up = sorted(t["labels"]["job"] for t in targets if t["health"] == "up")
        want = ["tollgate-api"] * 2 + ["tollgate-throttler"] * 2 + ["tollgate-worker"] * 3
        throttlers = get("/api/v1/query?query=" + urllib.parse.quote(
            'max by (provider) (tollgate_throttle_throttlers)'))["result"]
        if up == want and throttlers and all(s["value"][1] == "2" for s in throttlers):
            break
        last = f"up: {up}; throttlers: {throttlers}"
    except Exception as e:  # not up yet
        last = repr(e)
    if time.time() > deadline:
        sys.exit(f"compose test: FAILED: Prometheus never scraped every pod: {last}")
    time.sleep(2)
rules = [r for g in get("/api/v1/rules")["groups"] for r in g["rules"]]
bad = [r["name"] for r in rules if r["health"] != "ok"]
if len(rules) < 6 or bad:
    sys.exit(f"compose test: FAILED: alert rules: {len(rules)} loaded, unhealthy: {bad}")
print(f"compose test: Prometheus scrapes all 7 pods; {len(rules)} alert rules loaded")
PY
    fi

    "$bench" compose-scenario \
        --api "http://127.0.0.1:$API1_PORT" --api "http://127.0.0.1:$API2_PORT" \
        --mock "http://127.0.0.1:$MOCK_PORT" --admin-token "$TOLLGATE_ADMIN_TOKEN" \
        --kill-worker "docker kill $(compose ps -q worker | head -n 1)"
}

# The documented commands: the fenced block after the marker in compose.md.
mapfile -t steps < <(awk '/<!-- tests\/compose\/run.sh runs the commands of the next block/ {on=1; next}
    on && /^```sh$/ {inside=1; next} inside && /^```$/ {exit} inside {print}' docs/src/compose.md)
printf '%s\n' "${steps[@]}" | grep -qx 'docker-compose up -d *' || {
    echo "compose test: FAILED: no 'docker-compose up -d' in the marked block of docs/src/compose.md" >&2; exit 1; }
for step in "${steps[@]}"; do
    cmd=$(sed -E 's/ {2,}#.*$//' <<<"$step")
    echo "compose test: \$ $cmd"
    case "$cmd" in
        "cargo build --release -p tollgate-cli")
            # scripts/test built the debug binaries; they are what gets packaged.
            echo "compose test: packaging $bin instead of a release build" ;;
        "scripts/build-images")
            TOLLGATE_BIN=$bin scripts/build-images ${PROMETHEUS_IMAGE:+"$TOLLGATE_IMAGE" "$REDIS_IMAGE" "$PROMETHEUS_IMAGE"} >/dev/null ;;
        "docker-compose up -d")
            compose up -d
            after_up ;;
        "docker-compose up -d --scale worker="*)
            compose up -d --scale "worker=${cmd##*=}"
            n=$(compose ps -q worker | wc -l)
            [ "$n" = "${cmd##*=}" ] || { echo "compose test: FAILED: $n workers after '$cmd'" >&2; exit 1; } ;;
        "docker-compose exec -T redis redis-cli --scan --pattern "*)
            keys=$(compose exec -T redis redis-cli --scan --pattern 'tollgate:v1:{u:*' | wc -l)
            [ "$keys" -gt 0 ] || { echo "compose test: FAILED: no budget keys in Redis" >&2; exit 1; } ;;
        "curl -s http://127.0.0.1:9100/stats")
            stats=$(curl -sf "http://127.0.0.1:$MOCK_PORT/stats")
            python3 -c 'import json,sys; s=json.loads(sys.argv[1]); sys.exit(0 if s["requests"] > 0 and s["rate_limited"] == 0 else "compose test: FAILED: the upstream says " + sys.argv[1])' "$stats" ;;
        "docker-compose logs -f "*)
            # -f follows forever: the same logs, without following.
            compose logs --tail 5 ${cmd#docker-compose logs -f } >/dev/null ;;
        "docker-compose down -v")
            # The judgement is what is left, not down's exit code: on a loaded
            # machine docker-compose 1.x can time out on the engine's API, or
            # fail to drop the network while a container is still going away,
            # after it stopped everything. Such a down is said and run again,
            # as a user would.
            if ! out=$(compose down -v --remove-orphans --timeout 20 2>&1); then
                echo "compose test: 'docker-compose down -v' failed, running it again; it said:" >&2
                printf '%s\n' "$out" | tail -n 20 >&2
                sleep 2
                if ! out=$(compose down -v --remove-orphans --timeout 20 2>&1); then
                    echo "compose test: FAILED: 'docker-compose down -v' failed twice; it said:" >&2
                    printf '%s\n' "$out" | tail -n 20 >&2
                    exit 1
                fi
            fi
            left=$(docker ps -aq --filter "label=com.docker.compose.project=$project")
            if [ -n "$left" ]; then
                echo "compose test: FAILED: 'docker-compose down' left containers running: $left" >&2
                exit 1
            fi ;;
        *)
            echo "compose test: FAILED: docs/src/compose.md has a command this test does not know: $cmd" >&2
            exit 1 ;;
    esac
done
echo "compose test: passed"
