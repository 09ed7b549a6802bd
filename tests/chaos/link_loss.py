#!/usr/bin/env python3
"""Silent link loss between a prefill and a decode worker (issue 21, tests/chaos).

Topology (needs root: `ip netns`; exits 77 = skipped, with the reason printed, where the
machine refuses it), three network namespaces and no interface in the host's:

    netns R: router + this test's clients ──veth── netns P: prefill ──veth "kv link"── netns D: decode
             (10.N.1.1, 10.N.2.1)                   (10.N.1.2 HTTP, 10.N.3.1 UCX)     (10.N.3.2 UCX, 10.N.2.2 HTTP)
             └──────────────────────────────────────veth──────────────────────────────────────┘

The router reaches each worker's internal API over its own veth; the KV data plane (UCX over tcp
only, kvtransfer.host pinning each worker's UCX to the kv link) crosses only the kv link. The test
process itself moves into R (setns), so nothing it creates is visible to other processes of the
machine (a UCX process listening on every interface would otherwise pick up, and stall on, links
that this test deletes). Under a
steady streaming load the test cuts the kv link silently (`ip link set <decode end> down`: the
prefill side's device loses carrier and drops what it sends; no RST, no ICMP, nothing reaches the
UCX peer-failure handlers), keeps the load on for a while, restores the link and keeps the load on
until new requests succeed again.

Invariants (any violation fails the run):
  - every request ends with success or a documented error (HTTP 429/502/503/504 with an OpenAI
    error body, or a stream ending in an error event) within the router's request deadline plus a
    margin — the transfer deadlines, not the client, must end what the cut stalls;
  - no process dies (router, prefill, decode);
  - after the link is restored new requests succeed (within peer_suspect + transfer timeout +
    a margin);
  - after the load stops: the decode pool is whole again (pdserve_kv_blocks_free ==
    pdserve_kv_blocks_total, nothing quarantined, no pending receive) and the prefill worker has
    no transfer in flight.

Prints a summary: requests, successes, errors by kind, p99 time to error, what the cut did.
Exit status: 0 when no invariant was violated, 1 otherwise, 77 when skipped.
"""
import argparse
import ctypes
import json
import os
import queue
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import http.client

DOCUMENTED_STATUSES = {429, 502, 503, 504}
READY = re.compile(r"PDSERVE_READY role=(\S+) url=(\S+)")


def sh(*args, check=True):
    p = subprocess.run(list(args), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")
    return p


CLONE_NEWNET = 0x40000000


def enter_netns(name):
    """Moves the calling thread (and the threads and processes it creates later) into a namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{name}") as f:
        if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
            raise RuntimeError(f"setns {name}: {os.strerror(ctypes.get_errno())}")


class Net:
    """Three network namespaces: R (router, clients) with a veth into P and into D, and the kv link
    between P (prefill) and D (decode)."""

    def __init__(self):
        tag = f"{os.getpid() % 0xffff:04x}"
        self.ns_r, self.ns_p, self.ns_d = f"pdll{tag}r", f"pdll{tag}p", f"pdll{tag}d"
        self.net = 10 + os.getpid() % 200  # 10.N.x.y: concurrent runs do not share addresses
        self.base = f"10.{self.net}"
        self.r_p, self.in_p = f"pl{tag}r", f"pl{tag}i"
        self.r_d, self.in_d = f"dl{tag}r", f"dl{tag}i"
        self.kv_p, self.kv_d = f"kl{tag}p", f"kl{tag}d"
        self.created = []

    def setup(self):
        for ns in (self.ns_r, self.ns_p, self.ns_d):
            sh("ip", "netns", "add", ns)
            self.created.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        # Every veth is created inside R (or P) and its ends moved: none appears in the host's namespace.
        for r_if, in_if, ns, subnet in ((self.r_p, self.in_p, self.ns_p, 1), (self.r_d, self.in_d, self.ns_d, 2)):
            sh("ip", "-n", self.ns_r, "link", "add", r_if, "type", "veth", "peer", "name", in_if)
            sh("ip", "-n", self.ns_r, "link", "set", in_if, "netns", ns)
            sh("ip", "-n", self.ns_r, "addr", "add", f"{self.base}.{subnet}.1/24", "dev", r_if)
            sh("ip", "-n", self.ns_r, "link", "set", r_if, "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.base}.{subnet}.2/24", "dev", in_if)
            sh("ip", "-n", ns, "link", "set", in_if, "up")
        sh("ip", "-n", self.ns_p, "link", "add", self.kv_p, "type", "veth", "peer", "name", self.kv_d)
        sh("ip", "-n", self.ns_p, "link", "set", self.kv_d, "netns", self.ns_d)
        sh("ip", "-n", self.ns_p, "addr", "add", f"{self.base}.3.1/24", "dev", self.kv_p)
        sh("ip", "-n", self.ns_d, "addr", "add", f"{self.base}.3.2/24", "dev", self.kv_d)
        sh("ip", "-n", self.ns_p, "link", "set", self.kv_p, "up")
        sh("ip", "-n", self.ns_d, "link", "set", self.kv_d, "up")

    def cut(self):
        # The decode end goes down: the prefill end loses carrier and silently drops what it sends.
        sh("ip", "-n", self.ns_d, "link", "set", self.kv_d, "down")

    def restore(self):
        sh("ip", "-n", self.ns_d, "link", "set", self.kv_d, "up")

    def teardown(self):
        for ns in self.created:  # deleting a namespace deletes its veth ends, and so their peers
            sh("ip", "netns", "del", ns, check=False)


class Role:
    """One pdserve process (optionally inside a namespace), found through its READY line."""

    def __init__(self, name, argv, log_path, netns=None):
        self.name = name
        self.log = open(log_path, "w")
        cmd = (["ip", "netns", "exec", netns] if netns else []) + argv
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1,
                                     start_new_session=True)
        self.url = None
        lines = queue.Queue()
        threading.Thread(target=self._pump, args=(lines,), daemon=True).start()
        deadline = time.time() + 180
        while time.time() < deadline and self.proc.poll() is None:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            m = READY.search(line)
            if m:
                self.url = m.group(2)
                break
        if self.url is None:
            raise RuntimeError(f"{name} did not become ready (log: {log_path})")

    def _pump(self, lines):
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            lines.put(line)

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def get(url, target, timeout=5.0):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("GET", target)
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def metric(text, name):
    """Sum of a metric's samples in a Prometheus exposition text (None when absent)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


class Load:
    """Streaming chat requests from `clients` threads; each outcome is recorded with its phase."""

    def __init__(self, router_url, clients, deadline_s, seed):
        self.router_url = router_url
        self.deadline_s = deadline_s
        self.lock = threading.Lock()
        self.records = []   # (phase, kind, start, elapsed)
        self.violations = []
        self.phase = "warmup"
        self.stop_event = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(random.Random(seed + i),), daemon=True)
                        for i in range(clients)]
        for t in self.threads:
            t.start()

    def violation(self, text):
        with self.lock:
            self.violations.append(text)
        print(f"link_loss: VIOLATION: {text}", flush=True)

    def _client(self, rng):
        while not self.stop_event.is_set():
            self._one(rng)

    def _one(self, rng):
        u = urllib.parse.urlparse(self.router_url)
        body = json.dumps({
            "model": "pdserve-default",
            "messages": [{"role": "user", "content": rng.choice(["What is a river?", "Tell me about the sea."])}],
            "max_tokens": rng.randint(4, 16), "temperature": 0.7, "seed": rng.randint(0, 1 << 30), "stream": True,
        }).encode()
        with self.lock:
            phase = self.phase
        t0 = time.time()
        kind = None
        try:
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=self.deadline_s + 30)
            conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            if r.status != 200:
                payload = r.read()
                kind = f"http_{r.status}"
                if r.status not in DOCUMENTED_STATUSES:
                    self.violation(f"undocumented status {r.status}: {payload[:200]!r}")
                else:
                    try:
                        json.loads(payload)["error"]["message"]
                    except (ValueError, KeyError, TypeError):
                        self.violation(f"status {r.status} without an OpenAI error body: {payload[:200]!r}")
                if r.status in (429, 503):
                    time.sleep(0.05)  # a real client backs off; nothing is ordered by it
            else:
                done, errored = False, False
                for raw in r:
                    line = raw.decode(errors="replace").strip()
                    if line == "data: [DONE]":
                        done = True
                        break
                    if line.startswith("data: ") and '"error"' in line:
                        errored = True
                if done and not errored:
                    kind = "ok"
                elif errored:
                    kind = "stream_error_event"
                else:
                    kind = "stream_truncated"
                    self.violation("a stream ended without [DONE] or an error event")
            conn.close()
        except (OSError, http.client.HTTPException) as e:
            kind = "client_exception"
            self.violation(f"client-side failure after {time.time() - t0:.1f} s: {e!r}")
        elapsed = time.time() - t0
        if elapsed > self.deadline_s + 10:
            self.violation(f"a request ({phase}) took {elapsed:.1f} s, past its {self.deadline_s:.0f} s deadline")
        with self.lock:
            self.records.append((phase, kind, t0, elapsed))

    def set_phase(self, phase):
        with self.lock:
            self.phase = phase

    def successes_since(self, t):
        with self.lock:
            return sum(1 for _, k, t0, _ in self.records if k == "ok" and t0 >= t)

    def first_success_after(self, t):
        with self.lock:
            starts = [t0 + e for _, k, t0, e in self.records if k == "ok" and t0 >= t]
        return min(starts) if starts else None

    def stop(self):
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=self.deadline_s + 60)
            if t.is_alive():
                self.violation("a client thread is still waiting on a request after its deadline")


def wait_until(predicate, timeout_s, step_s=0.2):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()


def p99(values):
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(0.99 * (len(v) - 1) + 0.5))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pdserve", required=True)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--cuts", type=int, default=1, help="cut/restore cycles")
    ap.add_argument("--cut-seconds", type=float, default=12.0, help="how long each cut lasts, under load")
    ap.add_argument("--after-seconds", type=float, default=4.0, help="load kept on after the first success past a restore")
    ap.add_argument("--transfer-timeout-ms", type=int, default=4000)
    ap.add_argument("--peer-suspect-ms", type=int, default=3000)
    ap.add_argument("--request-timeout-ms", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()

    if os.geteuid() != 0:
        print("SKIP: link_loss needs root (ip netns)", flush=True)
        return 77
    if shutil.which("ip") is None:
        print("SKIP: link_loss needs iproute2 (ip)", flush=True)
        return 77
    work = args.log_dir or tempfile.mkdtemp(prefix="pd_link_loss_")
    os.makedirs(work, exist_ok=True)
    net = Net()
    try:
        net.setup()
        enter_netns(net.ns_r)  # the router and the clients live in R from here on
    except (RuntimeError, OSError) as e:
        net.teardown()
        print(f"SKIP: cannot build the network namespaces: {e}", flush=True)
        return 77

    secret_file = os.path.join(work, "cluster-secret")
    with open(secret_file, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    os.chmod(secret_file, 0o600)
    kv = [f"--kvtransfer.ucx_tls=tcp",  # sm would bypass the link: both namespaces share the host's memory
          f"--kvtransfer.transfer_timeout_ms={args.transfer_timeout_ms}", "--kvtransfer.connect_timeout_ms=2000",
          f"--kvtransfer.peer_suspect_ms={args.peer_suspect_ms}"]
    common = [f"--cluster.secret_file={secret_file}", f"--model.cache_dir={os.path.join(work, 'cache')}"]
    roles = []
    violations = []
    summary = {}
    load = None
    try:
        prefill = Role("prefill", [args.pdserve, "prefill", f"--prefill.host={net.base}.1.2", "--prefill.port=0",
                                   f"--kvtransfer.host={net.base}.3.1"] + kv + common,
                       os.path.join(work, "prefill.log"), net.ns_p)
        roles.append(prefill)
        decode = Role("decode", [args.pdserve, "decode", f"--decode.host={net.base}.2.2", "--decode.port=0",
                                 f"--kvtransfer.host={net.base}.3.2"] + kv + common,
                      os.path.join(work, "decode.log"), net.ns_d)
        roles.append(decode)
        hp = lambda url: urllib.parse.urlparse(url).netloc
        router = Role("router", [args.pdserve, "router", "--router.host=127.0.0.1", "--router.port=0",  # in R
                                 f"--router.prefill_workers={hp(prefill.url)}",
                                 f"--router.decode_workers={hp(decode.url)}",
                                 f"--router.request_timeout_ms={args.request_timeout_ms}",
                                 f"--router.kv_timeout_ms={args.transfer_timeout_ms + 2000}"] + common,
                      os.path.join(work, "router.log"))
        roles.append(router)
        print(f"link_loss: prefill {prefill.url} (netns {net.ns_p}), decode {decode.url} (netns {net.ns_d}), "
              f"router {router.url} (netns {net.ns_r}); kv link {net.base}.3.0/24; logs in {work}", flush=True)

        deadline_s = args.request_timeout_ms / 1000.0
        load = Load(router.url, args.clients, deadline_s, args.seed)
        start = time.time()
        if not wait_until(lambda: load.successes_since(start) >= 3, 120):
            raise RuntimeError("no request succeeded before the cut")
        cut_reports = []
        for cycle in range(args.cuts):
            load.set_phase(f"cut{cycle}")
            t_cut = time.time()
            net.cut()
            print(f"link_loss: cut {cycle}: kv link down", flush=True)
            time.sleep(args.cut_seconds)  # the fault's length, not an ordering: the load runs on
            load.set_phase(f"restored{cycle}")
            t_restore = time.time()
            net.restore()
            print(f"link_loss: cut {cycle}: kv link up again", flush=True)
            budget = args.peer_suspect_ms / 1000.0 + args.transfer_timeout_ms / 1000.0 + deadline_s + 30
            if not wait_until(lambda: load.first_success_after(t_restore) is not None, budget):
                violations.append(f"cut {cycle}: no request succeeded within {budget:.0f} s of restoring the link")
                cut_reports.append((cycle, None))
                continue
            first = load.first_success_after(t_restore)
            cut_reports.append((cycle, first - t_restore))
            print(f"link_loss: cut {cycle}: first success {first - t_restore:.1f} s after the restore "
                  f"(cut lasted {t_restore - t_cut:.1f} s)", flush=True)
            load.set_phase("after")
            t_after = time.time()
            wait_until(lambda: time.time() - t_after >= args.after_seconds, args.after_seconds + 1)
        load.stop()

        for r in roles:
            if not r.alive():
                violations.append(f"{r.name} died (exit {r.proc.returncode})")

        def pool_whole():
            try:
                _, text = get(decode.url, "/metrics")
            except OSError:
                return False
            free, total = metric(text, "pdserve_kv_blocks_free"), metric(text, "pdserve_kv_blocks_total")
            quarantined = metric(text, "pdserve_kv_blocks_quarantined") or 0
            pending = metric(text, "pdserve_kv_pending_receives") or 0
            summary["decode_pool"] = f"{free:.0f}/{total:.0f} free, {quarantined:.0f} quarantined, {pending:.0f} pending"
            return free is not None and free == total and quarantined == 0 and pending == 0

        def prefill_idle():
            try:
                _, text = get(prefill.url, "/metrics")
            except OSError:
                return False
            in_flight = metric(text, "pdserve_kv_in_flight")
            summary["prefill_in_flight"] = in_flight
            return in_flight == 0

        grace = args.transfer_timeout_ms / 1000.0 + 10
        if not wait_until(pool_whole, grace):
            violations.append(f"the decode pool is not whole after the load: {summary.get('decode_pool')}")
        if not wait_until(prefill_idle, grace):
            violations.append(f"the prefill worker still has {summary.get('prefill_in_flight')} transfers in flight")
        summary["cuts"] = cut_reports
    except RuntimeError as e:
        violations.append(f"setup: {e}")
    finally:
        if load is not None:
            load.stop()
        for r in reversed(roles):
            r.stop()
        net.teardown()

    records = load.records if load else []
    violations = (load.violations if load else []) + violations
    errors = {}
    error_times = []
    by_phase = {}
    for phase, kind, _, elapsed in records:
        p = by_phase.setdefault(phase.rstrip("0123456789"), {})
        p[kind] = p.get(kind, 0) + 1
        if kind != "ok":
            errors[kind] = errors.get(kind, 0) + 1
            error_times.append(elapsed)
    ok = sum(1 for _, k, _, _ in records if k == "ok")
    q = p99(error_times)
    print("link_loss: summary", flush=True)
    print(f"  requests {len(records)}, successes {ok}, errors {sum(errors.values())} {json.dumps(errors, sort_keys=True)}")
    worst = max(error_times) if error_times else None
    print(f"  p99 time to error: {'n/a' if q is None else f'{q:.2f} s'}, max {'n/a' if worst is None else f'{worst:.2f} s'}"
          f" (deadline {args.request_timeout_ms / 1000:.0f} s, KV transfer deadline {args.transfer_timeout_ms / 1000:.0f} s)")
    print(f"  by phase (the phase a request started in): {json.dumps(by_phase, sort_keys=True)}")
    for cycle, t in summary.get("cuts", []):
        print(f"  cut {cycle}: first success after restore: {'never' if t is None else f'{t:.1f} s'}")
    print(f"  decode pool at the end: {summary.get('decode_pool')}; prefill transfers in flight: "
          f"{summary.get('prefill_in_flight')}")
    print(f"  violations: {len(violations)}")
    for v in violations[:50]:
        print(f"    {v}")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
