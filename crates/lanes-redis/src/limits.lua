#!lua name=__LANES_LIBRARY__
-- lanes-redis: one limit's state machine, run atomically by Redis: a Redis Functions library
-- (Redis 7+) with one function per limit (and one for the namespace's names), loaded once per
-- server. Its helpers are defined once, when the
-- library loads; each call sets the call's keys and arguments and runs one operation.
--
-- The same semantics as lanes' in-process LimitTable (crates/lanes/src/limit/table.rs) and
-- WaitQueue (limit/waiters.rs): a counting semaphore and a GCRA token bucket in front of a wait queue
-- ordered by priority level, then weighted round-robin over fairness keys, then arrival. Every
-- grant is a lease. Time is the Redis server's (TIME), in microseconds.
--
-- KEYS[1] is the limit's base key, "{namespace:limit}"; every key of the limit is derived from
-- it and shares its hash tag, so the whole limit lives in one Redis Cluster slot.
--   B:m       hash: concurrent, interval (us, 0 = no rate), rate, burst, tat, fence (the last
--             token; grants so far = fence - fbase), maxuse, seq, hold, movehold, node, run (the
--             `run_id` of the server that last wrote it), runhold (the longest lease, ms)
--   B:h       hash: held ticket -> "fence:expires"
--   B:e       zset: held ticket by lease expiry
--   B:lv      zset: priority levels with waiters
--   B:i       hash: waiting ticket -> "level|keytok|seq"
--   B:r:L     zset: level L's fairness keys by ring position
--   B:w:L     hash: level L's key weights, plus ~npos (next ring position), ~tpos/~tused (turn)
--   B:q:L:K   zset: key K's waiting tickets by arrival sequence
--   B:l       hash: waiting ticket -> the lease (us) it asked for, used when it is granted on
--             its behalf (never the lease of whoever's call made the grant)
--   B:c       hash: client id -> when it was last heard from (us: when it queued a ticket, or
--             touched the limit, which it does while it has waiters); a queue head whose
--             client is silent past the queue grace is dropped, so a dead client's tickets
--             never hold a free limit
--
-- ARGV[1] is the operation, ARGV[2] the channel prefix of client notifications, ARGV[3] the
-- lease in ms, ARGV[4] the queue grace in ms, ARGV[5] the calling client's id; the rest
-- (from ARGV[6]) depends on the operation. `acquire`, `check`, `try` and `release` may carry
-- riders after their own arguments: tickets of the same client to release first (permits it
-- dropped since its last call, sent with its next one rather than in calls of their own).
--
-- Fencing tokens start from the Redis clock (us) when a limit is created, so they keep growing
-- across a DELETE + PUT and across a restart that lost everything (a limit would have to grant
-- more than once per microsecond to catch up with the clock). After a client saw Redis lose its
-- state it redefines the limit with a hold: no grant before `hold` (the end of every lease that
-- could still be believed held). Tickets travel as decimal strings; a ticket's client is
-- floor(ticket / 2^32). An ask (`acquire`, `check`, `try`) granted to the ticket asked about
-- is answered with the grant alone, "fence:expires" as one string (the holder's entry); any
-- other answer is an array whose first element is one u64, as 16 hex digits (Lua numbers are
-- doubles): 0 queued, 2 + ms retry later, or bit 63 + zigzag(granted - asked) with that
-- grant's fence and expiry.

-- The call's keys and arguments, set by `call` (library-level, so the helpers below are
-- created once, not on every call).
local B, op, channels, lease_us, grace_us, caller, ARGV
local M, H, E, LV, I, C, L, NAME
-- The time of the call (us), once the limit is known to exist.
local now
local CLIENT = 4294967296

local function hex(n) return string.format('%016x', n) end
local function int(n) return string.format('%.0f', n) end
-- A whole number (a time in us, a token) as decimal digits: '%d' formats it as an integer,
-- where `int`'s '%.0f' goes through the floating-point printer, several times the cost inside
-- Redis. The hot paths (grant, renewal, expiry) use this one.
local function dec(n) return string.format('%d', n) end
-- The answer `hex(0)` (queued), written out once.
local QUEUED = '0000000000000000'

-- Numbers parsed from the few strings that come back call after call (settings, leases, the
-- clock's seconds): inside Redis `tonumber` costs about as much as a command, a lookup here a
-- tenth of that. Each entry is the string's own value, so it is never stale; the table is
-- emptied when it reaches 1,024 entries.
local parsed, nparsed = {}, 0
local function number(text)
  local n = parsed[text]
  if n then return n end
  n = tonumber(text)
  if nparsed >= 1024 then parsed, nparsed = {}, 0 end
  parsed[text] = n
  nparsed = nparsed + 1
  return n
end

local function now_us()
  local t = redis.call('TIME')
  return number(t[1]) * 1000000 + tonumber(t[2])
end

local function num(key, field)
  return tonumber(redis.call('HGET', key, field) or '0')
end

-- A setting as a number.
local function setting(text, default)
  if not text then return default end
  return number(text)
end

-- The limit's settings as numbers, read once per call.
local meta
local function load_meta()
  local v = redis.call('HMGET', M, 'concurrent', 'interval', 'burst', 'tat', 'maxuse', 'hold',
    'movehold', 'node', 'mode', 'run', 'runhold')
  if not v[1] then return false end
  meta = {
    concurrent = number(v[1]),
    interval = setting(v[2], 0),
    burst = setting(v[3], 1),
    tat = setting(v[4], 0),
    maxuse = setting(v[5], 0),
    hold = setting(v[6], 0),
    movehold = setting(v[7], 0),
    node = v[8],
    mode = v[9],
    run = v[10],
    runhold = setting(v[11], 0),
  }
  return true
end

-- The limit may have lost its last writes (a failover, a restart from data that lags): no
-- grant before `hold` (us), and tokens go on past the clock, and past the counter by a
-- margin (the new server's clock may be behind the old one's, and the grants lost with it
-- are far fewer than a million).
local function lost_writes(now, hold)
  if hold > meta.hold then meta.hold = hold end
  local fence = num(M, 'fence')
  local jump = math.max(now - fence, 0) + 1000000
  redis.call('HSET', M, 'hold', int(meta.hold), 'fence', int(fence + jump),
    'fbase', int(num(M, 'fbase') + jump))
end

-- The `run_id` of this server, new at every start of its process: read once per load of the
-- library (a `FUNCTION LOAD REPLACE` reads it again, and finds the same). '' where `INFO` is
-- not allowed (an ACL without @dangerous): then restarts that keep the data go unseen here.
local boot
local function run_id()
  if not boot then
    local info = redis.pcall('INFO', 'server')
    boot = type(info) == 'string' and string.match(info, 'run_id:(%w+)') or ''
  end
  return boot
end

-- When this server was first seen promoted, by the replication id it had before
-- (`master_replid2`, new at each promotion): the first call after a promotion dates it (a
-- little late, never early), for as long as this library is loaded.
local promoted = {}

-- Since when this server may have served the limit: no earlier than its start, or, if
-- `second_repl_offset` is set (it was promoted from a replica, and began serving at the
-- promotion, which nothing dates; or it loaded replication data with its snapshot), when a
-- call first saw that (so a limit made new stops being held a lease after that, not for as
-- long as the server runs); now if `INFO` cannot be read. Its uptime is the difference of two
-- whole-second clocks, its start's
-- (`stat_starttime`) and the last command's, never later than now's second: so the start's
-- second is at most now's minus the uptime, and the start is before the second after that (a
-- start at 12.99 s read at 13.01 s says 1: the start is before 13 s). Never after now.
local function serving_since(now)
  local server, repl = redis.pcall('INFO', 'server'), redis.pcall('INFO', 'replication')
  if type(server) ~= 'string' or type(repl) ~= 'string' then return now end
  if string.match(repl, 'second_repl_offset:(%-?%d+)') ~= '-1' then
    local before = string.match(repl, 'master_replid2:(%w+)') or ''
    if not promoted[before] then promoted[before] = now end
    return math.min(now, promoted[before])
  end
  local uptime = tonumber(string.match(server, 'uptime_in_seconds:(%d+)') or '')
  if not uptime then return now end
  return math.min(now, (math.floor(now / 1000000) - uptime + 1) * 1000000)
end

-- The limit was last written by another run of this server: it restarted, and may have come
-- back from a snapshot or an append-only file that lags (the namespace's epoch kept, the last
-- grants lost). As after a move to another node: no grant before every lease that may have
-- been lost has ended (the longest lease, runhold ms, from when this server began serving:
-- a lost grant was made before), and tokens go on past the clock. A restart that lost
-- everything has no limit left to find here: the clients that held permits see the epoch
-- gone and define their limits again with the same hold.
local function watch_run(now)
  local me = run_id()
  if me == '' or meta.run == me then return end
  if meta.run and meta.run ~= '' and meta.runhold > 0 then
    lost_writes(now, serving_since(now) + meta.runhold * 1000)
  end
  redis.call('HSET', M, 'run', me)
  meta.run = me
end

-- On a Redis Cluster (movehold > 0): the limit is served by another node than the one that
-- last wrote it, so a replica was promoted (or the slot moved) and may lack the last writes:
-- grants it lost may still be believed held, and their fencing tokens handed out again. No
-- grant before every lease that may have been lost has ended (the longest lease, movehold ms),
-- and tokens go on from the clock, past any handed out.
local function watch_node(now)
  if meta.movehold <= 0 then return end
  local me = redis.call('CLUSTER', 'MYID')
  if me == meta.node then return end
  if meta.node then lost_writes(now, now + meta.movehold * 1000) end
  redis.call('HSET', M, 'node', me)
  meta.node = me
end

local function ring(level) return B .. ':r:' .. level end
local function weights(level) return B .. ':w:' .. level end
local function queue(level, keytok) return B .. ':q:' .. level .. ':' .. keytok end

-- Leases ---------------------------------------------------------------------------------

local function expire(now)
  local dead = redis.call('ZRANGEBYSCORE', E, '-inf', dec(now))
  for _, ticket in ipairs(dead) do
    redis.call('HDEL', H, ticket)
    redis.call('ZREM', E, ticket)
  end
  return #dead
end

local function in_use() return redis.call('HLEN', H) end

-- Grants so far (a limit created before `fbase` existed counted them in `granted`).
local function granted()
  local base = redis.call('HGET', M, 'fbase')
  if not base then return num(M, 'granted') end
  return num(M, 'fence') - tonumber(base)
end

-- GCRA: the time the next grant takes the bucket to, or nil and the time a token will be there.
local function rate_check(now)
  if meta.hold > now then return nil, meta.hold end
  local tat = meta.tat
  if meta.interval == 0 then return tat, nil end
  local tolerance = meta.interval * (meta.burst - 1)
  if tat < now then tat = now end
  local earliest = tat - tolerance
  if earliest <= now then return tat + meta.interval, nil end
  return nil, earliest
end

-- Grants the permit of `ticket`; returns its fencing token and lease end, as strings, and
-- the two as its holder's entry ("fence:expires"), which is also the answer of a grant to the
-- ticket asked about. `used` is the permits in use before it, if the caller knows.
local function grant(ticket, now, lease, used)
  if meta.interval > 0 then
    local tat = rate_check(now)
    if tat then
      meta.tat = tat
      redis.call('HSET', M, 'tat', dec(tat))
    end
  end
  local fence = dec(redis.call('HINCRBY', M, 'fence', '1'))
  local expires = dec(now + (lease or lease_us))
  local held = fence .. ':' .. expires
  redis.call('HSET', H, ticket, held)
  redis.call('ZADD', E, expires, ticket)
  if used then used = used + 1 else used = in_use() end
  if used > meta.maxuse then
    meta.maxuse = used
    redis.call('HSET', M, 'maxuse', used)
  end
  return fence, expires, held
end

-- The wait queue -------------------------------------------------------------------------

local function top_level()
  local top = redis.call('ZREVRANGE', LV, '0', '0')
  return top[1]
end

local function key_at(level, pos)
  local found = redis.call('ZRANGEBYSCORE', ring(level), pos, pos)
  return found[1]
end

-- The fairness key served next at `level` (WaitQueue's Level::next_key).
local function next_key(level)
  local w = weights(level)
  local tpos = redis.call('HGET', w, '~tpos')
  if tpos then
    local key = key_at(level, tpos)
    if key and num(w, '~tused') < num(w, key) then return key end
    local after = redis.call('ZRANGEBYSCORE', ring(level), '(' .. tpos, '+inf', 'LIMIT', '0', '1')
    if after[1] then return after[1] end
  end
  return redis.call('ZRANGE', ring(level), '0', '0')[1]
end

-- The ticket served next, its level and key: looked up once per call until the queue
-- changes (`push` and `unlink` forget it), since one call asks several times.
local peeked
local function peek()
  if not peeked then
    peeked = {}
    local level = top_level()
    local key = level and next_key(level)
    if key then
      peeked = { redis.call('ZRANGE', queue(level, key), '0', '0')[1], level, key }
    end
  end
  return peeked[1], peeked[2], peeked[3]
end

-- `fresh`: the ticket's first call (see quick_acquire), so it cannot be queued already.
local function push(ticket, level, keytok, weight, fresh)
  peeked = nil
  if not fresh and redis.call('HEXISTS', I, ticket) == 1 then return false end
  local seq = dec(redis.call('HINCRBY', M, 'seq', '1'))
  local w = weights(level)
  local r = ring(level)
  redis.call('ZADD', LV, level, level)
  if redis.call('ZSCORE', r, keytok) then
    redis.call('HSET', w, keytok, weight)
  else
    local pos = dec(redis.call('HINCRBY', w, '~npos', '1') - 1)
    redis.call('ZADD', r, pos, keytok)
    redis.call('HSET', w, keytok, weight)
  end
  redis.call('ZADD', queue(level, keytok), seq, ticket)
  redis.call('HSET', I, ticket, level .. '|' .. keytok .. '|' .. seq)
  redis.call('HSET', L, ticket, dec(lease_us))
  -- Its client is alive: it queued a ticket now (and touches the limit while it waits).
  redis.call('HSET', C, caller, dec(now))
  return true
end

local function locate(ticket)
  local where = redis.call('HGET', I, ticket)
  if not where then return nil end
  local level, keytok = string.match(where, '^([^|]*)|(.*)|[^|]*$')
  return level, keytok
end

-- WaitQueue::unlink: drops one waiter, then its key and level if they empty. `single`: the
-- level's ring is known to hold this one key, so it has no turn to clear.
local function unlink(ticket, level, keytok, single)
  peeked = nil
  local q = queue(level, keytok)
  local w = weights(level)
  local r = ring(level)
  redis.call('ZREM', q, ticket)
  redis.call('HDEL', I, ticket)
  redis.call('HDEL', L, ticket)
  if redis.call('ZCARD', q) == 0 then
    local pos = redis.call('ZSCORE', r, keytok)
    redis.call('ZREM', r, keytok)
    redis.call('HDEL', w, keytok)
    if redis.call('HGET', w, '~tpos') == pos then
      local after = redis.call('ZRANGEBYSCORE', r, '(' .. pos, '+inf', 'WITHSCORES', 'LIMIT', '0', '1')
      if after[1] then
        redis.call('HSET', w, '~tpos', after[2], '~tused', '0')
      else
        redis.call('HDEL', w, '~tpos', '~tused')
      end
    end
    if redis.call('ZCARD', r) == 0 then
      redis.call('DEL', r, w)
      redis.call('ZREM', LV, level)
      return
    end
  end
  if not single and redis.call('ZCARD', r) == 1 then redis.call('HDEL', w, '~tpos', '~tused') end
end

-- WaitQueue::pop of the ticket `peek` returned. Turns are kept only between keys: a level
-- with one key has none (unlink clears it when a level comes down to one key).
local function pop(ticket, level, keytok)
  if redis.call('ZCARD', ring(level)) == 1 then
    unlink(ticket, level, keytok, true)
    return
  end
  local w = weights(level)
  local pos = redis.call('ZSCORE', ring(level), keytok)
  local v = redis.call('HMGET', w, keytok, '~tpos', '~tused')
  local weight, tpos, tused = tonumber(v[1] or '0'), v[2], tonumber(v[3] or '0')
  if tpos == pos and tused < weight then
    redis.call('HSET', w, '~tused', dec(tused + 1))
  else
    redis.call('HSET', w, '~tpos', pos, '~tused', '1')
  end
  unlink(ticket, level, keytok)
end

local function waiting() return redis.call('HLEN', I) end

local function client_of(ticket) return math.floor(tonumber(ticket) / CLIENT) end

-- The client of the ticket `peek` returned, as the decimal id its channel and its entry in C
-- are named by: worked out once per head (a number parsed and printed costs as much inside
-- Redis as a few commands).
local function head_client()
  if not peeked[4] then peeked[4] = dec(client_of(peeked[1])) end
  return peeked[4]
end

-- Hands out what can be handed out: while the ticket served next can be granted, grant it on
-- its waiter's behalf and tell its client (one client per grant, never every waiter). A head
-- that waits for the bucket gets a plain wake-up, so its client asks and learns when.
-- A granted waiter that is gone returns its permit, or its lease does.
-- Drops queue heads whose client is silent past the queue grace (a client that died or
-- stopped without withdrawing): their tickets would otherwise be granted to nobody.
local function purge(now)
  while true do
    local head, level, key = peek()
    if not head then return end
    local seen = tonumber(redis.call('HGET', C, head_client()) or '0')
    if now - seen <= grace_us then return end
    unlink(head, level, key)
  end
end

local function kick(now)
  if waiting() == 0 then return end
  purge(now)
  -- The permits in use, counted once: each grant below adds one and nothing else here changes
  -- them, so a limit the last grant filled is seen before the next head is looked up.
  local used = in_use()
  while used < meta.concurrent do
    local head, level, key = peek()
    if not head then return end
    local _, at = rate_check(now)
    if at then
      redis.call('PUBLISH', channels .. head_client(), NAME)
      return
    end
    local lease = number(redis.call('HGET', L, head) or '0')
    if lease <= 0 then lease = nil end
    local client = head_client()
    pop(head, level, key)
    local fence, expires = grant(head, now, lease, used)
    used = used + 1
    redis.call('PUBLISH', channels .. client, head .. '|' .. fence .. '|' .. expires .. '|' .. NAME)
  end
end

-- Milliseconds until the earliest lease ends (-1 if none): a queued client wakes then, so a
-- crashed holder's permit is handed on as soon as it lapses.
local function expiry_hint(now)
  local first = redis.call('ZRANGE', E, '0', '0', 'WITHSCORES')
  if not first[2] then return -1 end
  local ms = math.ceil((tonumber(first[2]) - now) / 1000)
  if ms < 0 then ms = 0 end
  return ms
end

-- The answer for a ticket that holds a permit (its grant again), or nil.
local function held_answer(ticket)
  local held = redis.call('HGET', H, ticket)
  if not held then return nil end
  -- Asked again (its answer or its push was lost, or a retry): its lease starts again now,
  -- so the client, which counts the lease from its ask, never believes it longer than Redis.
  -- The answer is the grant as first made (an acquire by ticket answers the same grant).
  local fence = string.match(held, '^(%d+):')
  local renewed = dec(now + lease_us)
  redis.call('HSET', H, ticket, fence .. ':' .. renewed)
  redis.call('ZADD', E, renewed, ticket)
  return held
end

-- The answer to an ask for `ticket`, which waits: granted if it is served next and can be
-- (or another ticket of the same client is, which is granted instead), else queued or retry.
-- `used` is the permits in use, if the caller counted them. A full limit answers before the
-- queue is looked at: nothing can be granted, and a silent client's head is purged by the
-- next call that can grant (every grant goes through `purge` first).
local function answer_for(ticket, used)
  used = used or in_use()
  if used >= meta.concurrent then
    return { QUEUED, expiry_hint(now) }
  end
  purge(now)
  local head, hlevel, hkey = peek()
  local _, at = rate_check(now)
  if at then
    if head == ticket then return { hex(2 + math.ceil((at - now) / 1000)) } end
    -- Another ticket of this client is served next: queued, with the time its token comes as
    -- the hint of when to look again. The client asks for one of its waiters only (this one),
    -- which answers for the head; the lease hint alone left both asleep up to a second.
    if head and client_of(head) == client_of(ticket) then
      return { QUEUED, math.ceil((at - now) / 1000) }
    end
    return { QUEUED, expiry_hint(now) }
  end
  if head == ticket then
    pop(head, hlevel, hkey)
    local _, _, held = grant(head, now, nil, used)
    kick(now)
    return held
  end
  if head and client_of(head) == client_of(ticket) then
    -- Another ticket of the same client is served next: grant it instead, with its own lease.
    local lease = number(redis.call('HGET', L, head) or '0')
    if lease <= 0 then lease = nil end
    pop(head, hlevel, hkey)
    local fence, expires = grant(head, now, lease, used)
    kick(now)
    local distance = tonumber(head) - tonumber(ticket)
    local zigzag
    if distance >= 0 then zigzag = distance * 2 else zigzag = -distance * 2 - 1 end
    return { '8' .. string.format('%015x', zigzag), fence, expires }
  end
  kick(now)
  return { QUEUED, expiry_hint(now) }
end

-- Leased capacity ------------------------------------------------------------------------
-- The same apportioning and ledger as lanes::limit::share (crates/lanes/src/limit/share/mod.rs),
-- run where the limit lives. B:ls holds each client's entry, "share|reserved|held|expires|
-- seq|demand" (demand as "level:n,level:n"); B:lt the targets of the live clients, valid while
-- M's `lvalid` is 1 (a demand or the set of clients changing clears it). A limit with a rate
-- has a second ledger of the same shape for its rate, in thousandths of a grant per second:
-- B:rs, B:rt and `rvalid`.

local function parse_demand(text)
  local demand = {}
  for level, n in string.gmatch(text or '', '(%d+):(%d+)') do
    demand[tonumber(level)] = (demand[tonumber(level)] or 0) + tonumber(n)
  end
  return demand
end

-- Water-filling over `wants` ({id, want}), as share/mod.rs's max_min.
local function max_min(capacity, wants)
  table.sort(wants, function(a, b)
    if a.want ~= b.want then return a.want < b.want end
    return a.id < b.id
  end)
  local left, n = capacity, #wants
  for k, w in ipairs(wants) do
    w.give = math.min(w.want, math.floor(left / (n - k + 1)))
    left = left - w.give
  end
  for k = n, 1, -1 do
    if left <= 0 then break end
    local w = wants[k]
    if w.give < w.want then
      w.give = w.give + 1
      left = left - 1
    end
  end
end

-- In proportion to want, remainders largest first, as share/mod.rs's proportional.
local function proportional(capacity, wants)
  local total = 0
  for _, w in ipairs(wants) do total = total + w.want end
  if total <= capacity then
    for _, w in ipairs(wants) do w.give = w.want end
    return
  end
  local left = capacity
  for _, w in ipairs(wants) do
    local scaled = capacity * w.want
    w.give = math.min(w.want, math.floor(scaled / total))
    w.rem = scaled % total
    left = left - w.give
  end
  -- Past 2^53 (a rate ledger's thousandths, times a demand) doubles round: whatever the
  -- rounding, never more than the capacity.
  for _, w in ipairs(wants) do
    if left >= 0 then break end
    local take = math.min(w.give, -left)
    w.give = w.give - take
    left = left + take
  end
  local order = {}
  for k = 1, #wants do order[k] = wants[k] end
  table.sort(order, function(a, b)
    if a.rem ~= b.rem then return a.rem > b.rem end
    return a.id < b.id
  end)
  for _, w in ipairs(order) do
    if left <= 0 then break end
    if w.give < w.want then
      w.give = w.give + 1
      left = left - 1
    end
  end
end

-- Targets for `clients` ({id, demand}), by id: levels highest first, then the policy.
local function apportion(capacity, clients, policy)
  local shares, levels, seen = {}, {}, {}
  for _, c in ipairs(clients) do
    shares[c.id] = 0
    for level in pairs(c.demand) do
      if not seen[level] then
        seen[level] = true
        table.insert(levels, level)
      end
    end
  end
  table.sort(levels, function(a, b) return a > b end)
  local left = capacity
  for _, level in ipairs(levels) do
    if left <= 0 then break end
    local wants = {}
    for _, c in ipairs(clients) do
      local want = c.demand[level] or 0
      if want > 0 then table.insert(wants, { id = c.id, want = want }) end
    end
    if policy == 'proportional' then proportional(left, wants) else max_min(left, wants) end
    for _, w in ipairs(wants) do
      shares[w.id] = shares[w.id] + w.give
      left = left - w.give
    end
  end
  return shares
end


-- Operations -----------------------------------------------------------------------------

-- The common acquire, granted without the full path's reads: an exact limit without a rate on
-- one node, nobody waiting, a permit free, no hold, and a ticket that holds nothing yet (a
-- retry goes the full path, which answers the grant it holds). Lapsed leases are not swept
-- here: they count as held until a call that finds the limit full, or waiters, sweeps them,
-- which only ever grants less. nil: take the full path. 8 commands; the full path's 9 plus
-- its queue logic cost about a third more Redis time.
local function quick_acquire(nobody_waits)
  if not nobody_waits and redis.call('HLEN', I) ~= 0 then return nil end
  local v = redis.call('HMGET', M, 'concurrent', 'interval', 'hold', 'movehold', 'mode', 'maxuse',
    'run')
  -- Settings compared as the strings they are where that is enough: a number parsed inside
  -- Redis costs about as much as one of the commands here. A limit last written by another
  -- run of the server takes the full path (`watch_run`).
  local me = run_id()
  if not v[1] or v[5] or (v[2] and v[2] ~= '0') or (v[4] and v[4] ~= '0')
    or (me ~= '' and v[7] ~= me) then
    return nil
  end
  local used = redis.call('HLEN', H)
  if used >= number(v[1]) then return nil end
  local ticket = ARGV[6]
  -- ARGV[11] 'new': the client made no call about this ticket before, so it is not held here
  -- (a retry after a lost answer never says so).
  if ARGV[11] ~= 'new' and redis.call('HEXISTS', H, ticket) == 1 then return nil end
  local t = redis.call('TIME')
  local at = number(t[1]) * 1000000 + tonumber(t[2])
  if v[3] and v[3] ~= '0' and tonumber(v[3]) > at then return nil end
  -- What `grant` reads, for a limit without a rate.
  meta = { interval = 0, maxuse = setting(v[6], 0) }
  lease_us = number(ARGV[3]) * 1000
  local _, _, held = grant(ticket, at, nil, used)
  return held
end

-- The limit whose key names are set: calls in a row on one limit build them once.
local named

-- Where an operation's riders start (see the top), by operation. A release's own ticket is
-- released the same way as its riders: from ARGV[6].
local RIDERS = { acquire = 12, check = 7, try = 7, release = 6 }

-- Releases `ticket`, held or waiting: 1 if it held a permit, 2 if it waited, 0 if neither.
-- The caller kicks the queue afterwards.
local function release_one(ticket)
  if redis.call('HDEL', H, ticket) == 1 then
    redis.call('ZREM', E, ticket)
    return 1
  end
  local level, keytok = locate(ticket)
  if level then
    unlink(ticket, level, keytok)
    return 2
  end
  return 0
end

-- One call: `keys` and `args` as described at the top.
local function call(keys, args)
  B, ARGV = keys[1], args
  op = args[1]
  if B ~= named then
    M, H, E, LV = B .. ':m', B .. ':h', B .. ':e', B .. ':lv'
    I, C, L = B .. ':i', B .. ':c', B .. ':l'
    NAME = string.sub(B, 2, -2)
    named = B
  end
  -- Riders (and a release's own ticket) while nobody waits: there is nothing to grant, so
  -- nothing to read or time: the holders' entries go, and that is all. Else they are
  -- released on the full path, which then hands their permits on.
  local riders = RIDERS[op]
  -- The tickets waiting, once read.
  local in_queue
  if riders and ARGV[riders] then in_queue = redis.call('HLEN', I) end
  if in_queue == 0 then
    local first = 0
    for k = riders, #ARGV do
      local held = redis.call('HDEL', H, ARGV[k])
      if held == 1 then redis.call('ZREM', E, ARGV[k]) end
      if k == 6 then first = held end
    end
    riders = nil
    -- The common release: a held permit, and nobody waiting.
    if op == 'release' then return first end
  end
  if op == 'acquire' and (not in_queue or in_queue == 0) then
    local granted_now = quick_acquire(in_queue == 0)
    if granted_now then return granted_now end
  end
  channels = args[2]
  lease_us, grace_us = number(args[3]) * 1000, number(args[4]) * 1000
  caller = args[5]
  meta, now, peeked = nil, nil, nil

  if op == 'define' then
    -- ARGV: concurrent, interval_us, burst, per_second (as the client wrote it, "" for none),
    -- hold_ms (0: none), movehold_ms (on a cluster: the hold after the limit changed nodes; 0
    -- elsewhere)
    local fresh = redis.call('EXISTS', M) == 0
    -- An exact limit becomes leased only while nobody holds or waits: shares are apportioned
    -- from the whole capacity, and exact holders (renewing) and waiters (granted by `kick`)
    -- would come on top of them.
    if not fresh and ARGV[12] and string.sub(ARGV[12], 1, 7) == 'leased:'
        and not redis.call('HGET', M, 'mode') then
      -- Permits whose leases ended do not count (nor keep the switch refused for good).
      expire(now_us())
      if in_use() > 0 or redis.call('HLEN', I) > 0 then return 'in_use' end
    end
    local now = now_us()
    redis.call('HSET', M, 'concurrent', ARGV[6], 'interval', ARGV[7], 'burst', ARGV[8], 'rate', ARGV[9])
    -- ARGV[13]: the client's longest lease (ms), the hold after a restart of the server
    -- (`watch_run`); the longest any client gave.
    local runhold = tonumber(ARGV[13] or '0')
    if fresh then
      -- A limit made new on a server that began serving less than a lease ago may be one an
      -- empty restart forgot, with permits still believed held: no grant before every lease
      -- that may have been lost has ended, as for a limit a restart kept (`watch_run`).
      -- (Nothing tells a new server from an emptied one: a limit defined in its first lease
      -- waits the rest of it.)
      local hold = 0
      if runhold > 0 then
        hold = serving_since(now) + runhold * 1000
        if hold <= now then hold = 0 end
      end
      redis.call('HSET', M, 'tat', 0, 'fence', int(now), 'fbase', int(now), 'maxuse', 0, 'seq', 0,
      'hold', int(hold), 'run', run_id())
    end
    if runhold > num(M, 'runhold') then redis.call('HSET', M, 'runhold', runhold) end
    local hold_ms = tonumber(ARGV[10] or '0')
    if hold_ms > 0 then
      local hold = now + hold_ms * 1000
      if hold > num(M, 'hold') then redis.call('HSET', M, 'hold', int(hold)) end
    end
    local movehold = tonumber(ARGV[11] or '0')
    if movehold > 0 then redis.call('HSET', M, 'movehold', movehold) end
    -- The capacity may have changed: leased shares' targets are computed again.
    redis.call('HSET', M, 'lvalid', '0', 'rvalid', '0')
    -- ARGV[12]: the mode, "leased:<policy>" for leased capacity; "" keeps the limit's mode
    -- (exact for a new one). A leased limit goes back to exact only through a removal.
    if ARGV[12] and ARGV[12] ~= '' then
      redis.call('HSET', M, 'mode', ARGV[12])
    end
    load_meta()
    watch_node(now)
    watch_run(now)
    expire(now)
    kick(now)
    return 'ok'
  end

  if not load_meta() then
    -- The limit is gone (removed, or its settings lost): its riders' entries go anyway.
    if riders and ARGV[riders] then
      for k = riders, #ARGV do release_one(ARGV[k]) end
    end
    return { 'unknown' }
  end
  now = now_us()
  watch_node(now)
  watch_run(now)
  local reclaimed = expire(now)
  if op == 'release' then
    -- ARGV: ticket, then riders
    local answer = 0
    for k = 6, #ARGV do
      local released = release_one(ARGV[k])
      if k == 6 then answer = released end
    end
    kick(now)
    return answer
  end
  if riders and ARGV[riders] then
    for k = riders, #ARGV do release_one(ARGV[k]) end
    kick(now)
  end
  -- A leased limit is served from the clients' shares: they ask for those, not for permits.
  if meta.mode and (op == 'acquire' or op == 'check' or op == 'try') then
    return { meta.mode }
  end

  if op == 'acquire' then
    -- ARGV: ticket, level, keytok, weight, max_waiters, 'new' (see quick_acquire)
    local ticket, level, keytok, weight = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
    local max_waiters = number(ARGV[10])
    -- A ticket's first call: it neither holds nor waits here yet.
    local fresh = ARGV[11] == 'new'
    if reclaimed > 0 then kick(now) end
    if not fresh then
      local held = held_answer(ticket)
      if held then return held end
    end
    local waiters = waiting()
    local used = in_use()
    -- Silent clients' heads are dropped when a grant can be made, or when the waiting room is
    -- full (they may make room); else the next call that can grant drops them.
    if waiters > 0 and (used < meta.concurrent or waiters >= max_waiters) then
      purge(now)
      waiters = waiting()
    end
    if waiters == 0 and used < meta.concurrent then
      local _, at = rate_check(now)
      if not at then
        local _, _, held = grant(ticket, now, nil, used)
        return held
      end
      if max_waiters == 0 then return { 'waiters' } end
      push(ticket, level, keytok, weight, fresh)
      return { hex(2 + math.ceil((at - now) / 1000)) }
    end
    -- `waiters` and `used` still hold: nothing since changed the queue or the holders.
    if fresh or redis.call('HEXISTS', I, ticket) == 0 then
      if waiters >= max_waiters then return { 'waiters' } end
      push(ticket, level, keytok, weight, fresh)
    end
    return answer_for(ticket, used)
  end

  if op == 'check' then
    -- ARGV: ticket. Never queues: a ticket that neither holds nor waits is finished.
    local ticket = ARGV[6]
    if reclaimed > 0 then kick(now) end
    local held = held_answer(ticket)
    if held then return held end
    if redis.call('HEXISTS', I, ticket) == 0 then return { 'finished' } end
    return answer_for(ticket)
  end

  if op == 'try' then
    -- ARGV: ticket. Grants only at once; never queues.
    local ticket = ARGV[6]
    if reclaimed > 0 then kick(now) end
    local held = held_answer(ticket)
    if held then return held end
    purge(now)
    if waiting() > 0 or in_use() >= meta.concurrent then return { QUEUED, -1 } end
    local _, at = rate_check(now)
    if at then return { hex(2 + math.ceil((at - now) / 1000)) } end
    local _, _, held = grant(ticket, now)
    return held
  end

  if op == 'touch' then
    -- The caller is alive (it has waiters here); let a waiter in if a lease lapsed.
    redis.call('HSET', C, caller, dec(now))
    if reclaimed > 0 then kick(now) end
    return 'ok'
  end

  if op == 'renew' then
    -- ARGV: tickets...: extends the leases still held; answers the tickets that neither hold
    -- nor wait (their lease ended, or they were lost), and, marked "w", those that wait (the
    -- client knows which of them it believes hold a permit: after a failover or a restart
    -- that lost their grant, they do not).
    if reclaimed > 0 then kick(now) end
    local refused = {}
    local expires = dec(now + lease_us)
    for i = 6, #ARGV do
      local ticket = ARGV[i]
      local held = redis.call('HGET', H, ticket)
      if held then
        local fence = string.match(held, '^(%d+):')
        redis.call('HSET', H, ticket, fence .. ':' .. expires)
        redis.call('ZADD', E, expires, ticket)
      elseif redis.call('HEXISTS', I, ticket) == 0 then
        table.insert(refused, ticket)
      else
        table.insert(refused, 'w' .. ticket)
      end
    end
    return refused
  end

  if op == 'lease' then
    -- ARGV: client (its ledger id), held, demand ("level:n,..."), policy ("maxmin" |
    -- "proportional"), tokens wanted, seq (the client's refresh number, increasing), the
    -- highest token the client has handed out, "1" if the client believes it holds a live
    -- share; then, for a limit with a rate, the rate share the client enforces now and its
    -- rate demand ("level:n,..."), both in thousandths of a grant per second. The lease is
    -- ARGV[3]. Answers share, lease end (us), a block of fencing tokens [first, first + count)
    -- for the grants the client makes from its share, 1 if the client's share had lapsed here
    -- (its permits out must be reported lost: their capacity may have gone to others), and for
    -- a limit with a rate its rate share, its whole rate (thousandths of a grant per second)
    -- and its burst (else -1, 0, 0); or { 'stale' } for a refresh older than one already
    -- applied, { 'exact' } for a limit not defined leased.
    if not meta.mode or string.sub(meta.mode, 1, 7) ~= 'leased:' then return { 'exact' } end
    local client, held = tonumber(ARGV[6]), tonumber(ARGV[7])
    -- The limit's own policy (its mode, "leased:<policy>"); ARGV[9] is the client's belief.
    local demand_text, want_tokens = ARGV[8], tonumber(ARGV[10])
    local policy = string.sub(meta.mode, 8)
    local seq, last_token, believes = tonumber(ARGV[11]), tonumber(ARGV[12]), ARGV[13] == '1'
    -- Fencing tokens are exact below 2^53 only: a claim past that (or a block that would
    -- reach it) is refused, so no client can make tokens repeat.
    if not last_token or last_token >= 2^53 or not want_tokens or want_tokens < 0
      or want_tokens > 2^24 then
      return redis.error_reply('lanes: a fencing token claim out of range')
    end
    local expires = now + lease_us
    -- One ledger: its shares (LS), targets (LT, valid while M's `valid` field is 1).
    local function refresh(LS, LT, valid, capacity, held, demand_text, lapse)
      local entries = redis.call('HGETALL', LS)
      local clients, mine, others = {}, nil, 0
      local changed = redis.call('HGET', M, valid) ~= '1'
      for k = 1, #entries, 2 do
        local id = tonumber(entries[k])
        local share, reserved, _, expiry, eseq, demand =
          string.match(entries[k + 1], '^(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(.*)$')
        if not id or not expiry or tonumber(expiry) <= now then
          -- Lapsed (or not ours to read): its reservation ends.
          redis.call('HDEL', LS, entries[k])
          changed = true
        elseif id == client then
          mine = { share = tonumber(share), demand = demand, seq = tonumber(eseq) }
        else
          others = others + tonumber(reserved)
          table.insert(clients, { id = id, demand = parse_demand(demand) })
        end
      end
      if mine and seq <= mine.seq then return nil end
      -- A client that believes it holds a share Redis no longer has: its permits out may have
      -- been given to others, so it reports them lost and nothing is reserved for them.
      local lapsed = 0
      if lapse and not mine and believes and held > 0 then
        lapsed = 1
        held = 0
      end
      if not mine or mine.demand ~= demand_text then changed = true end
      table.insert(clients, { id = client, demand = parse_demand(demand_text) })
      local target
      if changed then
        local targets = apportion(capacity, clients, policy)
        redis.call('DEL', LT)
        for id, t in pairs(targets) do redis.call('HSET', LT, int(id), int(t)) end
        redis.call('HSET', M, valid, '1')
        target = targets[client]
      else
        target = tonumber(redis.call('HGET', LT, int(client)) or '0')
      end
      local share = 0
      if meta.hold <= now then
        share = math.min(target, math.max(capacity - others, 0))
      end
      local reserved = math.max(share, held)
      redis.call('HSET', LS, int(client), int(share) .. '|' .. int(reserved) .. '|' .. int(held)
        .. '|' .. int(expires) .. '|' .. int(seq) .. '|' .. demand_text)
      return share, lapsed
    end
    local share, lapsed =
      refresh(B .. ':ls', B .. ':lt', 'lvalid', meta.concurrent, held, demand_text, true)
    if not share then return { 'stale' } end
    local rshare, rcapacity, burst = -1, 0, 0
    local rate = tonumber(redis.call('HGET', M, 'rate') or '')
    if rate and ARGV[14] then
      rcapacity, burst = math.floor(rate * 1000), meta.burst
      rshare = refresh(B .. ':rs', B .. ':rt', 'rvalid', rcapacity, tonumber(ARGV[14]),
        ARGV[15] or '', false) or 0
    end
    -- Tokens: past every token this client has handed out (after Redis lost its counter, the
    -- clients' refreshes during the hold carry it past all of theirs), then a block.
    if last_token > num(M, 'fence') then redis.call('HSET', M, 'fence', int(last_token)) end
    local first = 0
    if want_tokens > 0 then
      first = redis.call('HINCRBY', M, 'fence', want_tokens) - want_tokens + 1
    end
    return { int(share), int(expires), int(first), want_tokens, lapsed, int(rshare),
      int(rcapacity), int(burst) }
  end

  if op == 'info' then
    if reclaimed > 0 then kick(now) end
    -- Then, for a leased limit, its mode and each live client's entry in each ledger
    -- ("id|share|reserved|held|demand total"): permits, then rate (thousandths per second).
    local function live_shares(LS)
      local shares = {}
      local entries = redis.call('HGETALL', LS)
      for k = 1, #entries, 2 do
        local share, reserved, held, expires, _, demand =
          string.match(entries[k + 1], '^(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(.*)$')
        if expires and tonumber(expires) > now then
          local total = 0
          for _, n in pairs(parse_demand(demand)) do total = total + n end
          table.insert(shares, entries[k] .. '|' .. share .. '|' .. reserved .. '|' .. held ..
            '|' .. int(total))
        end
      end
      return shares
    end
    local shares, rshares = {}, {}
    if meta.mode then
      shares, rshares = live_shares(B .. ':ls'), live_shares(B .. ':rs')
    end
    return {
      meta.concurrent, redis.call('HGET', M, 'rate') or '', meta.burst, in_use(), waiting(),
      granted(), meta.maxuse, meta.mode or '', shares, rshares,
    }
  end

  if op == 'remove' then
    if in_use() > 0 or waiting() > 0 then return { 'in_use' } end
    -- A leased limit whose live shares hold permits is in use too. A share holding none
    -- (its client keeps it refreshed, whatever its demand) does not keep the limit.
    for _, LS in ipairs({ B .. ':ls' }) do
      local shares = redis.call('HGETALL', LS)
      for k = 2, #shares, 2 do
        local held, expires = string.match(shares[k], '^%d+|%d+|(%d+)|(%d+)|')
        if expires and tonumber(expires) > now and tonumber(held) > 0 then
          return { 'in_use' }
        end
      end
    end
    redis.call('DEL', M, H, E, LV, I, C, L, B .. ':ls', B .. ':lt', B .. ':rs', B .. ':rt')
    return 'ok'
  end

  return redis.error_reply('lanes: unknown operation ' .. tostring(op))
end

redis.register_function('__LANES_LIBRARY__', call)

-- Registers limit name ARGV[1] in the namespace's set of names (KEYS[1]) unless the set holds
-- ARGV[2] names already: 1 registered now, 0 registered before, -1 refused. The count and the
-- name in one step: defines at once, from any number of clients, cannot pass the cap together.
local function register_within(keys, args)
  if redis.call('SISMEMBER', keys[1], args[1]) == 1 then return 0 end
  if redis.call('SCARD', keys[1]) >= tonumber(args[2]) then return -1 end
  redis.call('SADD', keys[1], args[1])
  return 1
end

redis.register_function('__LANES_LIBRARY___register', register_within)
