#!/usr/bin/env python3
"""Golden chunk keys for tests/unit/cache_test.c, computed with Python's hashlib from the
construction DESIGN.md and cache/cache.h describe (an independent implementation of it):

  tag(s)       = s + NUL
  namespace    = SHA-256(tag("kvserve.namespace.v1") || u32(len tenant) || u32(len salt, or
                 0xffffffff without a salt) || tenant || salt)
  prefix key i = SHA-256(tag("kvserve.prefix.v1") || model id || namespace || key_{i-1} (zeros
                 for i = 0) || u32(n tokens) || tokens as int32)
  content key  = SHA-256(tag("kvserve.content.v1") || model id || namespace || u32(n) || tokens)
integers little-endian. Writes tests/golden/cache/keys.txt."""
import hashlib
import os
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tag(s):
    return s.encode() + b"\0"


def namespace(tenant, salt):
    h = hashlib.sha256(tag("kvserve.namespace.v1"))
    h.update(struct.pack("<II", len(tenant), 0xFFFFFFFF if salt is None else len(salt)))
    h.update(tenant + (salt or b""))
    return h.digest()


def tokens_bytes(tokens):
    return struct.pack(f"<I{len(tokens)}i", len(tokens), *tokens)


def prefix_key(model_id, ns, prev, tokens):
    return hashlib.sha256(tag("kvserve.prefix.v1") + model_id + ns + (prev or bytes(32)) +
                          tokens_bytes(tokens)).digest()


def content_key(model_id, ns, tokens):
    return hashlib.sha256(tag("kvserve.content.v1") + model_id + ns +
                          tokens_bytes(tokens)).digest()


def main():
    model_id = bytes(range(32))                       # the test's model identity: 0, 1, .., 31
    tokens = [(i * 7919 + 13) % 49152 - 5 for i in range(48)]  # includes negatives: int32
    lines = []
    ns_none = namespace(b"", None)
    ns_key = namespace(b"alice", None)
    ns_salt = namespace(b"alice", b"s1")
    lines += [f"ns_none {ns_none.hex()}", f"ns_alice {ns_key.hex()}",
              f"ns_alice_s1 {ns_salt.hex()}"]
    k0 = prefix_key(model_id, ns_key, None, tokens[:16])
    k1 = prefix_key(model_id, ns_key, k0, tokens[16:32])
    k2 = prefix_key(model_id, ns_key, k1, tokens[32:48])
    lines += [f"prefix0 {k0.hex()}", f"prefix1 {k1.hex()}", f"prefix2 {k2.hex()}"]
    lines.append(f"content {content_key(model_id, ns_key, tokens[16:32]).hex()}")
    out = os.path.join(ROOT, "tests", "golden", "cache", "keys.txt")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
