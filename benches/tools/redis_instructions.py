#!/usr/bin/env python3
"""Instructions a Redis server runs per limit operation: deterministic, unlike wall time on a
shared two-core host (suite 10's throughput rows swing by 2x from run to run here).

Starts a redis-server of its own under `valgrind --tool=cachegrind` on a spare port, loads
`crates/lanes-redis/src/limits.lua`, and runs N, then 2N, sequential cycles on one connection;
the difference of the two totals over N is the cost of one cycle, server start-up cancelled.
Cycles measured:

  lanes        FCALL acquire (granted at once) + FCALL release of a fresh ticket (the
               backend's own calls, as `RedisLimits::acquire` and `release` make them)
  lanes-riding the same through the `Limits` facade, a task that drops its permit and asks
               again: one FCALL acquire carrying the release of the ticket before it
  lanes-queued suite 10's contended pattern on a limit of one with four clients: the holder
               releases, which hands the permit to the first of three waiters (and
               publishes it), then asks again and queues at the back: two calls
  lanes-queued-riding  the same as one call: the acquire carrying the release
  sorted-set   the anchor of suite 10: its EVALSHA acquire script + a plain ZREM
  ping         a PING (the floor: reading, parsing and answering one command)

Usage: python3 benches/tools/redis_instructions.py [N]   (default 2000; needs valgrind and
redis-server on PATH; about a minute)
"""

import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIBRARY = os.path.join(ROOT, "crates", "lanes-redis", "src", "limits.lua")
PORT = 6397
# Suite 10's anchor, the same script its Rust side loads.
SORTED_SET_ACQUIRE = open(os.path.join(ROOT, "benches", "benches", "sorted_set_acquire.lua")).read()


class Conn:
    """A minimal RESP client: one request at a time."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.file = self.sock.makefile("rb")

    def __call__(self, *args):
        out = b"*%d\r\n" % len(args)
        for arg in args:
            arg = arg if isinstance(arg, bytes) else str(arg).encode()
            out += b"$%d\r\n%s\r\n" % (len(arg), arg)
        self.sock.sendall(out)
        return self.read()

    def read(self):
        line = self.file.readline()
        kind, rest = line[:1], line[1:-2]
        if kind == b"-":
            raise RuntimeError(rest.decode())
        if kind in (b"+", b":"):
            return rest
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self.file.read(n + 2)[:-2]
        if kind == b"*":
            return [self.read() for _ in range(int(rest))]
        raise RuntimeError(f"odd reply {line!r}")


def load_library(conn):
    library = open(LIBRARY).read().replace("__LANES_LIBRARY__", "lanes_icount")
    conn("FUNCTION", "LOAD", "REPLACE", library)


def roomy_limit(conn):
    """A limit of 100,000 on a fresh library: the FCALL prefix and the common arguments."""
    load_library(conn)
    base = ["FCALL", "lanes_icount", 1, "{icount:limit}"]
    common = ["lanes:{icount}:n:", 3000, 2000, 7]
    conn(*base, "define", *common, 100000, 0, 1, "", 0, 0, "")
    return base, common


def lanes_cycles(conn, n):
    base, common = roomy_limit(conn)
    for i in range(n):
        ticket = 7 * 2**32 + i + 1
        granted = conn(*base, "acquire", *common, ticket, 0, "k", 1, 1000, "new")
        assert b":" in granted, granted  # "fence:expires"
        assert conn(*base, "release", *common, ticket) == b"1"


def lanes_riding_cycles(conn, n):
    base, common = roomy_limit(conn)
    rider = []
    for i in range(n):
        ticket = 7 * 2**32 + i + 1
        granted = conn(*base, "acquire", *common, ticket, 0, "k", 1, 1000, "new", *rider)
        assert b":" in granted, granted
        rider = [ticket]


def lanes_queued_cycles(conn, n, riding=False):
    load_library(conn)
    base = ["FCALL", "lanes_icount", 1, "{icount:one}"]
    conn(*base, "define", "lanes:{icount}:n:", 3000, 2000, 7, 1, 0, 1, "", 0, 0, "")
    clients = [7, 8, 9, 10]
    tickets = {c: 0 for c in clients}

    def ask(client, rider=()):
        tickets[client] += 1
        ticket = client * 2**32 + tickets[client]
        common = ["lanes:{icount}:n:", 3000, 2000, client]
        return ticket, conn(*base, "acquire", *common, ticket, 0, "k", 1, 1000, "new", *rider)

    # The first client holds the permit; the others wait in line.
    line = []
    for client in clients:
        ticket, answer = ask(client)
        line.append((client, ticket))
    holder = line.pop(0)
    for _ in range(n):
        client, ticket = holder
        common = ["lanes:{icount}:n:", 3000, 2000, client]
        if not riding:
            assert conn(*base, "release", *common, ticket) == b"1"
        holder = line.pop(0)  # granted on its behalf (pushed to its client)
        again, answer = ask(client, [ticket] if riding else [])
        assert answer[0] == b"0000000000000000", answer
        line.append((client, again))


def sorted_set_cycles(conn, n):
    sha = conn("SCRIPT", "LOAD", SORTED_SET_ACQUIRE)
    for i in range(n):
        assert conn("EVALSHA", sha, 1, "{icount}:ss", 100000, i, 30000) == b"1"
        assert conn("ZREM", "{icount}:ss", i) == b"1"


def ping_cycles(conn, n):
    for _ in range(n):
        conn("PING")


def instructions(cycles, n):
    """Instructions the server ran for its whole life, with `n` cycles run in it."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "valgrind.log")
        server = subprocess.Popen(
            ["valgrind", "--tool=cachegrind", "--cache-sim=no",
             "--cachegrind-out-file=/dev/null", f"--log-file={log}",
             "redis-server", "--port", str(PORT), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", tmp],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(300):
                try:
                    conn = Conn(PORT)
                    conn("PING")
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                raise RuntimeError("the redis-server under valgrind did not start")
            cycles(conn, n)
            try:
                conn("SHUTDOWN", "NOSAVE")
            except (RuntimeError, OSError):
                pass
        finally:
            server.wait(timeout=120)
        for line in open(log):
            if "I   refs" in line or "I refs" in line:
                return int(line.split()[-1].replace(",", ""))
    raise RuntimeError("no instruction count in valgrind's log")


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    only = os.environ.get("ONLY")
    for name, cycles in [("lanes", lanes_cycles), ("lanes-riding", lanes_riding_cycles),
                         ("lanes-queued", lanes_queued_cycles),
                         ("lanes-queued-riding",
                          lambda conn, n: lanes_queued_cycles(conn, n, riding=True)),
                         ("sorted-set", sorted_set_cycles), ("ping", ping_cycles)]:
        if only and name != only:
            continue
        per_cycle = (instructions(cycles, 2 * n) - instructions(cycles, n)) / n
        print(f"{name:<20} {per_cycle:>9,.0f} instructions per cycle")


if __name__ == "__main__":
    main()
