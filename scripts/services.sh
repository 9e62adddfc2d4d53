#!/usr/bin/env bash
# Makes sure the services the tests talk to are up: Redis on REDIS_URL (default
# redis://127.0.0.1:6379) and NATS with JetStream on NATS_URL (default nats://127.0.0.1:4222).
# A service that is down on its default local address is started; a remote one is only checked.
# Headless Chromium (for the dashboard's browser test) is installed from Debian when missing.
#
# With --cluster (or LANES_REDIS_CLUSTER=1) it also makes sure a local Redis Cluster answers on
# REDIS_CLUSTER_PORTS (default 7000-7005 on 127.0.0.1): three primaries with a replica each,
# created with `redis-cli --cluster create`, state in /tmp/lanes-redis-cluster (nothing saved).
set -euo pipefail

cluster=${LANES_REDIS_CLUSTER:-0}
for arg in "$@"; do
  case "$arg" in
    --cluster) cluster=1 ;;
    *) echo "services: unknown argument $arg (known: --cluster)" >&2; exit 2 ;;
  esac
done

up() { # host port
  (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

wait_up() { # name host port
  for _ in $(seq 1 50); do
    if up "$2" "$3"; then return 0; fi
    sleep 0.1
  done
  echo "services: $1 at $2:$3 did not come up" >&2
  return 1
}

host_port() { # url default-port -> "host port"
  local rest=${1#*://}
  rest=${rest%%/*}
  rest=${rest##*@}
  local host=${rest%%:*} port=${rest##*:}
  [ "$port" = "$rest" ] && port=$2
  echo "$host $port"
}

read -r redis_host redis_port <<<"$(host_port "${REDIS_URL:-redis://127.0.0.1:6379}" 6379)"
read -r nats_host nats_port <<<"$(host_port "${NATS_URL:-nats://127.0.0.1:4222}" 4222)"

if ! up "$redis_host" "$redis_port"; then
  if [ "$redis_host" = 127.0.0.1 ] && command -v redis-server >/dev/null; then
    echo "services: starting redis-server on $redis_host:$redis_port"
    redis-server --daemonize yes --bind 127.0.0.1 --port "$redis_port" --save "" --appendonly no >/dev/null
    wait_up redis "$redis_host" "$redis_port"
  else
    echo "services: Redis is not reachable at $redis_host:$redis_port (set REDIS_URL)" >&2
    exit 1
  fi
fi

if ! up "$nats_host" "$nats_port"; then
  if [ "$nats_host" = 127.0.0.1 ] && [ -x /usr/sbin/nats-server ]; then
    echo "services: starting nats-server (JetStream) on $nats_host:$nats_port"
    mkdir -p /var/lib/nats-server
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
      -a 127.0.0.1 -p "$nats_port" -js -sd /var/lib/nats-server
    wait_up nats "$nats_host" "$nats_port"
  else
    echo "services: NATS is not reachable at $nats_host:$nats_port (set NATS_URL)" >&2
    exit 1
  fi
fi

if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null && [ -z "${CHROMIUM:-}" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "services: installing chromium (the dashboard test drives it headless)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 ||
      { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends chromium >/dev/null; }
  else
    echo "services: chromium is missing; install it (apt-get install chromium) or set CHROMIUM" >&2
    exit 1
  fi
fi

cluster_ok() { # port
  redis-cli -h 127.0.0.1 -p "$1" cluster info 2>/dev/null | grep -q '^cluster_state:ok'
}

if [ "$cluster" = 1 ]; then
  read -r -a ports <<<"${REDIS_CLUSTER_PORTS:-7000 7001 7002 7003 7004 7005}"
  all_ok=1
  for port in "${ports[@]}"; do cluster_ok "$port" || all_ok=0; done
  if [ "$all_ok" = 0 ]; then
    command -v redis-server >/dev/null || { echo "services: redis-server is missing" >&2; exit 1; }
    dir=/tmp/lanes-redis-cluster
    echo "services: starting a Redis Cluster on 127.0.0.1 ports ${ports[*]}"
    for port in "${ports[@]}"; do
      redis-cli -h 127.0.0.1 -p "$port" shutdown nosave >/dev/null 2>&1 || true
    done
    rm -rf "$dir"
    for port in "${ports[@]}"; do
      mkdir -p "$dir/$port"
      redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --dir "$dir/$port" \
        --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 1000 \
        --save "" --appendonly no --protected-mode no --logfile "$dir/$port/log" >/dev/null
      wait_up redis-cluster 127.0.0.1 "$port"
    done
    nodes=()
    for port in "${ports[@]}"; do nodes+=("127.0.0.1:$port"); done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >"$dir/create.log" 2>&1 ||
      { cat "$dir/create.log" >&2; exit 1; }
    for _ in $(seq 1 100); do
      all_ok=1
      for port in "${ports[@]}"; do cluster_ok "$port" || all_ok=0; done
      [ "$all_ok" = 1 ] && break
      sleep 0.1
    done
    [ "$all_ok" = 1 ] || { echo "services: the Redis Cluster did not reach state ok" >&2; exit 1; }
  fi
fi
