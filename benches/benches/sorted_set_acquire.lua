-- The anchor of suite 10: the common sorted-set semaphore (the distributed-lock / Redisson
-- pattern). Members are holders, scored by acquisition time; stale ones are swept on every
-- acquire; the release is a plain ZREM. KEYS[1] the set; ARGV: the limit, the holder's id, how
-- long a holder stays (ms).
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - tonumber(ARGV[3]))
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now_ms, ARGV[2])
  return 1
end
return 0
