#!/usr/bin/env python3
"""End-to-end: the real replayssm-server scraped by a real Prometheus, on loopback.

1. Starts replayssm-server through deploy/docker-entrypoint.sh (the container's entrypoint:
   config file deploy/replayssm.conf, REPLAYSSM_* environment overriding it) with the CPU
   backend, tiny-gdn and free loopback ports.
2. Starts Prometheus (scrape and evaluation interval 1 s, temp storage) with the repository's
   alert rules (deploy/prometheus/alerts.yml) and a scrape job "replayssm" on the server.
3. Drives known traffic with replayssm-cli: ALLOCS allocations, as many frees, BAD_FREES frees
   of unknown slots (NOT_FOUND), then the demo scheduler (prefill + batched decode).
4. Checks through Prometheus's HTTP API that the numbers agree with what the test did:
   RPC counters by method and code, the forward count the demo reported, a rate over a window
   holding the whole run (within the bounds of Prometheus's extrapolation), and
   histogram_quantile / mean batch size against the server's own /metrics buckets.
   Also: every rule of alerts.yml is loaded and healthy, no alert fires, every metric that the
   alerts and the dashboard name (but the planned UCX ones) is exported by the server.
5. SIGTERM: the server drains and exits 0, and Prometheus sees up == 0.
Every process started here is killed on exit (also if this script is killed: PDEATHSIG).
"""
import argparse
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

ALLOCS = 5
BAD_FREES = 3
MIN_WINDOW = 10  # seconds of the rate() window (more when the traffic takes long, e.g. ASan)

procs = []


def die_with_parent():
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start(cmd, log, env=None):
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                         preexec_fn=die_with_parent)
    procs.append(p)
    return p


def cleanup():
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fail(msg):
    raise SystemExit(f"e2e: FAIL: {msg}")


def wait_for(what, fn, timeout=30.0, interval=0.2):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            last = fn()
            if last:
                return last
        except Exception as e:  # not up yet
            last = e
        time.sleep(interval)
    fail(f"timed out waiting for {what} (last: {last})")


def http_get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


class Prom:
    def __init__(self, base):
        self.base = base

    def api(self, path, **params):
        q = urllib.parse.urlencode(params)
        data = json.loads(http_get(f"{self.base}/api/v1/{path}?{q}"))
        if data.get("status") != "success":
            fail(f"Prometheus {path} {params}: {data}")
        return data["data"]

    def query(self, expr, at=None):
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.api("query", **params)["result"]

    def scalar(self, expr, at=None):
        r = self.query(expr, at)
        if len(r) != 1:
            fail(f"{expr}: expected one series, got {r}")
        return float(r[0]["value"][1])

    def last_scrape(self):
        r = self.query('timestamp(up{job="replayssm"})')
        return float(r[0]["value"][1]) if r else 0.0


def parse_metrics(text):
    """{(name, frozenset(labels)): value} from the Prometheus text format."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{(.*)\})?\s+(\S+)", line)
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        out[(m.group(1), labels)] = float(m.group(4))
    return out


def value(metrics, name, **labels):
    return metrics.get((name, frozenset(labels.items())), 0.0)


def quantile(q, buckets):
    """histogram_quantile on cumulative (le, count) pairs, as Prometheus computes it."""
    buckets = sorted(buckets, key=lambda b: b[0])
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return float("nan")


def cli(args, address, *rest, ok=True):
    r = subprocess.run([args.cli, "--address", address, *rest], capture_output=True, text=True,
                       timeout=60)
    if ok and r.returncode != 0:
        fail(f"replayssm-cli {' '.join(rest)}: rc {r.returncode}: {r.stderr}{r.stdout}")
    if not ok and r.returncode == 0:
        fail(f"replayssm-cli {' '.join(rest)} succeeded, expected an error")
    return r


def referenced_metrics(args):
    text = open(args.alerts).read() + open(args.dashboard).read()
    names = set(re.findall(r"\breplayssm_[a-z0-9_]+", text))
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def run(args, tmp):
    # --- 1. the server, through the container entrypoint ---------------------------------
    ready = os.path.join(tmp, "ready")
    env = dict(os.environ, REPLAYSSM_SERVER_BIN=args.server, REPLAYSSM_CONFIG=args.config,
               REPLAYSSM_GRPC_ADDRESS="127.0.0.1:0", REPLAYSSM_METRICS_ADDRESS="127.0.0.1:0",
               REPLAYSSM_DEVICE="cpu", REPLAYSSM_MODEL="tiny-gdn", REPLAYSSM_READY_FILE=ready,
               REPLAYSSM_MEMORY_BUDGET="64M", REPLAYSSM_DRAIN_TIMEOUT="5")
    server_log = open(os.path.join(tmp, "server.log"), "w")
    server = start([args.entrypoint], server_log, env)
    addrs = wait_for("the server's ready file", lambda: dict(
        line.split("=", 1) for line in open(ready).read().split()) if os.path.exists(ready) else None)
    grpc_addr, metrics_addr = addrs["grpc"], addrs["metrics"]
    print(f"e2e: server gRPC {grpc_addr}, metrics {metrics_addr}")
    if cli(args, grpc_addr, "health").stdout.strip() != "SERVING":
        fail("health is not SERVING")

    # --- 2. Prometheus ----------------------------------------------------------------------
    prom_port = free_port()
    shutil.copy(args.alerts, os.path.join(tmp, "alerts.yml"))
    with open(os.path.join(tmp, "prometheus.yml"), "w") as f:
        f.write(f"""global:
  scrape_interval: 1s
  scrape_timeout: 900ms
  evaluation_interval: 1s
rule_files: [alerts.yml]
scrape_configs:
  - job_name: replayssm
    static_configs:
      - targets: ["{metrics_addr}"]
""")
    prom_log = open(os.path.join(tmp, "prometheus.log"), "w")
    start([args.prometheus, f"--config.file={tmp}/prometheus.yml",
           f"--storage.tsdb.path={tmp}/data", f"--web.listen-address=127.0.0.1:{prom_port}",
           "--web.enable-lifecycle"], prom_log)
    prom = Prom(f"http://127.0.0.1:{prom_port}")
    wait_for("Prometheus ready", lambda: "Ready" in http_get(f"{prom.base}/-/ready"))
    wait_for("target up", lambda: prom.query('up{job="replayssm"} == 1'))
    start_time = time.time()

    # --- 3. traffic ---------------------------------------------------------------------------
    slots = [json.loads(cli(args, grpc_addr, "alloc").stdout)["slot"] for _ in range(ALLOCS)]
    for s in slots:
        cli(args, grpc_addr, "free", s)
    for i in range(BAD_FREES):
        cli(args, grpc_addr, "free", str(1000 + i), ok=False)
    before_demo = parse_metrics(http_get(f"http://{metrics_addr}/metrics"))
    for method, code, want in [("Allocate", "OK", ALLOCS), ("Free", "OK", ALLOCS),
                               ("Free", "NOT_FOUND", BAD_FREES)]:
        got = value(before_demo, "replayssm_rpcs_total", method=method, code=code)
        if got != want:
            fail(f"/metrics replayssm_rpcs_total{{method={method},code={code}}} = {got}, the test did {want}")
    demo = cli(args, grpc_addr, "demo", "--requests", "3", "--steps", "12").stdout
    m = re.search(r"demo: OK: (\d+) forwards", demo)
    if not m:
        fail(f"demo output: {demo}")
    forwards = int(m.group(1))
    traffic_end = time.time()
    truth = parse_metrics(http_get(f"http://{metrics_addr}/metrics"))
    print(f"e2e: traffic: {ALLOCS} alloc, {ALLOCS} free, {BAD_FREES} bad free, demo {forwards} forwards")

    # The server's own counters first (what the test did, exactly).
    for name, labels, want in [
        ("replayssm_rpcs_total", {"method": "Allocate", "code": "OK"}, None),
        ("replayssm_rpcs_total", {"method": "Free", "code": "NOT_FOUND"}, BAD_FREES),
        ("replayssm_forward_duration_seconds_count", {}, forwards),
        ("replayssm_forward_batch_size_count", {}, forwards),
        ("replayssm_forwards_total", {"outcome": "committed"}, forwards),
    ]:
        got = value(truth, name, **labels)
        if want is not None and got != want:
            fail(f"/metrics {name}{labels} = {got}, the test did {want}")

    # The rate window (t_eval - WINDOW, t_eval] starts before the traffic (the counters are 0
    # there) and ends after it, with scrapes of the final values inside.
    WINDOW = max(MIN_WINDOW, int(traffic_end - start_time) + 5)
    t_eval = start_time - 1.0 + WINDOW
    while time.time() < t_eval + 1.5:
        time.sleep(0.2)
    wait_for("a scrape after the evaluation time", lambda: prom.last_scrape() >= t_eval)

    # --- 4. Prometheus agrees ----------------------------------------------------------------
    checks = 0

    def expect_equal(expr, want):
        nonlocal checks
        got = prom.scalar(expr, t_eval)
        if abs(got - want) > 1e-9 * max(1.0, abs(want)):
            fail(f"Prometheus {expr} = {got}, expected {want}")
        print(f"e2e: ok {expr} = {got:g}")
        checks += 1

    for key, v in truth.items():
        name, labels = key
        if name == "replayssm_rpcs_total":
            sel = ",".join(f'{k}="{x}"' for k, x in sorted(labels))
            expect_equal(f'replayssm_rpcs_total{{job="replayssm",{sel}}}', v)
    expect_equal('replayssm_rpcs_total{job="replayssm",method="Free",code="NOT_FOUND"}', BAD_FREES)
    expect_equal('replayssm_forward_duration_seconds_count{job="replayssm"}', forwards)
    expect_equal('sum(replayssm_slots{job="replayssm"})',
                 value(truth, "replayssm_slots_capacity"))

    # A rate over a window holding the whole run: increase = forwards x window / sampled span,
    # and the sampled span lies within [window - 2 scrape intervals, window].
    rate = prom.scalar(f'rate(replayssm_forwards_total{{job="replayssm",outcome="committed"}}[{WINDOW}s])', t_eval)
    # One missed scrape at an edge may shorten the sampled span by another interval.
    lo, hi = forwards / WINDOW, forwards / (WINDOW - 3.5)
    if not lo * 0.999 <= rate <= hi * 1.001:
        fail(f"rate of committed forwards {rate:.4f}/s outside [{lo:.4f}, {hi:.4f}] for {forwards} forwards in {WINDOW}s")
    print(f"e2e: ok rate(replayssm_forwards_total[{WINDOW}s]) = {rate:.4f}/s for {forwards} forwards")
    checks += 1

    # Quantiles: the histograms exist from the start (all buckets 0), so a rate over the whole
    # run scales every bucket alike and the quantile equals the one of the raw buckets.
    for name, q in [("replayssm_forward_duration_seconds", 0.99), ("replayssm_forward_duration_seconds", 0.5),
                    ("replayssm_forward_batch_size", 0.9)]:
        buckets = [(float(dict(k[1])["le"].replace("+Inf", "inf")), v)
                   for k, v in truth.items() if k[0] == f"{name}_bucket"]
        want = quantile(q, buckets)
        got = prom.scalar(f'histogram_quantile({q}, sum by (le) (rate({name}_bucket{{job="replayssm"}}[{WINDOW}s])))', t_eval)
        if not abs(got - want) <= 1e-6 * max(1e-9, abs(want)):
            fail(f"histogram_quantile({q}, {name}) = {got}, the server's buckets give {want}")
        print(f"e2e: ok histogram_quantile({q}, rate({name}_bucket[{WINDOW}s])) = {got:.6g}")
        checks += 1
    mean = prom.scalar('replayssm_forward_batch_size_sum{job="replayssm"} / replayssm_forward_batch_size_count{job="replayssm"}', t_eval)
    want = value(truth, "replayssm_forward_batch_size_sum") / forwards
    if abs(mean - want) > 1e-9:
        fail(f"mean batch size {mean} != {want}")
    checks += 1

    # Rules loaded and healthy; nothing fires on a healthy server.
    rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
    want_alerts = set(re.findall(r"^\s*- alert: (\w+)", open(args.alerts).read(), re.M))
    got_alerts = {r["name"] for r in rules if r["type"] == "alerting"}
    if got_alerts != want_alerts:
        fail(f"Prometheus loaded alerts {sorted(got_alerts)}, alerts.yml has {sorted(want_alerts)}")
    bad = [r for r in rules if r.get("health") not in ("ok",)]
    if bad:
        fail(f"unhealthy rules: {[(r['name'], r.get('health'), r.get('lastError')) for r in bad]}")
    active = [a for a in prom.api("alerts")["alerts"]]
    if active:
        fail(f"alerts active on a healthy server: {active}")
    print(f"e2e: ok {len(rules)} rules loaded and healthy, no alert active")
    checks += 1

    # Every metric that the alerts and the dashboard name is exported (the transfer ones too:
    # they were left out while planned, and stayed out after they were built).
    exported = {re.sub(r"_(bucket|sum|count)$", "", k[0]) for k in truth}
    missing = sorted(n for n in referenced_metrics(args) if n not in exported)
    if missing:
        fail(f"alerts/dashboard name metrics the server does not export: {missing}")
    checks += 1

    # --- 5. drain ------------------------------------------------------------------------------
    server.send_signal(signal.SIGTERM)
    try:
        rc = server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        fail("the server did not stop within 20 s of SIGTERM")
    if rc != 0:
        fail(f"the server exited {rc} after SIGTERM")
    wait_for("Prometheus to see up == 0", lambda: prom.query('up{job="replayssm"} == 0'), timeout=10)
    print("e2e: ok SIGTERM: drained, exit 0, Prometheus sees up == 0")
    checks += 1
    print(f"e2e: {checks} checks passed in {time.time() - start_time:.1f} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--cli", required=True)
    ap.add_argument("--entrypoint", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--prometheus", default=shutil.which("prometheus") or "/usr/bin/prometheus")
    ap.add_argument("--alerts", required=True)
    ap.add_argument("--dashboard", required=True)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    tmp = tempfile.mkdtemp(prefix="replayssm-e2e-")
    ok = False
    try:
        run(args, tmp)
        ok = True
    finally:
        cleanup()
        if not ok:
            for log in ("server.log", "prometheus.log"):
                p = os.path.join(tmp, log)
                if os.path.exists(p):
                    print(f"--- {log} (last 30 lines)")
                    print("".join(open(p).readlines()[-30:]))
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
