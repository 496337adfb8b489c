"""Bearer tokens from Python against a real server (CPU backend, --auth-tokens): without a
token every call is Unauthenticated; with one (as a value or a file) unary calls and the
forward stream go through; another tenant's handle is NotFound as an unknown one."""

import os
import shutil
import tempfile
import unittest

import numpy as np

import replayssm
from support import ServerProcess, activations

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef"


class AuthTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="replayssm-pytest-auth-")
        cls.tokens = os.path.join(cls.dir, "tokens")
        with open(cls.tokens, "w") as f:
            f.write(f"alice {ALICE}\nbob {BOB}\n")
        cls.server = ServerProcess(f"--auth-tokens={cls.tokens}")

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        shutil.rmtree(cls.dir)

    def client(self, **kw):
        c = replayssm.Client(self.server.grpc_address, timeout=10, retries=0, **kw)
        self.addCleanup(c.close)
        return c

    def test_a_client_without_a_token_is_unauthenticated(self):
        c = self.client()
        with self.assertRaises(replayssm.errors.Unauthenticated):
            c.info()
        with self.assertRaises(replayssm.errors.Unauthenticated):
            self.client(token="not-a-token-of-this-server-0123").allocate()
        self.assertEqual(c.health(), "SERVING")

    def test_a_token_file_names_the_tenant_for_calls_and_streams(self):
        path = os.path.join(self.dir, "alice")
        with open(path, "w") as f:
            f.write(ALICE + "\n")
        alice = self.client(token_file=path)
        slot = alice.allocate().slot
        model = alice.model
        xs = activations(model, 1, np.random.default_rng(0))
        with alice.open_stream() as stream:  # the stream carries the token too
            stream.begin([(slot, 4)])
            for layer in range(model.num_layers):
                stream.run_layer(layer, *xs[layer])
            rows = stream.commit()
        self.assertEqual(rows[0].seq_len, 1)
        bob = self.client(token=BOB)
        with self.assertRaises(replayssm.errors.NotFound):
            bob.get_slot(slot)
        self.assertEqual(bob.list_slots(), [])
        self.assertEqual(alice.get_slot(slot).seq_len, 1)

    def test_token_and_token_file_are_exclusive(self):
        with self.assertRaises(ValueError):
            replayssm.Client(self.server.grpc_address, token=ALICE, token_file=self.tokens)

    def test_a_token_grpc_cannot_send_is_refused_before_any_call(self):
        # A newline or a space made every call fail with an untyped error from gRPC, which
        # also logged the token's bytes; the C++ client refused it already.
        for bad in (ALICE + "\n", "al ice", "t\u00e9"):
            with self.assertRaises(ValueError) as caught:
                replayssm.Client(self.server.grpc_address, token=bad)
            self.assertIn("printable ASCII", str(caught.exception))
        two_lines = os.path.join(self.dir, "two-lines")
        with open(two_lines, "w", encoding="utf-8") as f:
            f.write(ALICE + "\n" + ALICE + "\n")
        with self.assertRaises(ValueError) as caught:
            replayssm.Client(self.server.grpc_address, token_file=two_lines)
        self.assertIn("token_file", str(caught.exception))


if __name__ == "__main__":
    unittest.main()
