"""examples/engine.py, the worked example of the data plane, against a real CPU server with
shared memory: it must finish, say that every layer matched the reference, commit one decode
per step (the server's stats), and free and unregister what it used; for each gate and for
bf16 activations."""

import os
import re
import subprocess
import sys
import unittest

import replayssm
from support import BF16_CONFIG, ServerProcess, config_file

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                       "engine.py")


class EngineExampleTest(unittest.TestCase):
    def run_example(self, model, *flags):
        server = ServerProcess("--track-interval=16", model=model)
        self.addCleanup(server.stop)
        done = subprocess.run([sys.executable, EXAMPLE, "--address", server.grpc_address,
                               *flags], capture_output=True, text=True, timeout=240)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        with replayssm.Client(server.grpc_address) as client:
            stats = client.stats()
            regions = client.region_status()
        return done.stdout, stats, regions

    def check(self, model, requests, steps):
        out, stats, regions = self.run_example(model, "--requests", str(requests), "--steps",
                                               str(steps))
        self.assertIn("every layer of every forward checked against the reference", out)
        generated = re.findall(r"request \d+: prompt \[.*\] -> \[(.*)\]", out)
        self.assertEqual(len(generated), requests)
        for tokens in generated:
            self.assertEqual(len(tokens.split(",")), steps + 1)  # one from the prefill
        self.assertEqual(regions, [])  # unregistered at the end
        self.assertEqual((stats.forwards_committed, stats.forwards_abandoned,
                          stats.slots_live), (steps, 0, 0))  # the counters are decodes'

    def test_the_example_decodes_gdn_requests_checked_against_the_reference(self):
        self.check("tiny-gdn", 3, 6)

    def test_the_example_decodes_kda_requests_checked_against_the_reference(self):
        self.check("tiny-kda", 2, 3)

    def test_the_example_decodes_with_bf16_activations(self):
        self.check(config_file(self, BF16_CONFIG), 2, 3)

    def test_the_example_refuses_a_tensor_parallel_server_before_touching_it(self):
        server = ServerProcess("--tp-size=2")
        self.addCleanup(server.stop)
        done = subprocess.run([sys.executable, EXAMPLE, "--address", server.grpc_address],
                              capture_output=True, text=True, timeout=60)
        self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
        self.assertIn("engine: the server serves 2 tensor-parallel ranks (--tp-size)", done.stderr)
        with replayssm.Client(server.grpc_address) as client:
            self.assertEqual((client.stats().slots_live, client.region_status()), (0, []))

    def test_a_run_that_fails_to_set_up_leaves_nothing_on_the_server(self):
        server = ServerProcess("--memory-budget=300K")  # room for 2 slots; 3 are asked
        self.addCleanup(server.stop)
        with replayssm.Client(server.grpc_address) as client:
            capacity = client.stats().slots_free
        self.assertLess(capacity, 3)
        for _ in range(2):  # the second run meets no region or slot the first left
            done = subprocess.run([sys.executable, EXAMPLE, "--address", server.grpc_address,
                                   "--requests", "3"], capture_output=True, text=True,
                                  timeout=60)
            self.assertEqual(done.returncode, 1, done.stdout + done.stderr)
            self.assertIn("engine: Allocate: RESOURCE_EXHAUSTED", done.stderr)
            with replayssm.Client(server.grpc_address) as client:
                self.assertEqual((client.stats().slots_live, client.region_status()), (0, []))


if __name__ == "__main__":
    unittest.main()
