"""Builds the replayssm package; its gRPC stubs are generated here from the repository's proto/.

The .proto files are the single source of the wire contract, so nothing generated is committed:
build_py runs protoc with gRPC's Python plugin (Debian: protobuf-compiler and
protobuf-compiler-grpc) and writes the modules into the build tree, from where they are installed.
Overrides: REPLAYSSM_PROTO_DIR, REPLAYSSM_PROTOC, REPLAYSSM_GRPC_PYTHON_PLUGIN.
"""

import os
import pathlib
import shutil
import subprocess
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent
SERVICE_PACKAGE = "replayssm/v1"  # every .proto in it: the service, transfer, regions
HEALTH_PROTO = "grpc/health/v1/health.proto"


def _tool(env, name, package):
    path = os.environ.get(env) or shutil.which(name)
    if not path:
        raise RuntimeError(f"{name} not found (Debian: apt-get install {package}); or set {env}")
    return path


def _protos():
    """The proto directory and the service's .proto files, relative to it."""
    path = pathlib.Path(os.environ.get("REPLAYSSM_PROTO_DIR", HERE.parent.parent / "proto"))
    protos = sorted(p.relative_to(path).as_posix()
                    for p in (path / SERVICE_PACKAGE).glob("*.proto"))
    if not protos:
        raise RuntimeError(f"no {SERVICE_PACKAGE}/*.proto under {path}: build from the checkout "
                           "(pip install ./client/python) or set REPLAYSSM_PROTO_DIR")
    return path, protos


def generate_stubs(out_dir):
    """Writes replayssm/v1/*_pb2{,_grpc}.py and replayssm/_health_pb2.py under out_dir."""
    protoc = _tool("REPLAYSSM_PROTOC", "protoc", "protobuf-compiler")
    plugin = _tool("REPLAYSSM_GRPC_PYTHON_PLUGIN", "grpc_python_plugin", "protobuf-compiler-grpc")
    proto_dir, protos = _protos()
    out = pathlib.Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([protoc, f"--proto_path={proto_dir}", f"--python_out={tmp}",
                        f"--grpc_out={tmp}", f"--plugin=protoc-gen-grpc={plugin}",
                        *protos], check=True)
        # Only the health messages: the generated health stub would import `grpc.health.v1`,
        # which is grpcio's namespace, so the client calls the one method by hand.
        subprocess.run([protoc, f"--proto_path={proto_dir}", f"--python_out={tmp}",
                        HEALTH_PROTO], check=True)
        v1 = out / "replayssm" / "v1"
        v1.mkdir(parents=True, exist_ok=True)
        (v1 / "__init__.py").write_text('"""Generated from proto/replayssm/v1 at build time."""\n')
        for f in (pathlib.Path(tmp) / "replayssm" / "v1").glob("*.py"):
            shutil.copy(f, v1 / f.name)
        shutil.copy(pathlib.Path(tmp) / "grpc/health/v1/health_pb2.py",
                    out / "replayssm" / "_health_pb2.py")


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        generate_stubs(self.build_lib)


setup(cmdclass={"build_py": BuildPyWithStubs})
