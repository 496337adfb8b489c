"""TLS from Python against a real server (CPU backend): a TLS client is served with the
server's CA, a plaintext one is not; under mTLS only a client with a certificate the client
CA signed is served. The PKI is made with the openssl command in a temporary directory."""

import os
import shutil
import subprocess
import tempfile
import unittest

import replayssm
from support import ServerProcess


def make_pki(directory):
    def run(*args):
        subprocess.run(args, cwd=directory, check=True, capture_output=True)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    with open(os.path.join(directory, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for ca in ("ca", "other"):
        run("openssl", "req", "-x509", *key, "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
            "-days", "2", "-subj", f"/CN={ca}")
    for name, ca, san in (("server", "ca", True), ("client", "ca", False),
                          ("stranger", "other", False)):
        run("openssl", "req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
            f"/CN={name}")
        run("openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey",
            f"{ca}.key", "-CAcreateserial", "-days", "2", "-out", f"{name}.pem",
            *(["-extfile", "san.ext"] if san else []))


class TlsTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="replayssm-pytest-tls-")
        self.addCleanup(shutil.rmtree, self.dir)
        make_pki(self.dir)

    def path(self, name):
        return os.path.join(self.dir, name)

    def server(self, mtls):
        flags = [f"--tls-cert={self.path('server.pem')}", f"--tls-key={self.path('server.key')}"]
        if mtls:
            flags.append(f"--tls-client-ca={self.path('ca.pem')}")
        s = ServerProcess(*flags)
        self.addCleanup(s.stop)
        return s

    def client(self, server, who=None):
        c = replayssm.Client(server.grpc_address, timeout=5, retries=0,
                             tls_ca=self.path("ca.pem"),
                             tls_cert=self.path(f"{who}.pem") if who else None,
                             tls_key=self.path(f"{who}.key") if who else None)
        self.addCleanup(c.close)
        return c

    def test_a_tls_server_serves_tls_clients_and_not_plaintext_ones(self):
        server = self.server(mtls=False)
        self.assertGreater(self.client(server).info().model.num_layers, 0)
        plain = replayssm.Client(server.grpc_address, timeout=3, retries=0)
        self.addCleanup(plain.close)
        with self.assertRaises(replayssm.ReplaySSMError):
            plain.info()

    def test_under_mtls_only_clients_the_ca_signed_are_served(self):
        server = self.server(mtls=True)
        self.assertGreater(self.client(server, "client").info().model.num_layers, 0)
        for who in (None, "stranger"):
            with self.assertRaises(replayssm.ReplaySSMError, msg=f"certificate: {who}"):
                self.client(server, who).info()

    def test_a_certificate_without_its_key_is_refused_before_dialling(self):
        with self.assertRaises(ValueError):
            replayssm.Client("127.0.0.1:1", tls_cert=self.path("client.pem"))

    def test_an_empty_tls_or_token_argument_is_refused_naming_it(self):
        # "" would otherwise read as "not given": a plaintext channel, or no token.
        for name in ("tls_ca", "tls_cert", "tls_key", "token", "token_file"):
            with self.assertRaises(ValueError, msg=name) as caught:
                replayssm.Client("127.0.0.1:1", **{name: ""})
            self.assertIn(name, str(caught.exception))


if __name__ == "__main__":
    unittest.main()
