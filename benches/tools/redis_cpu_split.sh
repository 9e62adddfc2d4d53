#!/usr/bin/env bash
# Where an uncontended acquire + release spends its CPU: the client process against Redis, ours
# against the sorted-set script (suite 10's uncontended row: 8 clients, a roomy limit, 3 s).
# Runs each side alone, alternating, ROUNDS times (default 3), and prints per cycle:
#   side, cycles/s, client CPU (user + sys) per cycle, Redis CPU per cycle (INFO cpu), in µs.
# Needs Redis at REDIS_URL (default redis://127.0.0.1:6379) and GNU time (/usr/bin/time).
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${ROUNDS:-3}
url=${REDIS_URL:-redis://127.0.0.1:6379}
bin=$(cargo bench -p lanes-benches --bench redis --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "redis" and m.get("executable"):
        print(m["executable"])')
redis_cpu() {
  redis-cli -u "$url" INFO cpu | awk -F: '/^used_cpu_(sys|user):/{s += $2} END {printf "%.3f", s}'
}
for _ in $(seq "$rounds"); do
  for side in lanes anchor; do
    before=$(redis_cpu)
    out=$( { /usr/bin/time -f "client %U %S" env LANES_REDIS_SIDE=$side "$bin" --bench; } 2>&1 )
    after=$(redis_cpu)
    rate=$(echo "$out" | awk '/^side/{print $3}' | tr -d '/s')
    client=$(echo "$out" | awk '/^client/{print $2 + $3}')
    python3 -c "
rate, client, server = $rate, $client, $after - $before
cycles = rate * 3
print(f'$side: {rate:.0f}/s, client {client / cycles * 1e6:.1f} µs/cycle, Redis {server / cycles * 1e6:.1f} µs/cycle')"
  done
done
