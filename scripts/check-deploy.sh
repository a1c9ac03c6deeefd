#!/usr/bin/env bash
# Validate the deployment files: systemd units in deploy/systemd and Kubernetes manifests in
# deploy/k8s. Needs no GPU, no cluster, no running systemd and no network beyond the package
# registries (Debian, PyPI) for the first run; later runs reuse a cached virtualenv.
#
#   scripts/check-deploy.sh            # run every check, exit non-zero on any problem
#
# What it checks
#   systemd  - `systemd-analyze verify` on every unit (against stub copies of the binaries, so no
#              build is needed); any warning counts as a failure
#            - `systemd-analyze security --offline` exposure at most $SPECSPLIT_CHECK_MAX_EXPOSURE
#            - the sysusers.d entry creates the user the units run as
#            - specsplit.toml keys/values (also commented-out ones) and specsplit.env variable
#              names, against the config structs in the Rust source when present
#   k8s      - strict schema validation (kubernetes-validate, bundled offline schemas) of every
#              manifest and of the kustomize output, for Kubernetes $SPECSPLIT_CHECK_K8S_VERSIONS
#            - consistency: Service selectors and target ports, probe ports and service names,
#              ConfigMap mounts, the TOML's listen ports, GPU limits, session affinity, grace
#              period, and that deploy/container/Dockerfile installs what the pods run
#
# Tools: systemd-analyze (Debian package systemd), python3 with venv; installed with apt-get when
# missing and running as root. Environment:
#   SPECSPLIT_CHECK_CACHE         virtualenv cache dir (default ~/.cache/specsplit-check-deploy)
#   SPECSPLIT_CHECK_K8S_VERSIONS  Kubernetes versions to validate against (default "1.27.0 1.37.0")
#   SPECSPLIT_CHECK_MAX_EXPOSURE  highest allowed systemd-analyze security score (default 3.0)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
systemd_dir="$repo/deploy/systemd"
k8s_dir="$repo/deploy/k8s"
cache="${SPECSPLIT_CHECK_CACHE:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/specsplit-check-deploy}"
k8s_versions="${SPECSPLIT_CHECK_K8S_VERSIONS:-1.27.0 1.37.0}"
max_exposure="${SPECSPLIT_CHECK_MAX_EXPOSURE:-3.0}"
validator_req="kubernetes-validate==1.37.0"

passed=0
failed=0
ok() { passed=$((passed + 1)); echo "ok:   $*"; }
bad() { failed=$((failed + 1)); echo "FAIL: $*"; }
die() { echo "check-deploy: $*" >&2; exit 2; }

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# ---------------------------------------------------------------------------------------------
# Tools
# ---------------------------------------------------------------------------------------------
missing=()
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
command -v python3 >/dev/null 2>&1 || missing+=(python3)
if ! command -v python3 >/dev/null 2>&1 || ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    missing+=(python3-venv)
fi
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing: ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    else
        die "missing ${missing[*]}; install them (Debian: apt-get install ${missing[*]}) or run as root"
    fi
fi

venv="$cache/venv"
if ! "$venv/bin/python" -c 'import kubernetes_validate, yaml, sys
import importlib.metadata as m
sys.exit(m.version("kubernetes-validate") != sys.argv[1])' "${validator_req#*==}" >/dev/null 2>&1; then
    echo "setting up $venv ($validator_req)"
    rm -rf "$venv"
    mkdir -p "$cache"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "$validator_req" 'tomli; python_version < "3.11"'
fi

# ---------------------------------------------------------------------------------------------
# systemd units
# ---------------------------------------------------------------------------------------------
echo "== systemd ($systemd_dir)"
units=()
for f in "$systemd_dir"/*.service "$systemd_dir"/*.timer "$systemd_dir"/*.socket; do
    [ -e "$f" ] && units+=("${f##*/}")
done
[ "${#units[@]}" -gt 0 ] || bad "no unit files in $systemd_dir"

# The units start binaries in /usr/local/bin that a validation host has not installed: verify
# copies whose ExecStart points at stub executables instead.
mkdir -p "$tmp/bin" "$tmp/units"
for bin in $(cd "$systemd_dir" && grep -h '^Exec' -- "${units[@]}" \
        | grep -o '/usr/local/bin/[A-Za-z0-9._-]\+' | sort -u); do
    printf '#!/bin/sh\nexit 0\n' > "$tmp/bin/${bin##*/}"
    chmod 0755 "$tmp/bin/${bin##*/}"
done
for u in "${units[@]}"; do
    sed "s#/usr/local/bin/#$tmp/bin/#g" "$systemd_dir/$u" > "$tmp/units/$u"
done

for u in "${units[@]}"; do
    # verify reports unknown keys and bad values as warnings with exit status 0: any output fails.
    if out="$(cd "$tmp/units" && systemd-analyze verify --man=no --recursive-errors=no "./$u" 2>&1)" && [ -z "$out" ]; then
        ok "systemd-analyze verify $u"
    else
        bad "systemd-analyze verify $u"
        printf '%s\n' "$out" | sed "s#$tmp/units/##g; s#$tmp/bin/#/usr/local/bin/#g; s/^/      /"
    fi
    case "$u" in *.service) ;; *) continue ;; esac
    # --threshold takes the exposure in tenths (3.0 -> 30).
    if out="$(cd "$tmp/units" && systemd-analyze security --offline=true --man=no \
            --threshold="$(awk -v e="$max_exposure" 'BEGIN { printf "%d", e * 10 + 0.5 }')" \
            "./$u" 2>&1)"; then
        ok "systemd-analyze security $u: $(printf '%s\n' "$out" | grep -o 'exposure level for [^:]*: [0-9.]*' | awk '{print $NF}') <= $max_exposure"
    else
        bad "systemd-analyze security $u (exposure above $max_exposure, or error)"
        printf '%s\n' "$out" | grep -E '✗|Overall|rror' | sed 's/^/      /'
    fi
done

# The service user: the sysusers.d entry must create every User=/Group= the units use.
sysusers="$systemd_dir/specsplit.sysusers.conf"
if [ -f "$sysusers" ]; then
    mkdir -p "$tmp/root/etc"
    if out="$(systemd-sysusers --root="$tmp/root" - < "$sysusers" 2>&1)"; then
        for name in $(cd "$systemd_dir" && sed -n 's/^\(User\|Group\)=//p' -- "${units[@]}" | sort -u); do
            if grep -q "^$name:" "$tmp/root/etc/passwd" "$tmp/root/etc/group"; then
                ok "sysusers entry creates '$name'"
            else
                bad "units use '$name', which specsplit.sysusers.conf does not create"
            fi
        done
    else
        bad "systemd-sysusers rejected specsplit.sysusers.conf"
        printf '%s\n' "$out" | sed 's/^/      /'
    fi
else
    bad "missing $sysusers"
fi

# ---------------------------------------------------------------------------------------------
# Configuration files and Kubernetes manifests (Python: TOML, YAML, JSON schemas)
# ---------------------------------------------------------------------------------------------
# Render the kustomization with kustomize when a kustomize-capable tool is at hand; otherwise the
# Python side renders the subset of kustomize features the kustomization uses.
rendered=""
kustomize_cmd=()
if command -v kustomize >/dev/null 2>&1; then
    kustomize_cmd=(kustomize build)
elif command -v kubectl >/dev/null 2>&1 && kubectl kustomize --help >/dev/null 2>&1; then
    kustomize_cmd=(kubectl kustomize)
fi
if [ "${#kustomize_cmd[@]}" -gt 0 ]; then
    if "${kustomize_cmd[@]}" "$k8s_dir" > "$tmp/rendered.yaml" 2> "$tmp/kustomize.err"; then
        rendered="$tmp/rendered.yaml"
        ok "${kustomize_cmd[*]} deploy/k8s renders"
    else
        bad "${kustomize_cmd[*]} deploy/k8s"
        sed 's/^/      /' "$tmp/kustomize.err"
    fi
fi

set +e
"$venv/bin/python" - "$repo" "$k8s_versions" "$rendered" > "$tmp/py.out" <<'PY'
import glob, os, re, sys

import kubernetes_validate
import yaml

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

repo, versions, rendered_path = sys.argv[1], sys.argv[2].split(), sys.argv[3]
k8s_dir = os.path.join(repo, "deploy", "k8s")
sysd_dir = os.path.join(repo, "deploy", "systemd")


def ok(msg):
    print("ok:   " + msg)


def bad(msg):
    print("FAIL: " + msg)


def rel(path):
    return os.path.relpath(path, repo)


# ---- specsplit.toml: the keys the programs accept (flag names with "-" -> "_"); the programs
# reject unknown keys, so a typo here stops a worker at start-up. Mirrors docs/configuration.md.
WORKER_KEYS = {"listen", "model", "device", "dtype", "max_sessions", "session_ttl_secs",
               "max_context", "memory_budget_mb", "max_tree_nodes", "max_tree_depth",
               "max_prompt_len", "spare_sessions", "spin_ms", "device_timing", "log_format",
               "tls_cert", "tls_key", "tls_client_ca", "auth_token_file", "auth_token", "insecure",
               "metrics_listen", "drain_secs"}
ORCH_KEYS = {"draft_addr", "target_addr", "draft_model", "target_model", "tokenizer", "device",
             "dtype", "chat_template", "log_format", "mode", "pipeline", "max_tokens", "widths",
             "adaptive_depth", "min_depth", "max_depth", "temperature", "top_k", "top_p", "seed",
             "deadline_ms"}


def struct_fields(path, struct):
    """Field names of `struct NAME { ... }` in a Rust file (None if not found)."""
    try:
        with open(os.path.join(repo, path), encoding="utf-8") as f:
            src = f.read()
    except OSError:
        return None
    m = re.search(r"\bstruct\s+" + struct + r"\s*\{(.*?)\n\}", src, re.S)
    if not m:
        return None
    fields = set(re.findall(r"^\s*(?:pub(?:\([a-z]+\))?\s+)?([a-z_][a-z0-9_]*)\s*:",
                            m.group(1), re.M))
    return fields or None


# The source is the authority when it is there; the lists above are the fallback.
WORKER_KEYS = struct_fields("crates/specsplit-workers/src/config.rs", "WorkerConfig") or WORKER_KEYS
ORCH_KEYS = struct_fields("bins/specsplit/src/settings.rs", "Settings") or ORCH_KEYS
KEYS = {"draft": WORKER_KEYS, "target": WORKER_KEYS, "orchestrator": ORCH_KEYS}
POSITIVE = {"max_sessions", "session_ttl_secs", "max_context", "memory_budget_mb",
            "max_tree_nodes", "max_prompt_len", "max_tokens", "min_depth", "max_depth",
            "max_concurrent", "http_max_body_bytes"}
NON_NEGATIVE = {"top_k", "seed", "deadline_ms", "spare_sessions", "spin_ms", "drain_secs"}
CHOICES = {"dtype": ("", "f32", "f16", "bf16"), "log_format": ("text", "json"),
           "mode": ("spec", "ar"), "pipeline": ("sequential", "overlapped")}


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def check_value(where, key, value):
    if key in POSITIVE and not (is_int(value) and value > 0):
        return f"{where}.{key} = {value!r}: expected a positive integer"
    if key in NON_NEGATIVE and not (is_int(value) and value >= 0):
        return f"{where}.{key} = {value!r}: expected a non-negative integer"
    if key in CHOICES and value not in CHOICES[key]:
        return f"{where}.{key} = {value!r}: expected one of {CHOICES[key]}"
    if key in ("chat_template", "adaptive_depth", "device_timing", "insecure") and \
            not isinstance(value, bool):
        return f"{where}.{key} = {value!r}: expected true or false"
    if key in ("temperature", "top_p") and not (isinstance(value, (int, float))
                                                and not isinstance(value, bool) and value >= 0):
        return f"{where}.{key} = {value!r}: expected a non-negative number"
    if key == "widths" and not (isinstance(value, list) and value
                                and all(is_int(w) and w > 0 for w in value)):
        return f"{where}.widths = {value!r}: expected a list of positive integers"
    if key in ("listen", "metrics_listen", "http_listen") and not (isinstance(value, str) and re.fullmatch(
            r"(\[[0-9a-fA-F:.]+\]|[^:\s]+):\d{1,5}", value)):
        return f"{where}.{key} = {value!r}: expected HOST:PORT"
    if key in ("tls_cert", "tls_key", "tls_client_ca", "tls_ca", "auth_token_file",
               "api_key_file") and \
            not (isinstance(value, str) and value.startswith("/")):
        return f"{where}.{key} = {value!r}: expected an absolute path"
    if key == "device" and not (isinstance(value, str) and re.fullmatch(r"cpu|cuda(:\d+)?", value)):
        return f"{where}.device = {value!r}: expected cpu, cuda or cuda:N"
    if key in ("draft_addr", "target_addr") and not (isinstance(value, str) and (
            value == "" or re.fullmatch(r"https?://[^/:\s]+(:\d+)?/?", value))):
        return f"{where}.{key} = {value!r}: expected http://HOST:PORT (or empty)"
    if key in ("model", "draft_model", "target_model", "tokenizer") and not isinstance(value, str):
        return f"{where}.{key} = {value!r}: expected a string"
    if key == "model" and not value:
        return f"{where}.model is empty"
    return None


def check_toml(text, name):
    """Checks one specsplit.toml; returns the parsed table or None."""
    try:
        conf = tomllib.loads(text)
    except Exception as e:  # tomllib.TOMLDecodeError
        bad(f"{name}: not valid TOML: {e}")
        return None
    problems = []
    for section, table in conf.items():
        if section not in KEYS:
            problems.append(f"unknown section [{section}] (expected draft, target, orchestrator)")
            continue
        if not isinstance(table, dict):
            problems.append(f"{section} is not a table")
            continue
        for key, value in table.items():
            if key not in KEYS[section]:
                problems.append(f"unknown key {section}.{key}")
                continue
            p = check_value(section, key, value)
            if p:
                problems.append(p)
    # Commented-out keys ("#key = value") are meant to be uncommented: check their names too.
    section = None
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        h = re.fullmatch(r"\[([A-Za-z0-9_]+)\]\s*(#.*)?", s)
        if h:
            section = h.group(1)
            continue
        m = re.match(r"#([a-z_][a-z0-9_]*)\s*=", s)
        if m and section in KEYS and m.group(1) not in KEYS[section]:
            problems.append(f"line {n}: commented-out key {section}.{m.group(1)} is not a setting")
    if problems:
        for p in problems:
            bad(f"{name}: {p}")
    else:
        ok(f"{name}: valid specsplit configuration")
    return conf


toml_path = os.path.join(sysd_dir, "specsplit.toml")
if os.path.exists(toml_path):
    with open(toml_path, encoding="utf-8") as f:
        check_toml(f.read(), rel(toml_path))
else:
    bad(f"missing {rel(toml_path)}")

# ---- specsplit.env: KEY=VALUE lines; SPECSPLIT_<SECTION>__<KEY> must name a known key ----
env_path = os.path.join(sysd_dir, "specsplit.env")
if os.path.exists(env_path):
    problems = []
    with open(env_path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", s)
            if not m:
                problems.append(f"line {n}: not KEY=VALUE")
                continue
            var = m.group(1)
            if var.startswith("SPECSPLIT_") and "__" in var:
                section, _, key = var[len("SPECSPLIT_"):].lower().partition("__")
                if section not in KEYS or key not in KEYS[section]:
                    problems.append(f"line {n}: {var} names no known setting")
    # Commented-out examples should be right too.
    with open(env_path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            m = re.match(r"#(SPECSPLIT_([A-Z]+)__([A-Z_]+))=", line.strip())
            if m:
                section, key = m.group(2).lower(), m.group(3).lower()
                if section not in KEYS or key not in KEYS[section]:
                    problems.append(f"line {n}: example {m.group(1)} names no known setting")
    for p in problems:
        bad(f"{rel(env_path)}: {p}")
    if not problems:
        ok(f"{rel(env_path)}: valid environment file")
else:
    bad(f"missing {rel(env_path)}")


# ---- Kubernetes manifests ----
def load_docs(path, text=None):
    try:
        if text is None:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        bad(f"{path}: YAML error: {e}")
        return []


def validate(doc, label):
    """Strict schema validation against every requested Kubernetes version."""
    kind, name = doc.get("kind"), (doc.get("metadata") or {}).get("name")
    what = f"{label}: {kind}/{name}"
    if not isinstance(kind, str) or "apiVersion" not in doc:
        bad(f"{what}: missing kind or apiVersion")
        return
    for v in versions:
        try:
            kubernetes_validate.validate(doc, v, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.absolute_path) or "(top)"
            bad(f"{what} (k8s {v}): {path}: {e.message}")
            return
        except kubernetes_validate.SchemaNotFoundError:
            bad(f"{what} (k8s {v}): no schema for apiVersion {doc['apiVersion']} kind {kind}")
            return
        except Exception as e:
            bad(f"{what} (k8s {v}): {type(e).__name__}: {e}")
            return
    ok(f"{what}: schema-valid (k8s {', '.join(versions)}, strict)")


kust_path = os.path.join(k8s_dir, "kustomization.yaml")
kust = {}
if os.path.exists(kust_path):
    docs = load_docs(kust_path)
    kust = docs[0] if docs else {}
else:
    bad(f"missing {rel(kust_path)}")
resources = kust.get("resources") or []
files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(k8s_dir, "*.yaml"))
               + glob.glob(os.path.join(k8s_dir, "*.yml")))
for f in files:
    if f != "kustomization.yaml" and f not in resources:
        bad(f"deploy/k8s/{f} is not listed in kustomization.yaml resources")
missing = [r for r in resources if not os.path.exists(os.path.join(k8s_dir, r))]
for r in missing:
    bad(f"kustomization.yaml lists missing resource {r}")
if kust and not missing:
    ok(f"kustomization.yaml: {len(resources)} resources, all present")

source_docs = []
for f in resources:
    if f in missing:
        continue
    for d in load_docs(os.path.join(k8s_dir, f)):
        validate(d, f"deploy/k8s/{f}")
        source_docs.append(d)

# The rendered set: kustomize's output if the shell side produced it, else a minimal render of
# the features this kustomization uses (namespace, labels without selectors, images).
SUPPORTED = {"apiVersion", "kind", "namespace", "resources", "labels", "images"}
if rendered_path:
    with open(rendered_path, encoding="utf-8") as f:
        final = load_docs("kustomize output", f.read())
    how = "kustomize"
else:
    unsupported = set(kust) - SUPPORTED
    if unsupported:
        bad(f"kustomization.yaml uses {sorted(unsupported)}: install kustomize or kubectl so the "
            "check can render it")
    import copy
    final = copy.deepcopy(source_docs)
    for d in final:
        md = d.setdefault("metadata", {})
        if kust.get("namespace") and d.get("kind") != "Namespace":
            md["namespace"] = kust["namespace"]
        for entry in kust.get("labels") or []:
            pairs = entry.get("pairs") or {}
            md.setdefault("labels", {}).update(pairs)
            tmpl = (d.get("spec") or {}).get("template")
            if entry.get("includeTemplates") or entry.get("includeSelectors"):
                if tmpl is not None:
                    tmpl.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
            if entry.get("includeSelectors"):
                bad("minimal render does not support labels.includeSelectors: install kustomize")
        pod = ((d.get("spec") or {}).get("template") or {}).get("spec") or {}
        for c in (pod.get("containers") or []) + (pod.get("initContainers") or []):
            for img in kust.get("images") or []:
                if c.get("image", "").split(":")[0] == img.get("name"):
                    c["image"] = img.get("newName", img["name"]) + (
                        ":" + str(img["newTag"]) if "newTag" in img else "")
    how = "built-in minimal render"
for d in final:
    validate(d, f"rendered ({how})")

# ---- Consistency of the rendered objects ----
def consistency():
    DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
    by_kind = {}
    for d in final:
        by_kind.setdefault(d.get("kind"), []).append(d)
        name = (d.get("metadata") or {}).get("name", "")
        if not (DNS1123.fullmatch(name or "") and len(name) <= 63):
            bad(f"{d.get('kind')}/{name}: name is not a DNS-1123 label")
        if kust.get("namespace") and d.get("kind") != "Namespace" and \
                (d.get("metadata") or {}).get("namespace") != kust["namespace"]:
            bad(f"{d.get('kind')}/{name}: not in namespace {kust['namespace']}")

    configmaps = {(c.get("metadata") or {}).get("name"): c for c in by_kind.get("ConfigMap", [])}
    ROLE = {"specsplit-draft": ("draft", "specsplit.DraftService"),
            "specsplit-target": ("target", "specsplit.TargetService"),
            # `specsplit serve`: HTTP probes only, its port from [orchestrator] http_listen.
            "specsplit": ("orchestrator", None)}
    deployments = by_kind.get("Deployment", [])
    checked_confs = {}
    if not deployments:
        bad("no Deployment in the rendered manifests")
    for dep in deployments:
        dname = dep["metadata"]["name"]
        spec = dep.get("spec") or {}
        pod = (spec.get("template") or {}).get("spec") or {}
        tlabels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
        sel = (spec.get("selector") or {}).get("matchLabels") or {}
        problems = []
        if not sel or any(tlabels.get(k) != v for k, v in sel.items()):
            problems.append("selector.matchLabels do not match the pod template labels")
        volumes = {v.get("name"): v for v in pod.get("volumes") or []}
        for v in volumes.values():
            cm = (v.get("configMap") or {}).get("name")
            if cm and cm not in configmaps:
                problems.append(f"volume {v['name']} references missing ConfigMap {cm}")
        roles_seen = 0
        for c in pod.get("containers") or []:
            cmd = (c.get("command") or [""])[0]
            role = ROLE.get(os.path.basename(cmd))
            if not role or (role[0] == "orchestrator" and (c.get("args") or [""])[0] != "serve"):
                continue
            roles_seen += 1
            section, svc = role
            cname = c.get("name")
            ports = {p.get("containerPort") for p in c.get("ports") or []}
            for pn in (p.get("name") for p in c.get("ports") or []):
                if pn and not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", pn) or (pn and len(pn) > 15):
                    problems.append(f"{cname}: port name {pn!r} is not a valid IANA service name")
            port_names = {p.get("name") for p in c.get("ports") or [] if p.get("name")}
            for probe_kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(probe_kind)
                if not probe:
                    problems.append(f"{cname}: no {probe_kind}")
                    continue
                g, h = probe.get("grpc"), probe.get("httpGet")
                if g:
                    if g.get("port") not in ports:
                        problems.append(f"{cname}: {probe_kind} port {g.get('port')} is not a container port")
                    if g.get("service", "") not in ("", svc):
                        problems.append(f"{cname}: {probe_kind} asks for service {g.get('service')!r}, "
                                        f"the worker serves {svc!r}")
                elif h:
                    # The worker's HTTP endpoints (metrics_listen): /health and /ready.
                    if h.get("port") not in ports and h.get("port") not in port_names:
                        problems.append(f"{cname}: {probe_kind} port {h.get('port')} is not a container port")
                    if h.get("path") not in ("/health", "/ready"):
                        problems.append(f"{cname}: {probe_kind} asks for {h.get('path')!r}; the worker "
                                        f"serves /health and /ready")
                elif svc is None:
                    problems.append(f"{cname}: {probe_kind} must be an HTTP probe of /health or /ready")
                else:
                    problems.append(f"{cname}: {probe_kind} is neither a gRPC nor an HTTP probe")
            ready = c.get("readinessProbe") or {}
            if ready.get("grpc", {}).get("service") != svc and \
                    (ready.get("httpGet") or {}).get("path") != "/ready":
                problems.append(f"{cname}: readinessProbe should ask for service {svc} or GET /ready")
            # --config must point into a mounted ConfigMap that has the file; its TOML must parse
            # and listen on the container port.
            args = c.get("args") or []
            conf_path = None
            for i, a in enumerate(args):
                if a == "--config" and i + 1 < len(args):
                    conf_path = args[i + 1]
                elif a.startswith("--config="):
                    conf_path = a.split("=", 1)[1]
            if not conf_path:
                problems.append(f"{cname}: no --config argument")
            else:
                found = False
                for m in c.get("volumeMounts") or []:
                    mp = m.get("mountPath", "").rstrip("/")
                    if os.path.dirname(conf_path) == mp:
                        cmname = (volumes.get(m.get("name")) or {}).get("configMap", {}).get("name")
                        cmap = configmaps.get(cmname)
                        key = os.path.basename(conf_path)
                        if cmap and key in (cmap.get("data") or {}):
                            found = True
                            if (cmname, key) not in checked_confs:
                                checked_confs[(cmname, key)] = check_toml(
                                    cmap["data"][key], f"ConfigMap/{cmname} {key}")
                            conf = checked_confs[(cmname, key)]
                            for lk in ("listen", "metrics_listen", "http_listen"):
                                listen = ((conf or {}).get(section) or {}).get(lk)
                                if listen and int(listen.rsplit(":", 1)[1]) not in ports:
                                    problems.append(f"{cname}: [{section}] {lk} {listen} is not a "
                                                    f"container port {sorted(ports)}")
                if not found:
                    problems.append(f"{cname}: --config {conf_path} is not a key of a mounted ConfigMap")
            limits = ((c.get("resources") or {}).get("limits") or {})
            if section == "target" and "nvidia.com/gpu" not in limits:
                problems.append(f"{cname}: the target has no nvidia.com/gpu limit")
            pre = (((c.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command") or []
            pre_sleep = int(pre[1]) if len(pre) == 2 and pre[0] == "sleep" and pre[1].isdigit() else 0
            grace = pod.get("terminationGracePeriodSeconds", 30)
            if grace < 30 + pre_sleep:
                problems.append(f"terminationGracePeriodSeconds {grace} < 30 s drain + {pre_sleep} s preStop")
        if roles_seen == 0:
            problems.append("no container runs specsplit-draft, specsplit-target or specsplit serve")
        for p in problems:
            bad(f"Deployment/{dname}: {p}")
        if not problems:
            ok(f"Deployment/{dname}: selectors, probes, config mount, ports and grace period consistent")

    for svc_obj in by_kind.get("Service", []):
        sname = svc_obj["metadata"]["name"]
        spec = svc_obj.get("spec") or {}
        sel = spec.get("selector") or {}
        problems = []
        matches = [d for d in deployments
                   if sel and all((((d.get("spec") or {}).get("template") or {}).get("metadata") or {})
                                  .get("labels", {}).get(k) == v for k, v in sel.items())]
        if len(matches) != 1:
            problems.append(f"selector {sel} matches {len(matches)} Deployments (expected 1)")
        else:
            containers = matches[0]["spec"]["template"]["spec"].get("containers") or []
            cports = [p for c in containers for p in c.get("ports") or []]
            for p in spec.get("ports") or []:
                tp = p.get("targetPort", p.get("port"))
                if not any(tp in (cp.get("name"), cp.get("containerPort")) for cp in cports):
                    problems.append(f"port {p.get('name')}: targetPort {tp} is no container port")
            cmds = [os.path.basename((c.get("command") or [""])[0]) for c in containers]
            if "specsplit-target" in cmds and spec.get("sessionAffinity") != "ClientIP":
                problems.append("target Service needs sessionAffinity: ClientIP")
        for p in problems:
            bad(f"Service/{sname}: {p}")
        if not problems:
            ok(f"Service/{sname}: selects one Deployment, target ports exist")



# ---- Container image: provides what the manifests run ----
def image_check():
    dockerfile = os.path.join(repo, "deploy", "container", "Dockerfile")
    if not os.path.exists(dockerfile):
        bad(f"missing {rel(dockerfile)}")
        return
    with open(dockerfile, encoding="utf-8") as f:
        text = f.read()
    provided = set(re.findall(r"target/release/([A-Za-z0-9_.-]+)", text))
    provided |= set(re.findall(r"/usr/local/bin/([A-Za-z0-9_.-]+)\s*$", text, re.M))
    problems = []
    for src in re.findall(r"^COPY\s+(?:--chmod=\S+\s+)?(?!--from)(\S+)\s+\S+\s*$", text, re.M):
        if not os.path.exists(os.path.join(repo, src)):
            problems.append(f"COPY source {src} does not exist")
    for d in final:
        pod = ((d.get("spec") or {}).get("template") or {}).get("spec") or {}
        for c in (pod.get("containers") or []) + (pod.get("initContainers") or []):
            cmd = (c.get("command") or [""])[0]
            if cmd.startswith("/usr/local/bin/") and os.path.basename(cmd) not in provided:
                problems.append(f"{d['metadata']['name']}/{c.get('name')} runs {cmd}, which the "
                                "image does not install")
    for p in problems:
        bad(f"{rel(dockerfile)}: {p}")
    if not problems:
        ok(f"{rel(dockerfile)}: installs every command the manifests run; COPY sources exist")


try:
    image_check()
except Exception as e:
    bad(f"image checks stopped: {type(e).__name__}: {e}")

try:
    consistency()
except Exception as e:  # malformed input that the schema step already reported
    bad(f"consistency checks stopped: {type(e).__name__}: {e}")
PY
py_rc=$?
set -e
cat "$tmp/py.out"
py_ok=$(grep -c '^ok:' "$tmp/py.out" || true)
py_bad=$(grep -c '^FAIL:' "$tmp/py.out" || true)
passed=$((passed + py_ok))
failed=$((failed + py_bad))
if [ "$py_rc" -ne 0 ]; then
    bad "the manifest checks stopped with status $py_rc"
fi

echo
echo "check-deploy: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
