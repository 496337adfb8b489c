#!/usr/bin/env python3
"""A prefix-aware router over several replayssm-servers (docs/api.md, "Cache events").

It subscribes to every server's cache events (WatchCache), keeps an index of which prefix
states each server holds and in which tier, and places a request on the server holding the
longest cached state of its tokens (at equal length: GPU before host memory before disk),
falling back to the least loaded server (fewest live slots) when none holds any.

A subscription survives a broken stream and a server restart: it reconnects with the epoch and
the next sequence number it needs; the server answers with exactly the batches missed, or
with a resync (AllBlocksCleared, then every snapshot stored now) after a restart or when it no
longer keeps them. The index never trusts what it cannot check: a stored event whose hash is
not the chained hash of its tokens is counted and dropped.

    python router.py --servers 10.0.0.1:50051,10.0.0.2:50051 [--token-file F]
    then one request per line on stdin: its token ids, space-separated
"""

import argparse
import hashlib
import struct
import sys
import threading
import time

import replayssm

TIER_RANK = {"GPU": 2, "CPU": 1, "DISK": 0}


def block_hash(parent, tokens):
    """The chained block hash of the cache events: the first 8 bytes (big-endian) of SHA-256
    over the parent hash (8 bytes little-endian; 0 for none) and the tokens (int32 LE)."""
    data = struct.pack("<Q", parent or 0) + struct.pack(f"<{len(tokens)}i", *tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


class PrefixIndex:
    """The snapshots one server holds: key hash -> (parent, tokens after it, tiers)."""

    def __init__(self):
        self.entries = {}   # hash -> [parent, tail tuple, num_tokens, set of media]
        self.children = {}  # parent hash (None: the root) -> set of hashes
        self.bad_hashes = 0

    def clear(self):
        self.entries.clear()
        self.children.clear()

    def apply(self, event):
        kind = event.WhichOneof("event")
        if kind == "cleared":
            self.clear()
        elif kind == "stored":
            s = event.stored
            parent = s.parent_block_hash if s.has_parent else None
            h = s.block_hashes[0]
            if block_hash(parent, list(s.token_ids)) != h:
                self.bad_hashes += 1
                return
            entry = self.entries.setdefault(h, [parent, tuple(s.token_ids), s.num_tokens, set()])
            entry[3].add(s.medium)
            self.children.setdefault(parent, set()).add(h)
        elif kind == "removed":
            h = event.removed.block_hashes[0]
            entry = self.entries.get(h)
            if entry is None:
                return
            entry[3].discard(event.removed.medium)
            if not entry[3]:
                del self.entries[h]
                self.children.get(entry[0], set()).discard(h)

    def longest(self, tokens, block_size):
        """(tokens matched, best tier's rank) of the longest snapshot whose key is a prefix
        of `tokens` without its last token (the server's Allocate leaves that one to
        prefill); (0, -1) when none is."""
        tokens = tokens[:-1]
        best = (0, -1)
        parent, start = None, 0
        while True:
            for h in self.children.get(parent, ()):
                _, tail, n, media = self.entries[h]
                if tuple(tokens[start:start + len(tail)]) == tail:
                    best = max(best, (n, max(TIER_RANK.get(m, 0) for m in media)))
            if start + block_size > len(tokens):
                return best
            parent = block_hash(parent, tokens[start:start + block_size])
            start += block_size


class Subscription(threading.Thread):
    """One server's event stream into its index, reconnecting for ever (until stop())."""

    def __init__(self, client, index, lock):
        super().__init__(daemon=True)
        self.client, self.index, self.lock = client, index, lock
        self.epoch, self.next_seq = 0, 0
        self.block_size = 64
        self.batches = self.resyncs = self.reconnects = 0
        self._stop = threading.Event()
        self._call = None

    def run(self):
        while not self._stop.is_set():
            try:
                self._call = self.client.watch_cache(self.epoch, self.next_seq)
                for batch in self._call:
                    self._apply(batch)
            except replayssm.ReplaySSMError:  # the stream ended: reconnect
                pass
            if not self._stop.is_set():
                self.reconnects += 1
                time.sleep(0.2)

    def _apply(self, batch):
        with self.lock:
            if batch.resync:
                self.index.clear()
                self.resyncs += 1
            for e in batch.events:
                if e.WhichOneof("event") == "stored":
                    self.block_size = e.stored.block_size
                self.index.apply(e)
            self.epoch, self.next_seq = batch.epoch, batch.seq + 1
            self.batches += 1

    def disconnect(self):
        """Breaks the stream (it reconnects): a network blip, for tests."""
        if self._call is not None:
            self._call.cancel()

    def stop(self):
        self._stop.set()
        self.disconnect()


class Router:
    """Places requests on the server holding the longest cached state of their tokens."""

    def __init__(self, addresses, token=None):
        self.addresses = list(addresses)
        self.lock = threading.Lock()
        self.clients = [replayssm.Client(a, timeout=10, token=token) for a in self.addresses]
        self.indexes = [PrefixIndex() for _ in self.addresses]
        self.subscriptions = [Subscription(c, i, self.lock)
                              for c, i in zip(self.clients, self.indexes)]
        for s in self.subscriptions:
            s.start()

    def place(self, tokens):
        """(server index, tokens its state saves, tier) for a request of `tokens`."""
        tokens = list(tokens)
        with self.lock:
            found = [idx.longest(tokens, sub.block_size)
                     for idx, sub in zip(self.indexes, self.subscriptions)]
        best = max(found)
        if best[0] > 0:
            server = found.index(best)
            tier = next(k for k, v in TIER_RANK.items() if v == best[1])
            return server, best[0], tier
        return self.least_loaded(), 0, None

    def least_loaded(self):
        loads = []
        for i, c in enumerate(self.clients):
            try:
                loads.append((c.stats().slots_live, i))
            except replayssm.ReplaySSMError:
                loads.append((float("inf"), i))  # unreachable: last
        return min(loads)[1]

    def close(self):
        for s in self.subscriptions:
            s.stop()
        for c in self.clients:
            c.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", required=True, help="comma-separated host:port")
    parser.add_argument("--token-file", help="bearer token (servers with --auth-tokens)")
    args = parser.parse_args()
    token = replayssm.client.read_token_file(args.token_file) if args.token_file else None
    router = Router(args.servers.split(","), token=token)
    try:
        for line in sys.stdin:
            tokens = [int(t) for t in line.split()]
            server, matched, tier = router.place(tokens)
            print(f"{router.addresses[server]} matched={matched} tier={tier or '-'}", flush=True)
    finally:
        router.close()


if __name__ == "__main__":
    main()
