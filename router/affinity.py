"""Which verifier replicas likely hold a prompt's prefix in their prefix cache.

The router cannot see the replicas' caches; it remembers where it sent prompts. A prompt
is cut into chunks of CHUNK tokens, each named by a hash chain (a chunk's key covers
every token before it, and the request's cache salt, as the verifier's block keys do),
and each key remembers the replicas it was sent to. A new prompt goes to the least
loaded of the replicas holding its longest remembered prefix, unless that replica has
more than BALANCE requests more than the least loaded replica of all: a cached prefix
saves its prefill, a longer queue costs every token (SGLang's cache-aware routing and
llm-d's prefix scorer choose alike). What a replica evicted since is not known here: the
memory is a guess, and a wrong one costs only the prefill the plain choice would have.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

CHUNK = 16  # tokens per remembered chunk (a multiple of the usual KV block sizes)
BALANCE = 2  # requests more than the least loaded that a holder of the prefix may have
CAPACITY = 1 << 16  # chunks remembered (about a million tokens), least recent forgotten


def chunk_keys(ids: list[int], salt: str = "") -> list[bytes]:
    """The keys of the prompt's whole chunks, in order (none for a prompt shorter than
    one chunk)."""
    key = hashlib.blake2b(salt.encode(), digest_size=16, person=b"specd-route").digest()
    keys = []
    for start in range(0, len(ids) - CHUNK + 1, CHUNK):
        chunk = array("q", ids[start : start + CHUNK]).tobytes()
        key = hashlib.blake2b(key + chunk, digest_size=16).digest()
        keys.append(key)
    return keys


class PrefixAffinity:
    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()  # least recent first

    def holders(self, keys: list[bytes], candidates: set[str]) -> tuple[set[str], int]:
        """Of `candidates`, those sent the longest prefix of `keys`, and its length in
        chunks (an empty set and 0: none was sent its first chunk)."""
        found: set[str] = set()
        for n, key in enumerate(keys):
            held = candidates.intersection(self._holders.get(key, ()))
            if not held:
                return found, n
            found = held
        return found, len(keys)

    def sent(self, keys: list[bytes], address: str) -> None:
        """Remember that the prompt of `keys` went to `address`."""
        for key in keys:
            where = self._holders.pop(key, None) or set()
            where.add(address)
            self._holders[key] = where
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def clear(self) -> None:
        """The replicas' caches reset: no prompt is held anywhere."""
        self._holders.clear()

    def forget(self, address: str) -> None:
        """A replica removed (its cache gone with it)."""
        for where in self._holders.values():
            where.discard(address)
