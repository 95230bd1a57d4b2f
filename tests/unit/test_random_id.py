"""`uuid4_hex`: what `uuid.uuid4().hex` gives (a version-4, RFC 4122 UUID as 32 lowercase hex digits), fresh each
call."""

from __future__ import annotations

import uuid

from pdspark.router.random_id import uuid4_hex


def test_ids_are_version_4_uuids_in_hex():
    ids = [uuid4_hex() for _ in range(2000)]
    for h in ids:
        u = uuid.UUID(hex=h)
        assert (u.version, u.variant, u.hex) == (4, uuid.RFC_4122, h)
        assert len(h) == 32 and h == h.lower()
    assert len(set(ids)) == len(ids)


def test_every_random_bit_varies():
    # 122 random bits: across many ids each of them is seen both set and clear; the 6 fixed ones never change.
    ids = [int(uuid4_hex(), 16) for _ in range(2000)]
    ones, zeros = 0, 0
    for n in ids:
        ones |= n
        zeros |= ~n
    fixed = (0xF << 76) | (0x3 << 62)
    assert ones & zeros & ((1 << 128) - 1) == ((1 << 128) - 1) & ~fixed
