#!/usr/bin/env python3
"""Checks pdserve's Kubernetes manifests (deploy/) against the binary and its documented contract.

Renders each kustomization with `kubectl kustomize` and checks, for every target:
  - workload selectors match their pod templates; Services, PodDisruptionBudgets and
    NetworkPolicies select pods that exist; every Service port targets a port the selected
    containers expose;
  - each pdserve container: `pdserve <role> --check-config` accepts its args with the rendered
    ConfigMap's config.yaml (tests/deploy/pending.yaml lists what the binary cannot do yet);
    the config binds 0.0.0.0 on the port the container exposes; the files the config names
    (model folder, cache folder, API keys) are mounted, the keys from the Secret;
  - probes: startup, liveness on /health, readiness on /ready, on paths the binary serves
    (docs/internal-api.md for workers, docs/api.md for the router) and on the configured port;
  - terminationGracePeriodSeconds exceeds the role's drain_timeout_ms plus any preStop sleep;
  - the cluster secret: every pdserve container's cluster.secret_file (config, the
    PDSERVE_CLUSTER_SECRET_FILE environment variable or the flag) is a key of a mounted, rendered
    Secret, and every role of a target mounts the same Secret;
  - the router discovers workers through headless Services that select the right role on the
    right port; NetworkPolicies let only the router reach a worker's HTTP port (the internal API),
    only the KV peer pool (prefill <-> decode) reach its UCX ports (UCX_TCP_PORT_RANGE, which
    the worker must set), decode pods of a multi-pod TP group reach each other on every port,
    and nothing else reach the workers except /metrics scraping on the HTTP port;
  - GPU pods: decode.tensor_parallel = GPUs per pod x pods per group; RDMA transports in
    kvtransfer.ucx_tls iff an RDMA device is requested; /dev/shm is a memory emptyDir;
    model.device cuda iff the pod requests nvidia.com/gpu; model.gpu_memory_utilization set in
    (0, 1] on GPU pods; CUDA transports (cuda_copy, cuda_ipc) in ucx_tls only on GPU pods; a TP
    group over several pods with RDMA names its NCCL InfiniBand devices (NCCL_IB_HCA);
  - HorizontalPodAutoscalers target rendered workloads on metrics the target's binary exports
    (grep of the sources) or that the Prometheus adapter rules derive from exported ones;
  - one image for every role.

Usage: check_manifests.py --repo DIR [--pdserve BIN] [--kubectl BIN] [--target DIR ...]
                          [--expect-error TEXT]
Without --target, checks deploy/base and every deploy/overlays/*. With --expect-error, exits 0
only if the checks FAIL and an error contains TEXT (the negative cases in tests/deploy/negative).
Exit: 0 ok, 1 check failures, 2 usage or environment error, 77 skipped (no PyYAML).
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

try:
    import yaml
except ImportError:  # pragma: no cover
    print("SKIP: python3-yaml (PyYAML) is not installed", flush=True)
    sys.exit(77)

ROLES = ("router", "prefill", "decode")
WORKER_ROLES = ("prefill", "decode")
# LeaderWorkerSet injects these into every container of a group (values here are examples).
LWS_ENV = {"LWS_LEADER_ADDRESS": "pdserve-decode-tp16-0.pdserve-decode-tp16.ns",
           "LWS_GROUP_SIZE": None, "LWS_WORKER_INDEX": None, "LWS_NAME": None, "LWS_GROUP_INDEX": "0"}
CUDA_TLS = ("cuda_copy", "cuda_ipc", "gdr_copy", "cuda")
RDMA_TLS = ("rc", "rc_x", "rc_v", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5", "ud", "ud_x",
            "ud_v", "ud_verbs", "ud_mlx5", "ib")
MIN_GPU_STARTUP_S = 900     # a GPU worker may take this long to load weights
GRACE_MARGIN_MS = 5000


class Checker:
    def __init__(self, args):
        self.args = args
        self.repo = os.path.abspath(args.repo)
        self.errors = []
        self.notes = []
        self.tmp = tempfile.mkdtemp(prefix="pd-deploy-check-")
        self.pending = self._load_yaml(os.path.join(self.repo, "tests/deploy/pending.yaml"))
        self.pending_flags = {e["flag"]: e for e in self.pending.get("flags") or []}
        self.gaps = self.pending.get("capability_gaps") or []
        self.used_flags = set()
        self.flags_still_pending = set()
        self.hit_gaps = set()
        self.served = self._served_paths()
        self.exported = self._exported_metrics()
        self.adapter = self._adapter_metrics()
        self.check_config_roles = self._probe_check_config()

    # ---------------------------------------------------------------- helpers

    def error(self, where, msg):
        self.errors.append(f"{where}: {msg}")

    def note(self, msg):
        self.notes.append(msg)

    def _load_yaml(self, path):
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f) or {}

    def _served_paths(self):
        with open(os.path.join(self.repo, "docs/internal-api.md"), encoding="utf-8") as f:
            worker = set(re.findall(r"^\|\s*`GET (/[^`\s]*)`\s*\|", f.read(), re.M))
        with open(os.path.join(self.repo, "docs/api.md"), encoding="utf-8") as f:
            router = set(re.findall(r"^\|\s*GET\s*\|\s*`(/[^`\s]*)`\s*\|", f.read(), re.M))
        for name, paths in (("docs/internal-api.md", worker), ("docs/api.md", router)):
            for needed in ("/health", "/ready"):
                if needed not in paths:
                    raise SystemExit(f"error: {name} lists no `GET {needed}` (format changed?); found {sorted(paths)}")
        return {"router": router, "prefill": worker, "decode": worker}

    def _exported_metrics(self):
        """Metric name -> roles whose process exports it, from the string literals in the sources."""
        dir_roles = {"prefill": {"prefill"}, "decode": {"decode"}, "router": {"router"},
                     "kvtransfer": {"prefill", "decode"}, "common": set(ROLES), "tools": set(ROLES)}
        out = {}
        for top, roles in dir_roles.items():
            for root, _, files in os.walk(os.path.join(self.repo, top)):
                for fn in files:
                    if not fn.endswith((".cpp", ".h", ".cc", ".cu")):
                        continue
                    with open(os.path.join(root, fn), encoding="utf-8", errors="replace") as f:
                        for name in re.findall(r'"(pdserve_[a-z0-9_]+)"', f.read()):
                            out.setdefault(name, set()).update(roles)
        if not out:
            raise SystemExit("error: no pdserve_* metric names found in the sources")
        return out

    def _adapter_metrics(self):
        """Custom-metric name -> roles, from the Prometheus adapter rules (every series exported)."""
        path = os.path.join(self.repo, "deploy/monitoring/prometheus-adapter-values.yaml")
        where = os.path.relpath(path, self.repo)
        out = {}
        for i, rule in enumerate(((self._load_yaml(path).get("rules") or {}).get("custom")) or []):
            refs = set(re.findall(r"pdserve_[a-z0-9_]+", rule.get("seriesQuery", "") + " " +
                                  rule.get("metricsQuery", "")))
            series = re.findall(r"pdserve_[a-z0-9_]+", rule.get("seriesQuery", ""))
            if not series:
                self.error(where, f"rule {i}: seriesQuery names no pdserve_* series")
                continue
            roles = set(ROLES)
            for r in refs:
                if r not in self.exported:
                    self.error(where, f"rule {i}: series '{r}' is not exported by any pdserve binary")
                else:
                    roles &= self.exported[r]
            name = rule.get("name") or {}
            exposed = re.sub(name.get("matches", "^(.*)$"), name.get("as", "${1}").replace("${", "\\g<").replace("}", ">"),
                             series[0]) if name else series[0]
            out[exposed] = roles
        return out

    def _probe_check_config(self):
        roles = set()
        if not self.args.pdserve:
            self.note("SKIP check-config: no pdserve binary given (--pdserve or PD_PDSERVE_BIN)")
            return roles
        for role in ROLES:
            p = subprocess.run([self.args.pdserve, role, "--help"], capture_output=True, text=True, timeout=60)
            text = p.stdout + p.stderr
            if p.returncode == 0 and "--check-config" in text:
                roles.add(role)
            else:
                first = (text.strip().splitlines() or ["(no output)"])[0]
                self.note(f"SKIP check-config of {role} containers: `pdserve {role}` does not support "
                          f"--check-config yet ({first}); the config is still validated by the other roles, "
                          f"which check every section")
        return roles

    # ------------------------------------------------------------ rendering

    def render(self, target):
        p = subprocess.run([self.args.kubectl, "kustomize", target], capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            self.error(target, f"kubectl kustomize failed: {p.stderr.strip()}")
            return None
        return [d for d in yaml.safe_load_all(p.stdout) if d]

    # ------------------------------------------------------------ selectors

    @staticmethod
    def matches(selector, labels):
        """A Service selector (plain map) or a LabelSelector; None/{} match nothing here."""
        if not selector:
            return False
        if "matchLabels" not in selector and "matchExpressions" not in selector:
            return all(labels.get(k) == str(v) for k, v in selector.items())
        for k, v in (selector.get("matchLabels") or {}).items():
            if labels.get(k) != str(v):
                return False
        for e in selector.get("matchExpressions") or []:
            key, op, vals = e["key"], e["operator"], [str(v) for v in e.get("values") or []]
            if op == "In" and labels.get(key) not in vals:
                return False
            if op == "NotIn" and key in labels and labels[key] in vals:
                return False
            if op == "Exists" and key not in labels:
                return False
            if op == "DoesNotExist" and key in labels:
                return False
        return True

    @staticmethod
    def templates(objs):
        """Pod templates: dicts with workload, tpl, labels (incl. controller-added), group_size."""
        out = []
        for o in objs:
            kind, name = o["kind"], o["metadata"]["name"]
            spec = o.get("spec") or {}
            if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
                tpl = spec.get("template") or {}
                out.append({"workload": o, "where": f"{kind}/{name}", "tpl": tpl, "group_size": 1,
                            "labels": dict((tpl.get("metadata") or {}).get("labels") or {}), "lws_index": None})
            elif kind == "LeaderWorkerSet":
                lwt = spec.get("leaderWorkerTemplate") or {}
                size = int(lwt.get("size", 1))
                leader = lwt.get("leaderTemplate") or lwt.get("workerTemplate") or {}
                worker = lwt.get("workerTemplate") or {}
                for part, tpl, index in (("leaderTemplate", leader, "0"), ("workerTemplate", worker, "1")):
                    if part == "workerTemplate" and size < 2:
                        continue
                    labels = dict((tpl.get("metadata") or {}).get("labels") or {})
                    labels.update({"leaderworkerset.sigs.k8s.io/name": name,
                                   "leaderworkerset.sigs.k8s.io/worker-index": index})
                    out.append({"workload": o, "where": f"{kind}/{name}.{part}", "tpl": tpl, "group_size": size,
                                "labels": labels, "lws_index": index})
        return out

    # ------------------------------------------------------------- options

    @staticmethod
    def parse_flags(args):
        """--a.b=v / --a.b v / --a v -> list of (name, value)."""
        out, i = [], 0
        while i < len(args):
            a = args[i]
            if a.startswith("--"):
                if "=" in a:
                    k, v = a[2:].split("=", 1)
                elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                    k, v = a[2:], args[i + 1]
                    i += 1
                else:
                    k, v = a[2:], "true"
                out.append((k.replace("-", "_"), v))
            i += 1
        return out

    @staticmethod
    def option(cfg, flags, env, section, name):
        """Effective value: config file < PDSERVE_<SECTION>_<NAME> < flag; None when unset."""
        value = (cfg.get(section) or {}).get(name)
        env_value = env.get(f"PDSERVE_{section.upper()}_{name.upper()}")
        if env_value is not None:
            value = env_value
        for k, v in flags:
            if k in (f"{section}.{name}", name):
                value = v
        return value

    # ---------------------------------------------------------------- checks

    def check_target(self, target):
        where = os.path.relpath(target, self.repo) if target.startswith(self.repo) else target
        objs = self.render(target)
        if objs is None:
            return
        by_kind = {}
        for o in objs:
            by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
        tpls = self.templates(objs)
        if not tpls:
            self.error(where, "renders no workload")
            return

        for t in tpls:
            wl = t["workload"]
            sel = (wl.get("spec") or {}).get("selector")
            if wl["kind"] != "LeaderWorkerSet" and not self.matches(sel, t["labels"]):
                self.error(where, f"{t['where']}: spec.selector {sel} does not match its template labels {t['labels']}")

        containers = []   # (template, container, role)
        images = set()
        for t in tpls:
            for c in (t["tpl"].get("spec") or {}).get("containers") or []:
                args = list(c.get("command") or [])[1:] + list(c.get("args") or []) if c.get("command") else list(c.get("args") or [])
                role = args[0] if args and args[0] in ROLES else None
                if role:
                    containers.append((t, c, role, args))
                    images.add(c.get("image"))
        if not containers:
            self.error(where, "no pdserve container (args starting with router|prefill|decode)")
            return
        if len(images) != 1:
            self.error(where, f"pdserve containers use different images {sorted(map(str, images))}: one image serves every role")
        for img in images:
            if img and ":" not in img.rsplit("/", 1)[-1] and "@" not in img:
                self.error(where, f"image '{img}' has no tag (did the image transformer miss a workload?)")
        roles_present = {r for _, _, r, _ in containers}
        for r in ROLES:
            if r not in roles_present:
                self.error(where, f"no {r} container")

        self.check_services(where, by_kind, tpls)
        self.check_pdbs(where, by_kind, tpls)
        configs = {}
        self.cluster_secrets = {}   # container -> the Secret holding its cluster.secret_file
        for t, c, role, args in containers:
            cfg = self.check_container(where, by_kind, t, c, role, args)
            if cfg is not None:
                configs[(t["where"], c["name"])] = (t, c, role, args, cfg)
        if len(set(self.cluster_secrets.values())) > 1:
            self.error(where, f"the pdserve containers mount different cluster secrets "
                              f"{sorted(set(self.cluster_secrets.values()))}: router and workers must share one")
        self.check_discovery(where, by_kind, tpls, configs)
        self.check_network_policies(where, by_kind, tpls, containers)
        self.check_hpas(where, by_kind, tpls, containers)
        self.check_podmonitor(where, tpls)
        self.check_ingresses(where, by_kind)

    def container_ports(self, tpl):
        ports = {}
        for c in (tpl.get("spec") or {}).get("containers") or []:
            for p in c.get("ports") or []:
                ports[p["containerPort"]] = p
                if p.get("name"):
                    ports[p["name"]] = p
        return ports

    def check_services(self, where, by_kind, tpls):
        for name, svc in (by_kind.get("Service") or {}).items():
            sel = (svc.get("spec") or {}).get("selector")
            matched = [t for t in tpls if self.matches(sel, t["labels"])]
            if not matched:
                self.error(where, f"Service/{name}: selector {sel} selects no pod template")
                continue
            for p in svc["spec"].get("ports") or []:
                target = p.get("targetPort", p.get("port"))
                for t in matched:
                    if target not in self.container_ports(t["tpl"]):
                        self.error(where, f"Service/{name}: port {p.get('name', p.get('port'))} targetPort {target!r} "
                                          f"is not a container port of {t['where']}")

    def check_pdbs(self, where, by_kind, tpls):
        for name, pdb in (by_kind.get("PodDisruptionBudget") or {}).items():
            spec = pdb.get("spec") or {}
            if not any(self.matches(spec.get("selector"), t["labels"]) for t in tpls):
                self.error(where, f"PodDisruptionBudget/{name}: selector selects no pod template")
            if "maxUnavailable" not in spec and "minAvailable" not in spec:
                self.error(where, f"PodDisruptionBudget/{name}: sets neither maxUnavailable nor minAvailable")
        for role in ROLES:
            role_tpls = [t for t in tpls if t["labels"].get("app.kubernetes.io/component") == role]
            for t in role_tpls:
                if not any(self.matches((p.get("spec") or {}).get("selector"), t["labels"])
                           for p in (by_kind.get("PodDisruptionBudget") or {}).values()):
                    self.error(where, f"{t['where']}: no PodDisruptionBudget covers it")

    def mount_for(self, c, path):
        """The volumeMount holding `path` (longest mountPath prefix) and the key within it."""
        best = None
        for m in c.get("volumeMounts") or []:
            mp = m["mountPath"].rstrip("/")
            if path == mp or path.startswith(mp + "/"):
                if best is None or len(mp) > len(best["mountPath"].rstrip("/")):
                    best = m
        if best is None:
            return None, None
        mp = best["mountPath"].rstrip("/")
        if best.get("subPath"):
            return best, best["subPath"] if path == mp else None
        return best, path[len(mp) + 1:] if path != mp else ""

    def volume(self, tpl, name):
        for v in (tpl.get("spec") or {}).get("volumes") or []:
            if v["name"] == name:
                return v
        return None

    def check_container(self, where, by_kind, t, c, role, args):
        tpl, spec = t["tpl"], t["tpl"].get("spec") or {}
        cw = f"{t['where']}/{c['name']}"
        env = {}
        for e in c.get("env") or []:
            env[e["name"]] = e.get("value") if "value" in e else None
        # $(VAR) expansion as the kubelet does it.
        known = dict(env)
        if t["lws_index"] is not None:
            lws = dict(LWS_ENV)
            lws.update({"LWS_GROUP_SIZE": str(t["group_size"]), "LWS_WORKER_INDEX": t["lws_index"],
                        "LWS_NAME": t["workload"]["metadata"]["name"]})
            known.update(lws)
        expanded = []
        for a in args:
            def sub(m):
                if m.group(1) not in known or known[m.group(1)] is None:
                    self.error(where, f"{cw}: args use $({m.group(1)}), which the container's environment does not define")
                    return "UNDEFINED"
                return known[m.group(1)]
            expanded.append(re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a))
        flags = self.parse_flags(expanded[1:])

        # The config file: a mounted ConfigMap key.
        config_paths = [v for k, v in flags if k == "config"]
        if len(config_paths) != 1:
            self.error(where, f"{cw}: needs exactly one --config (found {len(config_paths)})")
            return None
        config_path = config_paths[0]
        mount, key = self.mount_for(c, config_path)
        vol = self.volume(tpl, mount["name"]) if mount else None
        if not vol or "configMap" not in vol or not key:
            self.error(where, f"{cw}: --config {config_path} is not a key of a mounted ConfigMap")
            return None
        cm = (by_kind.get("ConfigMap") or {}).get(vol["configMap"]["name"])
        if cm is None or key not in (cm.get("data") or {}):
            self.error(where, f"{cw}: ConfigMap '{vol['configMap']['name']}' (key {key}) is not in the rendered "
                              f"output (a name kustomize did not rewrite?)")
            return None
        text = cm["data"][key]
        try:
            cfg = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            self.error(where, f"{cw}: config.yaml does not parse: {e}")
            return None

        self.run_check_config(where, cw, role, expanded, config_path, text, env)

        # Host and port: reachable by the kubelet's probes and by the other pods.
        host = self.option(cfg, flags, env, role, "host")
        port = self.option(cfg, flags, env, role, "port")
        if str(host) not in ("0.0.0.0", "::", "[::]"):
            self.error(where, f"{cw}: {role}.host is {host!r}: probes and peers need 0.0.0.0")
        try:
            port = int(port)
        except (TypeError, ValueError):
            self.error(where, f"{cw}: {role}.port must be set to a fixed port (is {port!r})")
            port = None
        http_port = next((p for p in c.get("ports") or [] if p.get("name") == "http"), None)
        if http_port is None:
            self.error(where, f"{cw}: no container port named 'http'")
        elif port is not None and http_port["containerPort"] != port:
            self.error(where, f"{cw}: container port http is {http_port['containerPort']} but {role}.port is {port}")
        if port == 0:
            self.error(where, f"{cw}: {role}.port 0 (a random port) cannot be probed or discovered")

        # Probes.
        gpus = self.resource(c, "nvidia.com/gpu")
        for kind, want in (("startupProbe", None), ("livenessProbe", "/health"), ("readinessProbe", "/ready")):
            probe = c.get(kind)
            if not probe or "httpGet" not in probe:
                self.error(where, f"{cw}: needs an httpGet {kind}")
                continue
            path = probe["httpGet"].get("path", "/")
            if path not in self.served[role]:
                self.error(where, f"{cw}: {kind} probe path {path} is not served by pdserve {role} "
                                  f"(served: {sorted(self.served[role])})")
            elif want and path != want:
                self.error(where, f"{cw}: {kind} probe path {path} should be {want}")
            pport = probe["httpGet"].get("port")
            resolved = next((p["containerPort"] for p in c.get("ports") or []
                             if pport in (p.get("name"), p["containerPort"])), None)
            if resolved is None:
                self.error(where, f"{cw}: {kind} port {pport!r} is not a port of the container")
            elif port is not None and resolved != port:
                self.error(where, f"{cw}: {kind} probes port {resolved} but {role}.port is {port}")
            if kind == "startupProbe":
                budget = probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
                if gpus and budget < MIN_GPU_STARTUP_S:
                    self.error(where, f"{cw}: startupProbe allows {budget} s; a GPU worker needs >= {MIN_GPU_STARTUP_S} s to load")

        # Drain versus grace period.
        drain = self.option(cfg, flags, env, role, "drain_timeout_ms")
        if drain is None:
            self.error(where, f"{cw}: set {role}.drain_timeout_ms explicitly in the ConfigMap")
        else:
            grace = spec.get("terminationGracePeriodSeconds", 30)
            pre = (((c.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}).get("seconds", 0)
            need = int(drain) + pre * 1000 + GRACE_MARGIN_MS
            if grace * 1000 < need:
                self.error(where, f"{cw}: terminationGracePeriodSeconds {grace} must be >= {role}.drain_timeout_ms "
                                  f"{drain} + preStop {pre} s + {GRACE_MARGIN_MS} ms margin ({need / 1000:g} s)")

        # Files the config names must be mounted.
        model = cfg.get("model") or {}
        files = [("model.path", self.option(cfg, flags, env, "model", "path"), False),
                 ("model.cache_dir", self.option(cfg, flags, env, "model", "cache_dir"), True)]
        if model.get("tokenizer"):
            files.append(("model.tokenizer", model["tokenizer"], False))
        if role == "router":
            files.append(("router.api_keys_file", self.option(cfg, flags, env, "router", "api_keys_file"), False))
        for opt, path, writable in files:
            if not path:
                if opt in ("model.path", "model.cache_dir"):
                    self.error(where, f"{cw}: set {opt} (the container's defaults point into the image)")
                continue
            m, k = self.mount_for(c, str(path))
            if m is None:
                self.error(where, f"{cw}: {opt} {path} is on no volume")
                continue
            if writable and m.get("readOnly"):
                self.error(where, f"{cw}: {opt} {path} must be writable but its mount is readOnly")
            v = self.volume(tpl, m["name"])
            if v is None:
                self.error(where, f"{cw}: volumeMount {m['name']} has no volume")
                continue
            if opt == "router.api_keys_file":
                sec_name = (v.get("secret") or {}).get("secretName")
                sec = (by_kind.get("Secret") or {}).get(sec_name)
                if sec is None:
                    self.error(where, f"{cw}: router.api_keys_file {path}: volume {m['name']} is not a rendered Secret")
                elif k not in {**(sec.get("data") or {}), **(sec.get("stringData") or {})}:
                    self.error(where, f"{cw}: Secret {sec_name} has no key '{k}' for router.api_keys_file")
        self.check_cluster_secret(where, by_kind, tpl, cw, cfg, flags, env)
        for v in spec.get("volumes") or []:
            if "configMap" in v and v["configMap"]["name"] not in (by_kind.get("ConfigMap") or {}):
                self.error(where, f"{t['where']}: volume {v['name']} names ConfigMap {v['configMap']['name']}, not rendered")
            if "secret" in v and v["secret"]["secretName"] not in (by_kind.get("Secret") or {}):
                self.error(where, f"{t['where']}: volume {v['name']} names Secret {v['secret']['secretName']}, not rendered")

        # Workers: shared memory, GPUs, TP, RDMA.
        if role in WORKER_ROLES:
            m, _ = self.mount_for(c, "/dev/shm")
            v = self.volume(tpl, m["name"]) if m and m["mountPath"].rstrip("/") == "/dev/shm" else None
            if not v or (v.get("emptyDir") or {}).get("medium") != "Memory":
                self.error(where, f"{cw}: /dev/shm must be an emptyDir with medium Memory")
            req = (c.get("resources") or {}).get("requests") or {}
            lim = (c.get("resources") or {}).get("limits") or {}
            for res in set(req) | set(lim):
                if (res == "nvidia.com/gpu" or res.startswith("rdma/")) and str(req.get(res)) != str(lim.get(res)):
                    self.error(where, f"{cw}: {res} requests {req.get(res)} != limits {lim.get(res)}")
            tls = str(self.option(cfg, flags, env, "kvtransfer", "ucx_tls") or "tcp,sm")
            rdma_tls = [x for x in tls.split(",") if x.strip() in RDMA_TLS]
            rdma_res = [r for r in lim if r.startswith("rdma/")]
            if rdma_tls and not rdma_res:
                self.error(where, f"{cw}: kvtransfer.ucx_tls '{tls}' uses RDMA but the container requests no rdma/* device")
            if rdma_res and not rdma_tls:
                self.error(where, f"{cw}: requests {rdma_res} but kvtransfer.ucx_tls '{tls}' has no RDMA transport")
            # The GPU engine: GPU pods run model.device cuda with a memory budget; CPU pods do not.
            device = str(self.option(cfg, flags, env, "model", "device") or "cpu")
            on_cuda = device == "cuda" or device.startswith("cuda:")
            if gpus and not on_cuda:
                self.error(where, f"{cw}: requests {gpus} nvidia.com/gpu but model.device is '{device}': a GPU pod "
                                  f"runs the GPU engine (model.device cuda)")
            if on_cuda and not gpus:
                self.error(where, f"{cw}: model.device '{device}' but the container requests no nvidia.com/gpu")
            if on_cuda:
                util = self.option(cfg, flags, env, "model", "gpu_memory_utilization")
                try:
                    ok = util is not None and 0.0 < float(util) <= 1.0
                except (TypeError, ValueError):
                    ok = False
                if util is None:
                    self.error(where, f"{cw}: set model.gpu_memory_utilization explicitly on a GPU pod "
                                      f"(the fraction of each GPU the worker may use)")
                elif not ok:
                    self.error(where, f"{cw}: model.gpu_memory_utilization {util} must be in (0, 1]")
            cuda_tls = [x for x in tls.split(",") if x.strip() in CUDA_TLS]
            if cuda_tls and not gpus:
                self.error(where, f"{cw}: kvtransfer.ucx_tls '{tls}' lists CUDA transports {cuda_tls} but the "
                                  f"container requests no nvidia.com/gpu")
            if on_cuda and rdma_res and t["group_size"] > 1 and role == "decode" and not env.get("NCCL_IB_HCA"):
                self.error(where, f"{cw}: a tensor-parallel group over {t['group_size']} pods with RDMA needs "
                                  f"NCCL_IB_HCA (the InfiniBand devices NCCL may use)")
            if rdma_res and "IPC_LOCK" not in (((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []):
                self.error(where, f"{cw}: RDMA memory registration needs capability IPC_LOCK")
            if role == "decode":
                tp = int(self.option(cfg, flags, env, "decode", "tensor_parallel") or 1)
                ranks = (gpus or 1) * t["group_size"]
                if gpus and tp != ranks:
                    self.error(where, f"{cw}: decode.tensor_parallel {tp} != {gpus} GPUs x {t['group_size']} pod(s) per group")
                if not gpus and tp != 1:
                    self.error(where, f"{cw}: decode.tensor_parallel {tp} without GPUs")
                nnodes = int(self.option(cfg, flags, env, "decode", "nnodes") or 1)
                if nnodes != t["group_size"]:
                    self.error(where, f"{cw}: decode.nnodes {nnodes} != {t['group_size']} pod(s) per group")
                if t["group_size"] > 1:
                    addr = str(self.option(cfg, flags, env, "decode", "dist_init_address") or "")
                    port = addr.rsplit(":", 1)[-1] if ":" in addr else ""
                    ports = [str(p.get("containerPort")) for p in c.get("ports") or []]
                    if not port or port not in ports:
                        self.error(where, f"{cw}: decode.dist_init_address '{addr}' does not name a port the "
                                          f"container declares ({', '.join(ports)})")
            if role == "prefill":
                ptp = int(self.option(cfg, flags, env, "prefill", "tensor_parallel") or 1)
                if ptp != (gpus or 1):
                    self.error(where, f"{cw}: prefill.tensor_parallel {ptp} != {gpus or 0} GPUs of the pod")
            if t["workload"]["kind"] == "LeaderWorkerSet":
                policy = ((t["workload"]["spec"].get("leaderWorkerTemplate") or {}).get("restartPolicy"))
                if policy != "RecreateGroupOnPodRestart":
                    self.error(where, f"{t['where']}: a TP group must restart as a whole (restartPolicy "
                                      f"RecreateGroupOnPodRestart, not {policy})")
        return cfg

    def check_cluster_secret(self, where, by_kind, tpl, cw, cfg, flags, env):
        path = self.option(cfg, flags, env, "cluster", "secret_file")
        c = next(x for x in (tpl.get("spec") or {}).get("containers") or [] if cw.endswith("/" + x["name"]))
        if not path:
            self.error(where, f"{cw}: no cluster secret: set cluster.secret_file (or PDSERVE_CLUSTER_SECRET_FILE) to "
                              f"a key of a mounted Secret (docs/security.md)")
            return
        m, k = self.mount_for(c, str(path))
        v = self.volume(tpl, m["name"]) if m else None
        sec_name = ((v or {}).get("secret") or {}).get("secretName")
        sec = (by_kind.get("Secret") or {}).get(sec_name) if sec_name else None
        if m is None or v is None or sec_name is None:
            self.error(where, f"{cw}: cluster.secret_file {path} is not on a mounted Secret volume")
        elif sec is None:
            self.error(where, f"{cw}: cluster.secret_file {path}: Secret {sec_name} is not rendered")
        elif k not in {**(sec.get("data") or {}), **(sec.get("stringData") or {})}:
            self.error(where, f"{cw}: Secret {sec_name} has no key '{k}' for cluster.secret_file")
        else:
            self.cluster_secrets[cw] = sec_name

    @staticmethod
    def resource(c, name):
        v = ((c.get("resources") or {}).get("limits") or {}).get(name)
        return int(v) if v is not None else 0

    def run_check_config(self, where, cw, role, expanded, config_path, text, env):
        if role not in self.check_config_roles:
            return
        cfg_file = os.path.join(self.tmp, "config.yaml")
        with open(cfg_file, "w", encoding="utf-8") as f:
            f.write(text)
        args, i = [], 1
        while i < len(expanded):   # point --config at the rendered file
            a = expanded[i]
            if a == "--config":
                args += ["--config", cfg_file]
                i += 2
                continue
            if a.startswith("--config="):
                a = "--config=" + cfg_file
            args.append(a)
            i += 1
        pending = [a for a in args if a.split("=", 1)[0] in self.pending_flags]
        for a in pending:
            if "=" not in a:
                self.error(where, f"{cw}: pending flag {a} must be written --name=value")
        base = [a for a in args if a not in pending]
        run_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": self.tmp}
        run_env.update({k: v for k, v in env.items() if k.startswith("PDSERVE_") and v is not None})

        def run(extra):
            p = subprocess.run([self.args.pdserve, role, "--check-config"] + base + extra, env=run_env,
                               capture_output=True, text=True, timeout=60)
            return p.returncode, (p.stdout + p.stderr).strip()

        rc, out = run([])
        relax = []
        if rc != 0:
            gap = next((g for g in self.gaps if g["pattern"] in out), None)
            if gap is None:
                self.error(where, f"{cw}: `pdserve {role} --check-config` exit {rc}: {out}")
                return
            self.hit_gaps.add(gap["pattern"])
            relax = list(gap.get("relax") or [])
            self.note(f"GAP {where} {cw}: '{gap['pattern']}' (issue {gap.get('issue')}); checked again with {relax}")
            rc, out = run(relax)
            if rc != 0:
                self.error(where, f"{cw}: `pdserve {role} --check-config {' '.join(relax)}` exit {rc}: {out}")
                return
        for a in pending:
            name = a.split("=", 1)[0]
            self.used_flags.add(name)
            rc, out = run(relax + [a])
            if rc == 0:
                self.error(where, f"{cw}: pdserve now accepts {a}: remove {name} from tests/deploy/pending.yaml")
            elif "unknown flag" not in out:
                self.error(where, f"{cw}: pending flag {a} fails for another reason than being unknown: {out}")
            else:
                self.flags_still_pending.add(name)
                self.note(f"PENDING {where} {cw}: {a} (issue {self.pending_flags[name].get('issue')})")

    def check_discovery(self, where, by_kind, tpls, configs):
        services = by_kind.get("Service") or {}
        for (_, _), (t, c, role, args, cfg) in configs.items():
            if role != "router":
                continue
            cw = f"{t['where']}/{c['name']}"
            flags = self.parse_flags(args[1:])
            for wrole in WORKER_ROLES:
                svc_opt = self.option(cfg, flags, {}, "router", f"{wrole}_service")
                static = self.option(cfg, flags, {}, "router", f"{wrole}_workers")
                if not svc_opt:
                    if not static:
                        self.error(where, f"{cw}: router.{wrole}_service (or {wrole}_workers) is not set")
                    continue
                m = re.fullmatch(r"([a-z0-9.-]+):(\d+)", str(svc_opt))
                if not m:
                    self.error(where, f"{cw}: router.{wrole}_service '{svc_opt}' is not name:port")
                    continue
                name, port = m.group(1).split(".")[0], int(m.group(2))
                svc = services.get(name)
                if svc is None:
                    self.error(where, f"{cw}: router.{wrole}_service names Service '{name}', which is not rendered")
                    continue
                spec = svc.get("spec") or {}
                if spec.get("clusterIP") != "None":
                    self.error(where, f"Service/{name}: router.{wrole}_service needs a headless Service (clusterIP: None) "
                                      f"so that its name resolves to every worker")
                if spec.get("publishNotReadyAddresses"):
                    self.error(where, f"Service/{name}: publishNotReadyAddresses would hand the router loading and draining workers")
                matched = [x for x in tpls if self.matches(spec.get("selector"), x["labels"])]
                for x in matched:
                    roles = {a[0] for a in [list(cc.get("args") or []) for cc in (x["tpl"].get("spec") or {}).get("containers") or []] if a}
                    if wrole not in roles:
                        self.error(where, f"Service/{name} (router.{wrole}_service) selects {x['where']}, which is not a {wrole} pod")
                    if x["lws_index"] not in (None, "0"):
                        self.error(where, f"Service/{name} (router.{wrole}_service) selects {x['where']}: only group leaders serve the API")
                    wcfg = next((v for v in configs.values() if v[0] is x and v[2] == wrole), None)
                    if wcfg is not None:
                        wport = self.option(wcfg[4], self.parse_flags(wcfg[3][1:]), {}, wrole, "port")
                        if wport is not None and int(wport) != port:
                            self.error(where, f"{cw}: router.{wrole}_service port {port} but {x['where']} listens on {wport} "
                                              f"(a headless name resolves to pod IPs: the port must be the container's)")

    def check_network_policies(self, where, by_kind, tpls, containers):
        policies = by_kind.get("NetworkPolicy") or {}
        role_of = {}
        for t, _, role, _ in containers:
            role_of[id(t)] = role
        for name, np in policies.items():
            if not any(self.matches(np["spec"].get("podSelector"), t["labels"]) for t in tpls):
                self.error(where, f"NetworkPolicy/{name}: podSelector selects no pod template")
        for t in tpls:
            role = role_of.get(id(t))
            if role not in WORKER_ROLES:
                continue
            covering = [np for np in policies.values()
                        if self.matches(np["spec"].get("podSelector"), t["labels"])
                        and "Ingress" in (np["spec"].get("policyTypes") or ["Ingress"])]
            if not covering:
                self.error(where, f"{t['where']}: no NetworkPolicy restricts ingress to this worker")
                continue
            reach = {}   # role -> the `ports` lists of rules admitting it (None: every port)
            for np in covering:
                for rule in np["spec"].get("ingress") or []:
                    peers = rule.get("from") or []
                    if not peers:
                        self.error(where, f"NetworkPolicy/{np['metadata']['name']}: an ingress rule without 'from' opens "
                                          f"{t['where']} to everyone")
                        continue
                    for peer in peers:
                        if "namespaceSelector" in peer or "ipBlock" in peer:
                            ports = rule.get("ports") or []
                            if not ports or any(p.get("port") not in ("http", self.http_port(t)) for p in ports):
                                self.error(where, f"NetworkPolicy/{np['metadata']['name']}: a rule from outside pdserve "
                                                  f"must be limited to the HTTP port (/metrics), not {ports or 'all ports'}")
                            continue
                        sel = peer.get("podSelector")
                        allowed = [x for x in tpls if self.matches(sel, x["labels"])] if sel else []
                        if sel is not None and not sel:
                            self.error(where, f"NetworkPolicy/{np['metadata']['name']}: an empty podSelector admits every pod "
                                              f"of the namespace")
                        for x in allowed:
                            if id(x) not in role_of:
                                self.error(where, f"NetworkPolicy/{np['metadata']['name']}: admits {x['where']}, not a pdserve pod")
                            else:
                                reach.setdefault(role_of[id(x)], []).append(rule.get("ports") or None)
            self.check_worker_reach(where, t, role, reach, containers)

    @staticmethod
    def port_covers(spec, lo, hi, name=None):
        """Whether one NetworkPolicy `ports` entry opens every port of [lo, hi] (or the named port)."""
        port = spec.get("port")
        if port is None:
            return True
        if name is not None and port == name:
            return True
        if isinstance(port, int):
            return port <= lo and spec.get("endPort", port) >= hi
        return False

    def check_worker_reach(self, where, t, role, reach, containers):
        roles = {r for _, _, r, _ in containers}
        http = self.http_port(t)
        c = next((c for x, c, _, _ in containers if x is t), {})
        env = {e["name"]: e.get("value") for e in c.get("env") or []}
        rng = re.fullmatch(r"(\d+)-(\d+)", str(env.get("UCX_TCP_PORT_RANGE") or ""))
        peer = "decode" if role == "prefill" else "prefill"
        tp_group = role == "decode" and t["group_size"] > 1

        def covers(role_, lo, hi, name=None):
            return any(ps is None or any(self.port_covers(p, lo, hi, name) for p in ps) for ps in reach.get(role_, []))

        # The internal API: the router, and only the router (and a TP group's own decode pods).
        if "router" in roles and (http is None or not covers("router", http, http, "http")):
            self.error(where, f"{t['where']}: the NetworkPolicy does not let router pods reach its HTTP port "
                              f"(the internal API)")
        for other in sorted(reach):
            if other == "router" or (other == "decode" and tp_group):
                continue
            if http is not None and covers(other, http, http, "http"):
                self.error(where, f"{t['where']}: the NetworkPolicy lets {other} pods reach its internal API (HTTP "
                                  f"port): only the router may")
        for ps in reach.get("router", []):
            if ps is None or any(p.get("port") not in ("http", http) for p in ps):
                self.error(where, f"{t['where']}: the NetworkPolicy lets router pods reach {ps or 'every port'}: only "
                                  f"the HTTP port")
        # The KV data plane: UCX listens in UCX_TCP_PORT_RANGE, open to the other pool.
        if not rng:
            self.error(where, f"{t['where']}: set UCX_TCP_PORT_RANGE (lo-hi) on the {role} container so that UCX "
                              f"listens on ports the NetworkPolicy can open to the KV peers only")
        elif peer in roles and not covers(peer, int(rng.group(1)), int(rng.group(2))):
            self.error(where, f"{t['where']}: the NetworkPolicy does not let {peer} pods reach its KV ports "
                              f"{rng.group(1)}-{rng.group(2)} (UCX_TCP_PORT_RANGE)")
        if tp_group and not covers("decode", 1, 65535):
            self.error(where, f"{t['where']}: a multi-pod TP group needs decode pods to reach each other on every "
                              f"port (TP rendezvous, NCCL)")

    def http_port(self, t):
        for c in (t["tpl"].get("spec") or {}).get("containers") or []:
            for p in c.get("ports") or []:
                if p.get("name") == "http":
                    return p["containerPort"]
        return None

    def check_hpas(self, where, by_kind, tpls, containers):
        for name, hpa in (by_kind.get("HorizontalPodAutoscaler") or {}).items():
            ref = hpa["spec"]["scaleTargetRef"]
            target = (by_kind.get(ref["kind"]) or {}).get(ref["name"])
            if target is None:
                self.error(where, f"HorizontalPodAutoscaler/{name}: scaleTargetRef {ref['kind']}/{ref['name']} is not rendered")
                continue
            roles = {r for t, _, r, _ in containers if t["workload"] is target}
            if "replicas" in (target.get("spec") or {}):
                self.error(where, f"{ref['kind']}/{ref['name']} sets spec.replicas but HorizontalPodAutoscaler/{name} "
                                  f"owns it: every apply would reset the scale")
            if not hpa["spec"].get("metrics"):
                self.error(where, f"HorizontalPodAutoscaler/{name}: no metrics")
            for m in hpa["spec"].get("metrics") or []:
                if m["type"] == "Resource":
                    continue
                metric = ((m.get(m["type"][0].lower() + m["type"][1:]) or {}).get("metric") or {}).get("name")
                source = self.exported.get(metric)
                how = "exported"
                if source is None:
                    source, how = self.adapter.get(metric), "derived by deploy/monitoring/prometheus-adapter-values.yaml"
                if source is None:
                    self.error(where, f"HorizontalPodAutoscaler/{name}: metric '{metric}' is not exported by pdserve "
                                      f"nor defined by the adapter rules")
                elif not roles & source:
                    self.error(where, f"HorizontalPodAutoscaler/{name}: metric '{metric}' ({how}) comes from "
                                      f"{sorted(source)} pods but the target runs {sorted(roles)}")

    def check_ingresses(self, where, by_kind):
        services = by_kind.get("Service") or {}
        for name, ing in (by_kind.get("Ingress") or {}).items():
            for rule in ing["spec"].get("rules") or []:
                for p in (rule.get("http") or {}).get("paths") or []:
                    svc_ref = (p.get("backend") or {}).get("service") or {}
                    svc = services.get(svc_ref.get("name"))
                    if svc is None:
                        self.error(where, f"Ingress/{name}: backend Service '{svc_ref.get('name')}' is not rendered")
                        continue
                    port = svc_ref.get("port") or {}
                    want = port.get("name", port.get("number"))
                    if not any(want in (sp.get("name"), sp.get("port")) for sp in svc["spec"].get("ports") or []):
                        self.error(where, f"Ingress/{name}: Service {svc_ref['name']} has no port {want!r}")

    def check_podmonitor(self, where, tpls):
        path = os.path.join(self.repo, "deploy/monitoring/podmonitor.yaml")
        pm = self._load_yaml(path)
        matched = [t for t in tpls if self.matches(pm["spec"]["selector"], t["labels"])]
        if not matched:
            self.error(where, "deploy/monitoring/podmonitor.yaml selects no pod")
        for t in matched:
            ports = self.container_ports(t["tpl"])
            for ep in pm["spec"].get("podMetricsEndpoints") or []:
                if ep.get("port") not in ports:
                    self.error(where, f"deploy/monitoring/podmonitor.yaml: port {ep.get('port')} is not a port of {t['where']}")
                if ep.get("path", "/metrics") != "/metrics":
                    self.error(where, "deploy/monitoring/podmonitor.yaml: pdserve serves /metrics")

    def finish(self):
        if self.check_config_roles and not self.args.expect_error:
            for flag in self.pending_flags:
                if flag not in self.used_flags:
                    self.error("tests/deploy/pending.yaml", f"{flag} is used by no manifest: remove it")
            for g in self.gaps:
                if g["pattern"] not in self.hit_gaps:
                    self.error("tests/deploy/pending.yaml", f"capability gap '{g['pattern']}' no longer occurs: remove it")
        shutil.rmtree(self.tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", required=True)
    ap.add_argument("--kubectl", default=shutil.which("kubectl"))
    ap.add_argument("--pdserve", default=os.environ.get("PD_PDSERVE_BIN"))
    ap.add_argument("--target", action="append", default=[])
    ap.add_argument("--expect-error")
    args = ap.parse_args()
    if not args.kubectl:
        print("error: kubectl not found", file=sys.stderr)
        return 2
    if args.pdserve and not os.access(args.pdserve, os.X_OK):
        print(f"error: pdserve binary {args.pdserve} is not executable", file=sys.stderr)
        return 2
    repo = os.path.abspath(args.repo)
    targets = [os.path.abspath(t) for t in args.target]
    if not targets:
        targets = [os.path.join(repo, "deploy/base")]
        overlays = os.path.join(repo, "deploy/overlays")
        targets += sorted(os.path.join(overlays, d) for d in os.listdir(overlays)
                          if os.path.isfile(os.path.join(overlays, d, "kustomization.yaml")))
    checker = Checker(args)
    for t in targets:
        checker.check_target(t)
    checker.finish()
    for n in checker.notes:
        print(n)
    for e in checker.errors:
        print(f"ERROR {e}")
    if args.expect_error:
        hit = [e for e in checker.errors if args.expect_error in e]
        if hit:
            print(f"OK: the checker caught it ({len(checker.errors)} error(s), expected text found)")
            return 0
        print(f"FAIL: expected an error containing '{args.expect_error}'")
        return 1
    print(f"{'FAIL' if checker.errors else 'OK'}: {len(targets)} target(s), {len(checker.errors)} error(s)")
    return 1 if checker.errors else 0


if __name__ == "__main__":
    sys.exit(main())
