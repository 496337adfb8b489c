#!/usr/bin/env python3
"""The npm packages of deploy/tools, vendored: the deploy checks run without a network.

deploy/tools/vendor/ holds one tarball per entry of package-lock.json (NAME-VERSION.tgz, a
scoped @scope/name as scope-name), each checked against the lock's sha512 integrity.

  vendor.py install BUILD_TOOLS_DIR NPM   what ctest deploy.npm_ci runs: package-lock.json
      with every package resolved to its vendored tarball, then `npm ci --offline` against a
      registry that does not exist and an empty cache in BUILD_TOOLS_DIR: a package missing
      from vendor/ fails the test instead of being fetched.
  vendor.py refresh                       after changing package.json / package-lock.json
      (and an online `npm ci` in deploy/tools): copies each tarball from npm's cache
      (~/.npm/_cacache, or $npm_config_cache) into vendor/ and drops the ones no longer
      locked.
"""
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
VENDOR = os.path.join(HERE, "vendor")


def locked():
    """(tarball file name, integrity) of every package of package-lock.json."""
    lock = json.load(open(os.path.join(HERE, "package-lock.json")))
    for key, entry in lock["packages"].items():
        if not key:
            continue
        name = key.split("node_modules/")[-1]
        yield key, f"{name.replace('@', '').replace('/', '-')}-{entry['version']}.tgz", \
            entry["integrity"]


def digest(path, algo):
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        h.update(f.read())
    return base64.b64encode(h.digest()).decode()


def install(build_tools, npm):
    lock = json.load(open(os.path.join(HERE, "package-lock.json")))
    errors = []
    for key, tarball, integrity in locked():
        path = os.path.join(VENDOR, tarball)
        algo, want = integrity.split("-", 1)
        if not os.path.exists(path):
            errors.append(f"{key}: deploy/tools/vendor/{tarball} is missing (vendor.py refresh)")
        elif digest(path, algo) != want:
            errors.append(f"{key}: deploy/tools/vendor/{tarball} does not match its integrity")
        lock["packages"][key]["resolved"] = "file:" + path
    if errors:
        sys.exit("vendor.py: FAIL: " + "\n".join(errors))
    shutil.copy(os.path.join(HERE, "package.json"), build_tools)
    with open(os.path.join(build_tools, "package-lock.json"), "w") as f:
        json.dump(lock, f, indent=2)
    cache = os.path.join(build_tools, "npm-cache")
    shutil.rmtree(cache, ignore_errors=True)
    env = dict(os.environ, npm_config_cache=cache)
    subprocess.run([npm, "ci", "--offline", "--no-audit", "--no-fund", "--loglevel=error",
                    "--registry", "http://127.0.0.1:9/"], cwd=build_tools, env=env, check=True)


def refresh():
    cache = os.environ.get("npm_config_cache", os.path.expanduser("~/.npm"))
    keep = set()
    os.makedirs(VENDOR, exist_ok=True)
    for key, tarball, integrity in locked():
        algo, b64 = integrity.split("-", 1)
        h = base64.b64decode(b64).hex()
        src = os.path.join(cache, "_cacache", "content-v2", algo, h[:2], h[2:4], h[4:])
        if not os.path.exists(src):
            sys.exit(f"vendor.py: {key} is not in {cache}: run `npm ci` in deploy/tools first")
        shutil.copy(src, os.path.join(VENDOR, tarball))
        keep.add(tarball)
    for old in set(os.listdir(VENDOR)) - keep:
        os.remove(os.path.join(VENDOR, old))
    print(f"vendor.py: {len(keep)} tarballs in deploy/tools/vendor")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "install":
        install(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 2 and sys.argv[1] == "refresh":
        refresh()
    else:
        sys.exit(__doc__)
