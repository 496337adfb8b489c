#!/usr/bin/env python3
"""Every flag of `replayssm-server --help` is documented and reachable from the container.

- docker-entrypoint.sh maps REPLAYSSM_<FLAG> to it (all flags but --config),
- docs/operations.md names it in its flag table (`--flag`),
- every `name = value` line of deploy/replayssm.conf and of the ConfigMap's replayssm.conf
  is a real flag, and the server's own parser accepts both files (the server is started with
  the file and an address it cannot bind, so it exits right after parsing: rc 2 means the
  file was rejected).
usage: check_flags.py SERVER_BINARY REPO_ROOT
"""
import re
import subprocess
import sys
import tempfile

server, root = sys.argv[1], sys.argv[2]
help_text = subprocess.run([server, "--help"], capture_output=True, text=True, check=True).stdout
flags = sorted(set(re.findall(r"^\s+--([a-z][a-z0-9-]*)", help_text, re.M)))
if len(flags) < 10:
    sys.exit(f"check_flags: FAIL: only {flags} in --help")
entry = open(f"{root}/deploy/docker-entrypoint.sh").read()
m = re.search(r"flags=\(([^)]*)\)", entry)
mapped = set(m.group(1).split()) if m else set()
ops = open(f"{root}/docs/operations.md").read()
errors = []
for f in flags:
    if f != "config" and f not in mapped:
        errors.append(f"docker-entrypoint.sh does not map REPLAYSSM_{f.upper().replace('-', '_')} to --{f}")
    if f"`--{f}" not in ops:
        errors.append(f"docs/operations.md does not document --{f}")
for f in mapped:
    if f not in flags:
        errors.append(f"docker-entrypoint.sh maps --{f}, which the server does not have")


def conf_names(text):
    return [l.split("#")[0].split("=")[0].strip() for l in text.splitlines()
            if l.split("#")[0].strip()]


confs = {"deploy/replayssm.conf": open(f"{root}/deploy/replayssm.conf").read()}
cm = open(f"{root}/deploy/k8s/configmap.yaml").read()
block = re.search(r"replayssm\.conf: \|\n((?:    .*\n|\s*\n)+)", cm)
confs["deploy/k8s/configmap.yaml"] = "\n".join(l[4:] for l in block.group(1).splitlines()) if block else ""
for name, text in confs.items():
    for n in conf_names(text):
        if n not in flags or n == "config":
            errors.append(f"{name}: {n} is not a server flag")
    # The server's parser must accept the file: an unknown name or bad value fails with rc 2
    # before anything starts; an accepted file gets as far as binding, which we make fail.
    with tempfile.NamedTemporaryFile("w", suffix=".conf") as f:
        f.write(text)
        f.flush()
        r = subprocess.run([server, "--config", f.name, "--grpc-address", "256.0.0.1:1",
                            "--metrics-address", "", "--device", "cpu", "--model", "tiny-gdn",
                            "--memory-budget", "16M"],
                           capture_output=True, text=True, timeout=60)
        if r.returncode == 2:
            errors.append(f"{name}: the server rejects it: {r.stderr.strip().splitlines()[0]}")
for e in errors:
    print(f"check_flags: FAIL: {e}")
print(f"check_flags: {len(flags)} flags, {'OK' if not errors else f'{len(errors)} problem(s)'}")
sys.exit(1 if errors else 0)
