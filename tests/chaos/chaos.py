#!/usr/bin/env python3
"""Chaos test of a whole local pdserve cluster (docs/security.md, docs/operations in README).

Starts `pdserve up --prefill 2 --decode 2` with a generated cluster secret, keeps a steady
streaming load on the router, and meanwhile injects faults at random (seeded):
  - kill -9 of a prefill or decode worker (the supervisor in `up` must restart it),
  - SIGSTOP of a worker for a few seconds, then SIGCONT,
  - early client hang-ups (connect, send part or all of a request, close),
  - forged internal calls (unsigned, signed with another secret, a tampered timestamp, garbage
    signatures) straight at the workers' internal ports, carrying junk KV descriptors.
A silent link loss between prefill and decode (network namespaces joined by a veth pair that is
cut) is the separate case tests/chaos/link_loss.py.

Invariants (any violation fails the run):
  - the router never dies and answers /health throughout;
  - every request ends, with success or a documented error (HTTP 429/502/503/504 with an
    OpenAI error body, or a stream ending in an error event), within its deadline + margin;
  - forged internal calls are refused (401) and no worker dies of them;
  - at the end, after the load stops: every worker is ready again, every decode pool is fully
    free (no block leaked or quarantined forever), and no process exceeds its memory budget.

Prints a summary: requests, successes, errors by kind, p99 time to error, faults, violations.
Exit status: 0 when no invariant was violated, 1 otherwise.
"""
import argparse
import hashlib
import hmac
import http.client
import json
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

# "PDSERVE_CHILD name=prefill-0 pid=123 url=http://127.0.0.1:40123" (printed again on a restart).
CHILD_LINE = re.compile(r"PDSERVE_CHILD name=(\S+) (?:pid=\d+ )?url=(\S+)")


class Cluster:
    """`pdserve up` and its children, found through their PDSERVE_* lines."""

    def __init__(self, pdserve, secret_file, extra_args, log_path):
        self.log = open(log_path, "w")
        args = [pdserve, "up", "--prefill", "2", "--decode", "2", "--port", "0",
                "--cluster.secret_file", secret_file] + extra_args
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)
        self.children = {}  # name -> url
        self.router_url = None
        self.lines_thread = None
        deadline = time.time() + 300
        for line in self.proc.stdout:
            self.log.write(line)
            m = CHILD_LINE.match(line)
            if m:
                self.children[m.group(1)] = m.group(2)
            m = re.match(r"PDSERVE_READY role=up url=(\S+)", line)
            if m:
                self.router_url = m.group(1)
                break
            if time.time() > deadline:
                break
        if self.router_url is None:
            raise RuntimeError("pdserve up did not become ready (see the log)")
        self.lines_thread = threading.Thread(target=self._pump, daemon=True)
        self.lines_thread.start()

    def _pump(self):
        for line in self.proc.stdout:
            self.log.write(line)
            m = CHILD_LINE.match(line)
            if m:
                self.children[m.group(1)] = m.group(2)

    def workers(self):
        return {n: u for n, u in self.children.items() if n.startswith(("prefill", "decode"))}

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def pid_listening(port):
    """The pid of the process listening on a TCP port (ss -ltnp)."""
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True).stdout
    m = re.search(r"pid=(\d+)", out)
    return int(m.group(1)) if m else None


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def sign(secret, method, target, body):
    t = str(int(time.time() * 1000))
    n = secrets.token_hex(16)
    text = "\n".join(["pdserve-call-v1", method, target, t, n, hashlib.sha256(body).hexdigest()]).encode()
    s = hmac.new(secret, text, hashlib.sha256).hexdigest()
    return f"v1 t={t} n={n} s={s}"


def http_call(url, method, target, body=b"", headers=None, timeout=10.0):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request(method, target, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = 0
        self.successes = 0
        self.errors = {}
        self.error_times = []
        self.violations = []
        self.violation_count = 0
        self.faults = {}

    def error(self, kind, seconds):
        with self.lock:
            self.errors[kind] = self.errors.get(kind, 0) + 1
            self.error_times.append(seconds)

    def violation(self, text):
        with self.lock:
            self.violation_count += 1
            if len(self.violations) >= 200:
                return  # counted, not kept: a dead cluster would otherwise flood the log
            self.violations.append(text)
        print(f"chaos: VIOLATION: {text}", flush=True)

    def fault(self, kind):
        with self.lock:
            self.faults[kind] = self.faults.get(kind, 0) + 1


DOCUMENTED_STATUSES = {429, 502, 503, 504}


def one_request(router_url, deadline_s, stats, rng):
    u = urllib.parse.urlparse(router_url)
    body = json.dumps({
        "model": "pdserve-default",
        "messages": [{"role": "user", "content": rng.choice(["What is a river?", "What is a dog?", "Tell me about the sea."])}],
        "max_tokens": rng.randint(4, 24), "temperature": 0.7, "seed": rng.randint(0, 1 << 30), "stream": True,
    }).encode()
    t0 = time.time()
    with stats.lock:
        stats.requests += 1
    try:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=deadline_s + 15)
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            payload = r.read()
            elapsed = time.time() - t0
            kind = f"http_{r.status}"
            if r.status not in DOCUMENTED_STATUSES:
                stats.violation(f"undocumented status {r.status}: {payload[:200]!r}")
            else:
                try:
                    json.loads(payload)["error"]["message"]
                except Exception:
                    stats.violation(f"status {r.status} without an OpenAI error body: {payload[:200]!r}")
            stats.error(kind, elapsed)
            if r.status in (429, 503):
                time.sleep(0.05)  # pacing, as a real client backs off; no event depends on it
        else:
            done = False
            errored = False
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if line == "data: [DONE]":
                    done = True
                    break
                if line.startswith("data: ") and '"error"' in line:
                    errored = True
            elapsed = time.time() - t0
            if done and not errored:
                with stats.lock:
                    stats.successes += 1
            elif errored:
                stats.error("stream_error_event", elapsed)
            else:
                stats.violation("a stream ended without [DONE] or an error event")
                stats.error("stream_truncated", elapsed)
        conn.close()
    except (OSError, http.client.HTTPException) as e:
        elapsed = time.time() - t0
        stats.violation(f"client-side failure after {elapsed:.1f} s: {e!r}")
        stats.error("client_exception", elapsed)
        return
    if elapsed > deadline_s + 10:
        stats.violation(f"a request took {elapsed:.1f} s, past its {deadline_s} s deadline")


def hang_up(router_url, rng):
    u = urllib.parse.urlparse(router_url)
    body = json.dumps({"model": "pdserve-default", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 16, "stream": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    try:
        s = socket.create_connection((u.hostname, u.port), timeout=5)
        stage = rng.randint(0, 3)
        if stage >= 1:
            s.sendall(head)
        if stage >= 2:
            s.sendall(body)
        if stage >= 3:
            s.settimeout(2)
            try:
                s.recv(rng.randint(1, 400))
            except OSError:
                pass
        s.close()
    except OSError:
        pass


def forge(cluster, secret, stats, rng):
    """Forged internal calls: every one must be refused with 401 and leave the worker alive."""
    workers = cluster.workers()
    if not workers:
        return
    name, url = rng.choice(sorted(workers.items()))
    path = rng.choice(["/v1/internal/prefill", "/v1/internal/prefill/cancel"] if name.startswith("prefill")
                      else ["/v1/internal/decode", "/v1/internal/decode/abort"])
    body = json.dumps({"request_id": "forged-" + secrets.token_hex(4), "token_ids": [1, 2, 3],
                       "kv_descriptor": secrets.token_hex(64)}).encode()
    variants = {
        "unsigned": {},
        "wrong_secret": {"X-Pdserve-Auth": sign(secrets.token_bytes(32), "POST", path, body)},
        "stale": {"X-Pdserve-Auth": sign(secret, "POST", path, body).replace("t=", "t=1", 1)},
        "garbage": {"X-Pdserve-Auth": "v1 " + secrets.token_hex(40)},
    }
    kind = rng.choice(sorted(variants))
    stats.fault("forged_" + kind)
    try:
        status, payload = http_call(url, "POST", path, body, {"Content-Type": "application/json", **variants[kind]})
    except OSError:
        return  # the worker may be down from another fault
    if status != 401:
        stats.violation(f"forged call ({kind}) to {name} answered {status}, not 401: {payload[:200]!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdserve", required=True)
    ap.add_argument("--duration", type=float, default=150.0, help="seconds of load and faults")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fault-every", type=float, default=4.0, help="mean seconds between faults")
    ap.add_argument("--memory-budget-mib", type=float, default=3072.0)
    ap.add_argument("--request-timeout-ms", type=int, default=30000)
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    work = args.log_dir or tempfile.mkdtemp(prefix="pd_chaos_")
    os.makedirs(work, exist_ok=True)
    secret_file = os.path.join(work, "cluster-secret")
    secret = secrets.token_hex(32).encode()
    with open(secret_file, "wb") as f:
        f.write(secret + b"\n")
    os.chmod(secret_file, 0o600)

    stats = Stats()
    # The faults restart workers far more often than a real cluster would: lift up's restart
    # budget so that healing, not the budget, is what the run checks.
    cluster = Cluster(args.pdserve, secret_file, [f"--router.request_timeout_ms={args.request_timeout_ms}",
                                                  "--up.restart_budget=1000000"],
                      os.path.join(work, "up.log"))
    print(f"chaos: cluster up at {cluster.router_url}; workers {sorted(cluster.workers())}; logs in {work}", flush=True)
    stop = threading.Event()
    deadline_s = args.request_timeout_ms / 1000.0

    def client_loop(i):
        r = random.Random(args.seed * 1000 + i)
        while not stop.is_set() and cluster.alive():
            if r.random() < 0.2:
                hang_up(cluster.router_url, r)
                stats.fault("client_hang_up")
            else:
                one_request(cluster.router_url, deadline_s, stats, r)

    def watch_router():
        while not stop.is_set():
            if not cluster.alive():
                stats.violation("pdserve up (or its router) exited during the run")
                return
            try:
                status, _ = http_call(cluster.router_url, "GET", "/health", timeout=10)
                if status != 200:
                    stats.violation(f"router /health answered {status}")
            except OSError as e:
                stats.violation(f"router /health failed: {e!r}")
            stop.wait(1.0)

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(args.clients)]
    threads.append(threading.Thread(target=watch_router, daemon=True))
    for t in threads:
        t.start()

    end = time.time() + args.duration
    stopped = {}  # pid -> time to continue
    while time.time() < end and not stats.violations[:1] == ["pdserve up (or its router) exited during the run"]:
        time.sleep(rng.expovariate(1.0 / args.fault_every))
        for pid, at in list(stopped.items()):
            if time.time() >= at:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                del stopped[pid]
        workers = cluster.workers()
        if not workers:
            continue
        name, url = rng.choice(sorted(workers.items()))
        pid = pid_listening(urllib.parse.urlparse(url).port)
        choice = rng.random()
        if choice < 0.3 and pid:
            stats.fault("kill9_" + name.rstrip("0123456789-"))
            os.kill(pid, signal.SIGKILL)
        elif choice < 0.55 and pid and pid not in stopped:
            stats.fault("sigstop_" + name.rstrip("0123456789-"))
            os.kill(pid, signal.SIGSTOP)
            stopped[pid] = time.time() + rng.uniform(1.0, 4.0)
        else:
            forge(cluster, secret, stats, rng)
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    stop.set()
    for t in threads:
        t.join(timeout=deadline_s + 30)

    # Quiesce: every worker ready again, every pool free, memory within budget.
    recover_by = time.time() + 60
    pending = dict(cluster.workers())
    while pending and time.time() < recover_by:
        for name, url in list(pending.items()):
            try:
                status, _ = http_call(url, "GET", "/ready", timeout=5)
                if status == 200:
                    del pending[name]
            except OSError:
                pass
        time.sleep(0.5)
    for name in pending:
        stats.violation(f"worker {name} did not come back within 60 s")
    for name, url in sorted(cluster.workers().items()):
        if not name.startswith("decode"):
            continue
        free_by = time.time() + 30
        last = None
        while time.time() < free_by:
            try:
                target = "/v1/internal/status"
                status, payload = http_call(url, "GET", target, b"", {"X-Pdserve-Auth": sign(secret, "GET", target, b"")})
                last = json.loads(payload) if status == 200 else None
                if last and last.get("free_blocks") == last.get("total_blocks") and not last.get("quarantined_blocks"):
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        else:
            stats.violation(f"decode worker {name} did not return to a fully free pool: {last}")
    for name, url in sorted(cluster.children.items()):
        pid = pid_listening(urllib.parse.urlparse(url).port)
        mib = rss_mib(pid) if pid else None
        if mib is not None and mib > args.memory_budget_mib:
            stats.violation(f"{name} uses {mib:.0f} MiB, over the {args.memory_budget_mib:.0f} MiB budget")
    router_alive = cluster.alive()
    code = cluster.stop()
    if not router_alive:
        stats.violation("the cluster was not running at the end")
    elif code != 0:
        stats.violation(f"pdserve up exited {code} on SIGTERM (expected a clean drain, 0)")

    times = sorted(stats.error_times)
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))] if times else 0.0
    summary = {
        "duration_s": args.duration, "requests": stats.requests, "successes": stats.successes,
        "errors": stats.errors, "p99_time_to_error_s": round(p99, 3), "faults": stats.faults,
        "violations": stats.violation_count,
    }
    print("chaos: summary " + json.dumps(summary, sort_keys=True), flush=True)
    for v in stats.violations[:20]:
        print("chaos: violation: " + v)
    return 0 if not stats.violation_count else 1


if __name__ == "__main__":
    sys.exit(main())
