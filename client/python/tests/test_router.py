"""examples/router.py against three real CPU servers: placement follows the cache events (the
server holding the longest state wins, a removed state stops counting), a stream that breaks
gets exactly the batches it missed, and a restarted server's old states are forgotten (a
resync). Also the ZMQ publisher's vLLM wire format as a Python consumer decodes it."""

import os
import select
import socket
import sys
import threading
import time
import unittest

import msgpack
import numpy as np
import zmq

import replayssm
from support import ServerProcess, activations

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import router  # noqa: E402

FLAGS = ("--track-interval=16",)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class RouterTest(unittest.TestCase):
    def setUp(self):
        self.ports = [free_port() for _ in range(3)]
        self.servers = [self.start(p) for p in self.ports]
        self.router = router.Router([s.grpc_address for s in self.servers])
        self.addCleanup(self.router.close)
        self.rng = np.random.default_rng(7)
        wait_for(lambda: all(s.batches > 0 for s in self.router.subscriptions), "subscriptions")

    def start(self, port):
        server = ServerProcess(*FLAGS, f"--grpc-address=127.0.0.1:{port}")
        self.addCleanup(lambda: server.stop())
        return server

    def donate(self, server, tokens):
        """A request of `tokens` prefilled on server `server` and donated: a snapshot."""
        with replayssm.Client(self.servers[server].grpc_address) as c:
            model = c.info().model
            slot = c.allocate().slot
            c.prefill(slot, tokens, activations(model, len(tokens), self.rng))
            c.donate(slot)

    def placed(self, tokens, want, matched):
        wait_for(lambda: self.router.place(tokens)[:2] == (want, matched),
                 f"placement on server {want} with {matched} tokens "
                 f"(got {self.router.place(tokens)})")

    def test_placement_follows_the_events(self):
        prompt = list(range(1000, 1040))  # 40 tokens: keys of 2 blocks + 8
        self.donate(1, prompt[:20])
        self.donate(2, prompt[:36])
        self.placed(prompt + [5, 6], want=2, matched=36)
        # Only a prefix counts: server 2's 36 tokens cannot serve 30 of them, server 1's 20 can.
        # Waited for too: server 1's events come on a stream of their own and may still be on
        # their way when server 2's have arrived.
        self.placed(prompt[:30], want=1, matched=20)
        self.assertEqual(self.router.place([1, 2, 3])[1], 0, "nobody holds it: by load")
        self.assertEqual(self.router.place(prompt)[2], "GPU")
        # Server 2's pool fills up with live slots: its snapshot is evicted, server 1 wins.
        with replayssm.Client(self.servers[2].grpc_address) as c:
            for _ in range(c.info().capacity_slots):
                c.allocate()
        self.placed(prompt, want=1, matched=20)
        self.assertEqual(sum(i.bad_hashes for i in self.router.indexes), 0,
                         "every stored hash is the chained hash of its tokens")

    def test_a_broken_stream_gets_what_it_missed(self):
        sub = self.router.subscriptions[0]
        resyncs = sub.resyncs
        sub.disconnect()
        self.donate(0, list(range(50, 70)))
        self.placed(list(range(50, 75)), want=0, matched=20)
        self.assertEqual(sub.resyncs, resyncs, "a replay of the missed batches, not a resync")
        self.assertGreater(sub.reconnects, 0)

    def test_a_restarted_server_is_forgotten_then_learned_again(self):
        prompt = list(range(2000, 2040))
        self.donate(0, prompt[:20])
        self.donate(1, prompt[:36])
        self.placed(prompt, want=1, matched=36)
        old = self.servers[1]
        old.stop()
        self.servers[1] = self.start(self.ports[1])  # same address, a new epoch, empty
        self.placed(prompt, want=0, matched=20)
        self.assertGreaterEqual(self.router.subscriptions[1].resyncs, 2)
        self.donate(1, prompt[:33])
        self.placed(prompt, want=1, matched=33)


class FrozenRelay:
    """A TCP relay to `target` (host:port) that forwards both ways until freeze(): from then on
    it forwards nothing and closes nothing, as a server host that lost its power or its
    network would look (no FIN, no RST)."""

    def __init__(self, target):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.frozen = threading.Event()
        self.stopped = threading.Event()
        self.sockets = [self.listener]
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        peers = {}
        while not self.stopped.is_set():
            readable, _, _ = select.select(list(peers) + [self.listener], [], [], 0.1)
            for s in readable:
                if s is self.listener:
                    client, _ = s.accept()
                    server = socket.create_connection(self.target)
                    peers[client], peers[server] = server, client
                    self.sockets += [client, server]
                elif not self.frozen.is_set():
                    data = s.recv(65536)
                    if data:
                        peers[s].sendall(data)
            if self.frozen.is_set():
                time.sleep(0.1)  # nothing moves; the sockets stay open

    def freeze(self):
        self.frozen.set()

    def close(self):
        self.stopped.set()
        self.thread.join()
        for s in self.sockets:
            s.close()


class KeepaliveTest(unittest.TestCase):
    def test_a_watch_on_a_server_that_went_silent_ends_unavailable(self):
        """The channel pings after `keepalive` seconds without traffic, for as long as the
        watch lasts: a server that stopped answering without closing the connection ends it
        with Unavailable (it used to wait for ever: the Python channel sent no pings)."""
        server = ServerProcess(*FLAGS)
        self.addCleanup(server.stop)
        relay = FrozenRelay(server.grpc_address)
        self.addCleanup(relay.close)
        with replayssm.Client(relay.address, keepalive=10) as client:
            watch = client.watch_cache()
            self.assertTrue(next(watch).resync)
            # Idle past two pings first: gRPC's default stops pinging after two without data
            # from the client, and a watch sends none.
            time.sleep(25)
            relay.freeze()
            outcome = []

            def read():
                try:
                    next(watch)
                    outcome.append("a batch")
                except replayssm.ReplaySSMError as e:
                    outcome.append(e)

            reader = threading.Thread(target=read, daemon=True)
            started = time.monotonic()
            reader.start()
            reader.join(60)
            self.assertFalse(reader.is_alive(), "the watch still waits after 60 s")
            self.assertIsInstance(outcome[0], replayssm.Unavailable, outcome)
            self.assertLess(time.monotonic() - started, 45)
            watch.cancel()

    def test_a_keepalive_below_the_servers_least_interval_is_refused(self):
        with self.assertRaises(ValueError) as caught:
            replayssm.Client("127.0.0.1:1", keepalive=1)
        self.assertIn("keepalive: expected None or at least 10 seconds", str(caught.exception))


class ZmqWireFormatTest(unittest.TestCase):
    """The payload decodes as vLLM's KVEventBatch does: [ts, [[tag, fields...], ...]]."""

    def test_a_donation_is_a_block_stored_event_with_replay(self):
        pub, rep = free_port(), free_port()
        server = ServerProcess(*FLAGS, f"--kv-events-endpoint=tcp://127.0.0.1:{pub}",
                               f"--kv-events-replay-endpoint=tcp://127.0.0.1:{rep}")
        self.addCleanup(server.stop)
        ctx = zmq.Context()
        self.addCleanup(ctx.destroy, 0)
        sub = ctx.socket(zmq.SUB)
        self.addCleanup(sub.close, 0)
        sub.connect(f"tcp://127.0.0.1:{pub}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        time.sleep(0.3)
        tokens = list(range(300, 320))
        with replayssm.Client(server.grpc_address) as c:
            slot = c.allocate().slot
            c.prefill(slot, tokens, activations(c.info().model, 20, np.random.default_rng(1)))
            c.donate(slot)
        self.assertTrue(sub.poll(10000), "no event published")
        topic, seq, payload = sub.recv_multipart()
        self.assertEqual(topic, b"kv-events")
        ts, events = msgpack.unpackb(payload)
        self.assertIsInstance(ts, float)
        tag, hashes, parent, token_ids, block_size, lora_id, medium = events[0]
        self.assertEqual((tag, block_size, lora_id, medium), ("BlockStored", 16, None, "GPU"))
        self.assertEqual(token_ids, tokens[16:])
        self.assertEqual(parent, router.block_hash(None, tokens[:16]))
        self.assertEqual(hashes, [router.block_hash(parent, tokens[16:])])
        # Replay from the first batch (a DEALER gets every kept batch, then the end marker).
        dealer = ctx.socket(zmq.DEALER)
        self.addCleanup(dealer.close, 0)
        dealer.connect(f"tcp://127.0.0.1:{rep}")
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        got = []
        while dealer.poll(10000):
            _, seq_bytes, body = dealer.recv_multipart()
            if not body:
                self.assertEqual(int.from_bytes(seq_bytes, "big", signed=True), -1)
                break
            got.append((int.from_bytes(seq_bytes, "big"), msgpack.unpackb(body)[1]))
        self.assertEqual([s for s, _ in got], [1, int.from_bytes(seq, "big")])
        self.assertEqual(got[0][1], [["AllBlocksCleared"]], "the publisher's start")


if __name__ == "__main__":
    unittest.main()
