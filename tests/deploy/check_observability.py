#!/usr/bin/env python3
"""Checks pdserve's dashboards and alerts (deploy/observability/) against the real binary.

  - every Grafana panel query and every alert expression parses as PromQL: with `promtool check
    rules` when promtool is installed (scripts/install-deps.sh installs Debian's prometheus
    package for it), and always with the small PromQL parser below, which also finds the metric
    names an expression reads;
  - every metric name read exists in pdserve's /metrics output, collected from running
    processes: `pdserve up` (router, prefill and decode children) with tracing on, after one chat
    completion, so that series created on first use are there too; histogram series
    (_bucket, _sum, _count) count for their family. A few series come from elsewhere and are
    allowed by name (EXTERNAL below);
  - dashboards: unique panel ids, a Prometheus datasource and at least one query per panel;
    alerts: a name, an expression, a severity label and a summary; the kustomization renders.

Usage: check_observability.py --repo DIR (--pdserve BIN | --metrics-file FILE)
                              [--dir DIR] [--save-metrics FILE] [--promtool BIN] [--kubectl BIN]
                              [--expect-error TEXT]
--metrics-file reads exposition text saved earlier by --save-metrics instead of starting pdserve.
With --expect-error, exits 0 only if the checks FAIL with an error containing TEXT.
Exit: 0 ok, 1 check failures, 2 usage or environment error, 77 skipped (no PyYAML).
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request

try:
    import yaml
except ImportError:  # pragma: no cover
    print("SKIP: python3-yaml (PyYAML) is not installed", flush=True)
    sys.exit(77)

# Series a dashboard or alert may read that pdserve does not export: Prometheus' own scrape
# health and kube-state-metrics' container restarts.
EXTERNAL = {"up", "kube_pod_container_status_restarts_total"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# ------------------------------------------------------------------------------------- PromQL

AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                "bottomk", "topk", "quantile"}
AGG_WITH_PARAM = {"count_values", "bottomk", "topk", "quantile"}
FUNCTIONS = {
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "day_of_month", "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp", "floor",
    "histogram_quantile", "holt_winters", "hour", "idelta", "increase", "irate", "label_join",
    "label_replace", "ln", "log2", "log10", "minute", "month", "predict_linear", "rate", "resets",
    "round", "scalar", "sgn", "sort", "sort_desc", "sqrt", "time", "timestamp", "vector", "year",
    "avg_over_time", "min_over_time", "max_over_time", "sum_over_time", "count_over_time",
    "quantile_over_time", "stddev_over_time", "stdvar_over_time", "last_over_time",
    "present_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "sin",
    "sinh", "tan", "tanh", "deg", "rad", "pi",
}
# Precedence, lowest first (Prometheus: or < and unless < comparisons < + - < * / % atan2 < ^).
BINARY_LEVELS = [{"or"}, {"and", "unless"}, {"==", "!=", ">", "<", ">=", "<="}, {"+", "-"},
                 {"*", "/", "%", "atan2"}]
COMPARISONS = {"==", "!=", ">", "<", ">=", "<="}
TOKEN_RE = re.compile(r"""
    (?P<ws>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<duration>(?:\d+(?:ms|s|m|h|d|w|y))+)(?![A-Za-z0-9_])
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|0[xX][0-9a-fA-F]+|[Ii]nf|NaN)(?![A-Za-z0-9_:])
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)
  | (?P<ident>(?:[A-Za-z_]|:(?=[A-Za-z_:]))[A-Za-z0-9_:]*)
  | (?P<op>=~|!~|==|!=|>=|<=|[-+*/%^<>=(){}\[\],:@])
""", re.X)


class PromQLError(Exception):
    pass


def tokenize(text):
    out, pos = [], 0
    while pos < len(text):
        m = TOKEN_RE.match(text, pos)
        if not m:
            raise PromQLError(f"unexpected character {text[pos]!r} at {pos}")
        pos = m.end()
        kind = m.lastgroup
        if kind in ("ws", "comment"):
            continue
        out.append((kind, m.group(kind)))
    out.append(("eof", ""))
    return out


class PromQLParser:
    """A recursive-descent parser of the PromQL expression grammar; collects metric names."""

    def __init__(self, text):
        self.toks = tokenize(text)
        self.i = 0
        self.metrics = set()

    def peek(self, k=0):
        return self.toks[self.i + k]

    def take(self):
        t = self.toks[self.i]
        self.i += 1
        return t

    def expect(self, value):
        t = self.take()
        if t[1] != value:
            raise PromQLError(f"expected {value!r}, found {t[1] or 'the end'!r}")
        return t

    def parse(self):
        self.expr(0)
        if self.peek()[0] != "eof":
            raise PromQLError(f"unexpected {self.peek()[1]!r} after the expression")
        return self.metrics

    def expr(self, level):
        if level == len(BINARY_LEVELS):
            return self.power()
        self.expr(level + 1)
        while self.peek()[1] in BINARY_LEVELS[level] and self.peek()[0] in ("op", "ident"):
            op = self.take()[1]
            if op in COMPARISONS and self.peek()[1] == "bool":
                self.take()
            self.matching()
            self.expr(level + 1)

    def power(self):
        self.unary()
        if self.peek()[1] == "^":
            self.take()
            self.matching()
            self.power()  # right-associative

    def matching(self):
        if self.peek()[1] in ("on", "ignoring"):
            self.take()
            self.label_list()
            if self.peek()[1] in ("group_left", "group_right"):
                self.take()
                if self.peek()[1] == "(":
                    self.label_list()

    def unary(self):
        if self.peek()[1] in ("+", "-"):
            self.take()
            return self.unary()
        self.postfix()

    def postfix(self):
        self.primary()
        while True:
            if self.peek()[1] == "[":
                self.take()
                self.duration()
                if self.peek()[1] == ":":
                    self.take()
                    if self.peek()[1] != "]":
                        self.duration()
                self.expect("]")
            elif self.peek()[1] == "offset":
                self.take()
                if self.peek()[1] == "-":
                    self.take()
                self.duration()
            elif self.peek()[1] == "@":
                self.take()
                t = self.take()
                if t[0] != "number" and t[1] not in ("start", "end"):
                    raise PromQLError(f"bad @ modifier {t[1]!r}")
                if t[1] in ("start", "end"):
                    self.expect("(")
                    self.expect(")")
            else:
                return

    def duration(self):
        t = self.take()
        if t[0] != "duration":
            raise PromQLError(f"expected a duration, found {t[1] or 'the end'!r}")

    def label_list(self):
        self.expect("(")
        while self.peek()[1] != ")":
            if self.take()[0] != "ident":
                raise PromQLError("expected a label name")
            if self.peek()[1] == ",":
                self.take()
            elif self.peek()[1] != ")":
                raise PromQLError(f"expected ',' or ')' in a label list, found {self.peek()[1]!r}")
        self.expect(")")

    def matchers(self, name=None):
        self.expect("{")
        names = [name] if name else []
        while self.peek()[1] != "}":
            label = self.take()
            if label[0] != "ident":
                raise PromQLError(f"expected a label name, found {label[1]!r}")
            op = self.take()[1]
            if op not in ("=", "!=", "=~", "!~"):
                raise PromQLError(f"bad label matcher operator {op!r}")
            value = self.take()
            if value[0] != "string":
                raise PromQLError(f"label {label[1]} needs a quoted value")
            if label[1] == "__name__" and op == "=":
                names.append(value[1][1:-1])
            if self.peek()[1] == ",":
                self.take()
            elif self.peek()[1] != "}":
                raise PromQLError(f"expected ',' or '}}' in matchers, found {self.peek()[1]!r}")
        self.expect("}")
        if not names:
            raise PromQLError("a selector needs a metric name")
        self.metrics.update(names)

    def primary(self):
        kind, value = self.peek()
        if kind in ("number", "string"):
            self.take()
            return
        if value == "(":
            self.take()
            self.expr(0)
            self.expect(")")
            return
        if value == "{":
            self.matchers()
            return
        if kind != "ident":
            raise PromQLError(f"unexpected {value or 'end of expression'!r}")
        self.take()
        if value in AGGREGATIONS and self.peek()[1] in ("(", "by", "without"):
            grouped = False
            if self.peek()[1] in ("by", "without"):
                self.take()
                self.label_list()
                grouped = True
            self.expect("(")
            if value in AGG_WITH_PARAM:
                self.expr(0)
                self.expect(",")
            self.expr(0)
            self.expect(")")
            if not grouped and self.peek()[1] in ("by", "without"):
                self.take()
                self.label_list()
            return
        if self.peek()[1] == "(":
            if value not in FUNCTIONS:
                raise PromQLError(f"unknown function {value}()")
            self.take()
            while self.peek()[1] != ")":
                self.expr(0)
                if self.peek()[1] == ",":
                    self.take()
                elif self.peek()[1] != ")":
                    raise PromQLError(f"expected ',' or ')' in {value}(), found {self.peek()[1]!r}")
            self.expect(")")
            return
        if value in ("by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
                     "and", "or", "unless", "atan2"):
            raise PromQLError(f"unexpected keyword {value!r}")
        self.metrics.add(value)
        if self.peek()[1] == "{":
            self.matchers(value)


def promql_metrics(expr):
    """The metric names `expr` reads; PromQLError when it does not parse."""
    return PromQLParser(expr).parse()


# ----------------------------------------------------------------------------- /metrics text

def exposition_names(text):
    """Metric names in Prometheus text exposition: sample names plus # TYPE families."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4:
                names.add(parts[2])
                if parts[3] == "histogram":
                    names.update(parts[2] + s for s in HISTOGRAM_SUFFIXES)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, 1)[0])
    return names


def collect_from_up(pdserve, log):
    """Starts `pdserve up` with tracing on, sends one chat completion and returns every process's
    /metrics text joined."""
    tmp = tempfile.mkdtemp(prefix="pd-observability-")
    argv = [pdserve, "up", "--router.port=0", "--log.level=warn", "--model.cache_dir=" + tmp,
            "--trace.file=" + os.path.join(tmp, "spans.jsonl")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=sys.stderr, text=True)
    urls, router = [], None
    lines = []
    # up prints PDSERVE_CHILD lines for its workers, then PDSERVE_READY for the router.
    timer = threading.Timer(600, proc.kill)
    timer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            m = re.match(r"PDSERVE_CHILD name=(\S+) pid=\d+ url=(\S+)", line)
            if m:
                urls.append(m.group(2))
            m = re.match(r"PDSERVE_READY role=up url=(\S+)", line)
            if m:
                router = m.group(1)
                break
        timer.cancel()
        if router is None:
            raise SystemExit("error: pdserve up did not become ready:\n" + "".join(lines[-20:]))
        body = json.dumps({"model": "pdserve-default", "max_tokens": 4, "temperature": 0,
                           "messages": [{"role": "user", "content": "Hello"}]}).encode()
        req = urllib.request.Request(router + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            log(f"chat completion: HTTP {r.status}")
        texts = []
        for url in [router] + urls:
            with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
                texts.append(r.read().decode())
        log(f"collected /metrics of {1 + len(urls)} processes")
        return "\n".join(texts)
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------ checker

class Checker:
    def __init__(self, args):
        self.args = args
        self.dir = os.path.abspath(args.dir or os.path.join(args.repo, "deploy/observability"))
        self.errors = []
        self.exprs = []  # (where, expr, kind) kind: "panel" or "alert"

    def error(self, where, msg):
        self.errors.append(f"{where}: {msg}")

    def load(self):
        dash_dir = os.path.join(self.dir, "dashboards")
        for fn in sorted(os.listdir(dash_dir)):
            if fn.endswith(".json"):
                self.load_dashboard(os.path.join(dash_dir, fn))
        self.load_rules(os.path.join(self.dir, "prometheusrule.yaml"))

    def load_dashboard(self, path):
        name = os.path.relpath(path, self.dir)
        try:
            with open(path, encoding="utf-8") as f:
                dash = json.load(f)
        except ValueError as e:
            return self.error(name, f"not JSON: {e}")
        for key in ("uid", "title", "panels"):
            if key not in dash:
                self.error(name, f"no {key}")
        panels = []
        for p in dash.get("panels", []):
            panels.append(p)
            panels.extend(p.get("panels", []))  # collapsed rows
        ids = [p.get("id") for p in panels]
        if len(ids) != len(set(ids)):
            self.error(name, "panel ids are not unique")
        for p in panels:
            if p.get("type") == "row":
                continue
            where = f"{name}: panel {p.get('title')!r}"
            if (p.get("datasource") or {}).get("type") != "prometheus":
                self.error(where, "datasource is not Prometheus")
            targets = p.get("targets") or []
            if not targets:
                self.error(where, "no query")
            for t in targets:
                if not t.get("expr"):
                    self.error(where, f"target {t.get('refId')} has no expr")
                else:
                    self.exprs.append((where, t["expr"], "panel"))

    def load_rules(self, path):
        name = os.path.relpath(path, self.dir)
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
        if doc.get("kind") != "PrometheusRule":
            return self.error(name, "not a PrometheusRule")
        self.rule_groups = doc.get("spec", {}).get("groups") or []
        for g in self.rule_groups:
            for r in g.get("rules") or []:
                where = f"{name}: {r.get('alert') or r.get('record')}"
                if not r.get("expr"):
                    self.error(where, "no expr")
                    continue
                if r.get("alert"):
                    if not (r.get("labels") or {}).get("severity"):
                        self.error(where, "no severity label")
                    if not (r.get("annotations") or {}).get("summary"):
                        self.error(where, "no summary annotation")
                self.exprs.append((where, str(r["expr"]), "alert"))

    def check_syntax_and_names(self, exported):
        for where, expr, _ in self.exprs:
            try:
                names = promql_metrics(expr)
            except PromQLError as e:
                self.error(where, f"PromQL does not parse ({e}): {expr.strip()}")
                continue
            for n in sorted(names):
                if n not in exported and n not in EXTERNAL:
                    self.error(where, f"metric {n} is not in pdserve's /metrics output")

    def check_promtool(self):
        promtool = self.args.promtool
        if not promtool:
            print("note: promtool not found; PromQL checked by this script's parser only", flush=True)
            return
        # promtool checks rule files: the alerts as they are, each panel query as a recording rule.
        groups = list(self.rule_groups)
        panel_rules = [{"record": f"pdserve:panel_query_{i}", "expr": e}
                       for i, (_, e, kind) in enumerate(self.exprs) if kind == "panel"]
        groups.append({"name": "dashboard-queries", "rules": panel_rules})
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump({"groups": groups}, f)
            path = f.name
        try:
            r = subprocess.run([promtool, "check", "rules", path], capture_output=True, text=True)
        finally:
            os.unlink(path)
        if r.returncode != 0:
            self.error("promtool", (r.stdout + r.stderr).strip())
        else:
            print(f"promtool: {len(self.exprs)} expressions parse", flush=True)

    def check_kustomize(self):
        if not self.args.kubectl or not os.path.exists(os.path.join(self.dir, "kustomization.yaml")):
            return
        r = subprocess.run([self.args.kubectl, "kustomize", self.dir], capture_output=True, text=True)
        if r.returncode != 0:
            return self.error("kustomization", r.stderr.strip())
        kinds = sorted(d.get("kind") for d in yaml.safe_load_all(r.stdout) if d)
        for needed in ("ConfigMap", "PodMonitor", "PrometheusRule"):
            if needed not in kinds:
                self.error("kustomization", f"renders no {needed} (found {kinds})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", required=True)
    ap.add_argument("--dir")
    ap.add_argument("--pdserve", default=os.environ.get("PD_PDSERVE_BIN"))
    ap.add_argument("--metrics-file")
    ap.add_argument("--save-metrics")
    ap.add_argument("--promtool", default=shutil.which("promtool"))
    ap.add_argument("--kubectl", default=shutil.which("kubectl"))
    ap.add_argument("--expect-error")
    args = ap.parse_args()

    if args.metrics_file:
        with open(args.metrics_file, encoding="utf-8") as f:
            text = f.read()
    elif args.pdserve:
        text = collect_from_up(args.pdserve, lambda m: print(m, flush=True))
    else:
        print("error: give --pdserve or --metrics-file", file=sys.stderr)
        return 2
    if args.save_metrics:
        with open(args.save_metrics, "w", encoding="utf-8") as f:
            f.write(text)
    exported = exposition_names(text)
    if not any(n.startswith("pdserve_router_") for n in exported):
        print("error: the /metrics text holds no router series", file=sys.stderr)
        return 2

    c = Checker(args)
    c.load()
    c.check_syntax_and_names(exported)
    c.check_promtool()
    c.check_kustomize()
    names = sum(len(promql_metrics_safe(e)) for _, e, _ in c.exprs)
    print(f"checked {len(c.exprs)} expressions ({names} metric references) against {len(exported)} exported names",
          flush=True)
    if args.expect_error is not None:
        hit = [e for e in c.errors if args.expect_error in e]
        for e in c.errors:
            print(f"  (expected failure) {e}")
        if hit:
            print("OK: the checks failed as expected")
            return 0
        print(f"FAIL: expected an error containing {args.expect_error!r}")
        return 1
    for e in c.errors:
        print(f"ERROR {e}")
    return 1 if c.errors else 0


def promql_metrics_safe(expr):
    try:
        return promql_metrics(expr)
    except PromQLError:
        return set()


if __name__ == "__main__":
    sys.exit(main())
