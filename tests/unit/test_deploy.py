"""The deployment files, checked offline: the Kubernetes manifests against the API's
schemas, and every file for what breaks a deployment without an error at apply time: a
router that cannot find its workers, probes that kill a draining worker, a grace period
shorter than the drain, a policy that names the wrong ports, a router image with torch."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from baton.services.rpc.server import LIVENESS

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
WORKERS = ("prefill", "decode")
SECRET_VARIABLES = ("BATON_API_KEY", "BATON_CLUSTER_TOKEN")  # only ever from secrets
COMPONENT = "app.kubernetes.io/component"


# -- Kubernetes -----------------------------------------------------------------------

def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _docs() -> list[dict]:
    return [d for p in _manifest_files() for d in yaml.safe_load_all(p.read_text()) if d]


def _kind(kind: str) -> list[dict]:
    return [d for d in _docs() if d["kind"] == kind]


def _deployment(component: str) -> dict:
    (dep,) = [d for d in _kind("Deployment")
              if d["spec"]["template"]["metadata"]["labels"].get(COMPONENT) == component]
    return dep


def _main(dep: dict) -> dict:
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _port(container: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def _selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels, matchExpressions) selects these labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value, op = labels.get(e["key"]), e["operator"]
        if (op == "In" and value not in e["values"]) or (op == "NotIn" and value in e["values"]) \
                or (op == "Exists" and value is None) or (op == "DoesNotExist" and value):
            return False
    return True


def _pod_labels(dep: dict) -> dict:
    return dep["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: p.name)
def test_manifests_are_valid_for_the_kubernetes_api(path):
    version = kubernetes_validate.latest_version()
    for doc in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any fault


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert "namespace" not in kustomization  # namespace-agnostic
    assert sorted(kustomization["resources"]) == [p.name for p in _manifest_files()]
    for doc in _docs():
        assert "namespace" not in doc["metadata"]


def test_ports_are_named_and_probes_ask_grpc_health():
    for dep in _kind("Deployment"):
        pod = dep["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            assert all(p.get("name") for p in c.get("ports", [])), c["name"]
        c = _main(dep)
        grpc = _port(c, "grpc")
        assert int(_env(c)["BATON_ADDRESS"].rsplit(":", 1)[1]) == grpc
        probes = {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
        assert all(p["grpc"]["port"] == grpc for p in probes.values()), c["name"]
        # ready: the overall status, which a draining server or a router with no worker
        # turns NOT_SERVING; alive: a name that stays SERVING through both
        assert probes["readinessProbe"]["grpc"].get("service", "") == ""
        startup = probes["startupProbe"]
        assert probes["livenessProbe"]["grpc"]["service"] == startup["grpc"]["service"] == LIVENESS
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # model load


def test_workers_have_headless_services_and_the_router_resolves_them():
    router = _main(_deployment("router"))
    names = [e["name"] for e in router["env"]]
    ns = router["env"][names.index("POD_NAMESPACE")]
    assert ns["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    for role in WORKERS:
        dep = _deployment(role)
        (svc,) = [s for s in _kind("Service") if _selects(
            {"matchLabels": s["spec"]["selector"]}, _pod_labels(dep))]
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["publishNotReadyAddresses"] is False
        grpc = _port(_main(dep), "grpc")
        (port,) = [p for p in svc["spec"]["ports"] if p["name"] == "grpc"]
        assert port["appProtocol"] == "grpc" and port["port"] == grpc
        var = f"BATON_{role.upper()}"
        name = svc["metadata"]["name"]
        assert _env(router)[var] == f"dns:///{name}.$(POD_NAMESPACE).svc.cluster.local:{grpc}"
        assert names.index("POD_NAMESPACE") < names.index(var)  # $(...) needs it first
    (svc,) = [s for s in _kind("Service") if s["metadata"]["name"] == "baton-router"]
    protocols = {p["name"]: (p["appProtocol"], p["targetPort"]) for p in svc["spec"]["ports"]}
    assert protocols == {"grpc": ("grpc", "grpc"), "http": ("http", "http")}
    assert {p["name"] for p in router["ports"]} == {"grpc", "http"}


def test_termination_grace_outlasts_the_prestop_sleep_and_the_drain():
    for dep in _kind("Deployment"):
        pod = dep["spec"]["template"]["spec"]
        c = _main(dep)
        command = c["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"
        drain = float(_env(c)["BATON_DRAIN_GRACE"])
        assert pod["terminationGracePeriodSeconds"] > drain + float(command[1]), c["name"]


def test_every_deployment_has_a_disruption_budget_that_selects_it():
    deps, pdbs = _kind("Deployment"), _kind("PodDisruptionBudget")
    for dep in deps:
        mine = [p for p in pdbs if _selects(p["spec"]["selector"], _pod_labels(dep))]
        assert len(mine) == 1, dep["metadata"]["name"]
        assert mine[0]["spec"]["selector"] == dep["spec"]["selector"]
    for pdb in pdbs:
        assert any(_selects(pdb["spec"]["selector"], _pod_labels(d)) for d in deps)


def test_workers_run_non_root_with_a_gpu_and_the_model_volume():
    claims = {c["metadata"]["name"] for c in _kind("PersistentVolumeClaim")}
    for dep in _kind("Deployment") + _kind("Job"):
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        volumes = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
                   if "persistentVolumeClaim" in v}
        assert set(volumes.values()) <= claims
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            model = _env(c).get("BATON_MODEL")
            if model:  # read from the model volume
                assert any(model.startswith(m["mountPath"] + "/") and m["name"] in volumes
                           for m in c["volumeMounts"]), c["name"]
    for role in WORKERS:
        c = _main(_deployment(role))
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert _env(c)["BATON_ROLE"] == role


def test_network_policy_admits_only_routers_and_workers_to_worker_ports():
    (policy,) = _kind("NetworkPolicy")
    spec = policy["spec"]
    selected = {d["metadata"]["name"] for d in _kind("Deployment")
                if _selects(spec["podSelector"], _pod_labels(d))}
    assert selected == {_deployment(r)["metadata"]["name"] for r in WORKERS}
    assert spec["policyTypes"] == ["Ingress"]
    router, workers = _deployment("router"), [_deployment(r) for r in WORKERS]
    nixl = {tuple(map(int, _env(_main(w))["UCX_TCP_PORT_RANGE"].split("-"))) for w in workers}
    assert len(nixl) == 1
    allowed: dict[str, set] = {"router": set(), "worker": set(), "other": set()}
    for rule in spec["ingress"]:
        for peer in rule["from"]:
            sel = peer.get("podSelector")
            if "namespaceSelector" not in peer and sel is not None and _selects(
                    sel, _pod_labels(router)):
                assert not any(_selects(sel, _pod_labels(w)) for w in workers)
                who = "router"
            elif "namespaceSelector" not in peer and sel is not None and all(
                    _selects(sel, _pod_labels(w)) for w in workers):
                who = "worker"
            else:
                assert not _selects(sel or {}, _pod_labels(router)), peer
                who = "other"
            for p in rule["ports"]:
                port = p["port"]
                if isinstance(port, str):  # a named port: every worker must have it
                    for w in workers:
                        _port(_main(w), port)
                allowed[who].add((port, p.get("endPort")))
    assert allowed["router"] == {("grpc", None)}
    assert allowed["worker"] == {("grpc", None), *nixl}
    assert allowed["other"] == {("metrics", None)}
    for w in workers:
        c = _main(w)
        annotations = w["spec"]["template"]["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == _port(c, "metrics")
        assert int(_env(c)["BATON_METRICS_PORT"]) == _port(c, "metrics")


def _secret_file(deployment: dict, variable: str) -> str:
    """The Secret whose mounted file `variable` names; checks it is not world-readable."""
    pod, c = deployment["spec"]["template"]["spec"], _main(deployment)
    path = _env(c)[variable]
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] and not volume["secret"].get("optional")
    mode = volume["secret"].get("defaultMode", 0o644)
    assert mode & 0o007 == 0  # not world-readable; the pod's fsGroup reads it
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]
    return volume["secret"]["secretName"]


def test_every_service_shares_one_cluster_token_from_a_secret():
    names = {_secret_file(_deployment(role), "BATON_CLUSTER_TOKEN_FILE")
             for role in ("router", "prefill", "decode")}
    assert len(names) == 1
    for role in WORKERS:  # reached over the network (said, as a worker's default is
        env = _env(_main(_deployment(role)))  # loopback), and never open: the token
        assert env["BATON_ADDRESS"].startswith("0.0.0.0:")
        assert "BATON_INSECURE_NO_CLUSTER_AUTH" not in env


def test_the_routers_api_keys_come_from_a_secret_and_no_key_is_written_here():
    _secret_file(_deployment("router"), "BATON_API_KEY_FILE")
    for dep in _kind("Deployment"):
        for container in dep["spec"]["template"]["spec"]["containers"]:
            for e in container.get("env", []):
                if e["name"] in SECRET_VARIABLES:  # from a Secret, never a literal
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], e
