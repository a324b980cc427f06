"""A tenant's quota in the remote tier: its blocks' bytes accounted in Redis, its oldest blocks
evicted when a put would take it past the quota; another tenant's blocks are never touched.

Each tenant (``remote_tenant``; every worker and node service naming it shares the account) has
four keys, all in one Redis Cluster slot through a hash tag of the tenant's digest:

* ``{prefix}quota:{DIGEST}:blocks``, a sorted set of the tenant's block keys, scored by the order
  of their last write (a block written again is young again);
* ``{prefix}quota:{DIGEST}:sizes``, a hash: each block key's value bytes (header and payload);
* ``{prefix}quota:{DIGEST}:bytes``, their sum;
* ``{prefix}quota:{DIGEST}:clock``, the write counter that scores them (no clock of any host:
  workers on several nodes agree on the order).

A put runs ``RESERVE`` first (one Lua script, atomic on the account's node): its blocks join the set,
then the oldest members are popped until the tenant is within its quota and returned as victims;
the store deletes the victims, then writes the blocks that were not themselves victims (a batch
larger than the quota keeps its first blocks: a prefix, the part a later get can use). So the bytes
accounted never exceed the quota, and the tenant's keys in Redis never exceed them either, apart
from a block whose account is gone while its write is still on the wire (a victim of another
worker's put in that instant). Block keys keep no hash tag (a tenant's blocks stay spread over the
cluster's nodes): the script touches only the account, the deletes and writes go to each key's node.

What Redis drops by itself (``remote_ttl_s`` expiry, ``maxmemory`` eviction, a ``FLUSHDB``) stays
accounted until its member is popped: the account errs high, never low. Redis's own eviction is
blind to tenants: give the server a ``maxmemory`` above the sum of the quotas so it never runs."""

from __future__ import annotations

import hashlib

# KEYS: blocks, sizes, bytes, clock. ARGV: quota bytes, then each block's key and value bytes, in
# the batch's order. A batch's blocks are scored each a little older than the one before it, so
# that a batch's own victims are its last blocks (its prefix stays loadable). Returns
# {used, victim keys...}.
RESERVE = b"""
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
local quota = tonumber(ARGV[1])
local n = (#ARGV - 1) / 2
local top = redis.call('INCRBY', KEYS[4], n)
for i = 0, n - 1 do
  local key, size = ARGV[2 + 2 * i], tonumber(ARGV[3 + 2 * i])
  if redis.call('ZADD', KEYS[1], top - i, key) == 1 then
    redis.call('HSET', KEYS[2], key, size)
    used = used + size
  end
end
local out = {0}
while used > quota do
  local popped = redis.call('ZPOPMIN', KEYS[1])
  if #popped == 0 then
    used = 0
    break
  end
  used = used - tonumber(redis.call('HGET', KEYS[2], popped[1]) or '0')
  redis.call('HDEL', KEYS[2], popped[1])
  out[#out + 1] = popped[1]
end
if used < 0 then used = 0 end
redis.call('SET', KEYS[3], used)
out[1] = used
return out
"""

# KEYS: blocks, sizes, bytes. ARGV: keys of deleted blocks. Returns the bytes accounted afterwards.
FORGET = b"""
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
for i = 1, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    used = used - tonumber(redis.call('HGET', KEYS[2], ARGV[i]) or '0')
    redis.call('HDEL', KEYS[2], ARGV[i])
  end
end
if used < 0 then used = 0 end
redis.call('SET', KEYS[3], used)
return used
"""


def account_keys(key_prefix: str, tenant: str) -> tuple[bytes, bytes, bytes, bytes]:
    """(blocks, sizes, bytes, clock) keys of ``tenant``'s account: one hash tag, so one cluster
    slot. The tag is a digest of the name: any name (braces, empty) gives a tag of its own."""
    digest = hashlib.sha256(tenant.encode("utf-8")).hexdigest()[:16]
    base = b"%squota:{%s}:" % (key_prefix.encode("utf-8"), digest.encode("ascii"))
    return base + b"blocks", base + b"sizes", base + b"bytes", base + b"clock"
