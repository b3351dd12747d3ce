"""The deployment files, checked offline: the Kubernetes manifests against the API's
schemas, and every file for what breaks a deployment without an error at apply time: a
router that cannot find its workers, probes that kill a draining worker, a grace period
shorter than the drain, a policy that names the wrong ports, a router image with torch."""

from __future__ import annotations

import re
import shlex
from fnmatch import fnmatch
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.serving.default_model import GGUF_NAME
from services.serving.server import LIVENESS
from services.serving.tokenizer import tokenizer_dir

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
WORKERS = ("prefill", "decode")
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
        volumes = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
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


# -- docker compose -------------------------------------------------------------------

def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _mount(volume) -> tuple[str, str]:
    """(source, target) of a compose volume, in its short or its long form."""
    if isinstance(volume, dict):
        return volume["source"], volume["target"]
    source, target = volume.split(":")[:2]
    return source, target


def _seconds(text: str) -> float:
    return float(re.fullmatch(r"(\d+)s", str(text)).group(1))


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_compose_profile_runs_a_router_that_finds_its_workers_by_dns(profile):
    compose = _compose()
    services = {n: s for n, s in compose["services"].items()
                if profile in s.get("profiles", [profile])}
    routers = {n: s for n, s in services.items() if s["environment"]["BATON_ROLE"] == "router"}
    assert len(routers) == 1
    ((router_name, router),) = routers.items()
    workers = {n: s for n, s in services.items() if n != router_name}
    assert sorted(s["environment"]["BATON_ROLE"] for s in workers.values()) == ["decode",
                                                                                 "prefill"]
    for name, svc in workers.items():
        env = svc["environment"]
        role, port = env["BATON_ROLE"], env["BATON_ADDRESS"].rsplit(":", 1)[1]
        aliases = svc.get("networks", {}).get("default", {}).get("aliases", [])
        assert role == name or role in aliases  # the name the router looks up
        assert router["environment"][f"BATON_{role.upper()}"] == f"dns:///{role}:{port}"
        assert "container_name" not in svc and "ports" not in svc  # or --scale breaks
        assert router["depends_on"][name] == {"condition": "service_healthy"}
        assert env["BATON_MODEL"] == router["environment"]["BATON_MODEL"]
    for svc in services.values():
        env = svc["environment"]
        check = svc["healthcheck"]
        assert check["test"][:3] == ["CMD", "baton", "health"]
        assert _seconds(check["start_period"]) > 0
        assert _seconds(svc["stop_grace_period"]) > float(env["BATON_DRAIN_GRACE"])
        assert str(svc["user"]).split(":")[0] not in ("0", "root")
        mounts = [_mount(v) for v in svc["volumes"]]
        (target,) = [t for source, t in mounts if source in compose["volumes"]]
        assert env["BATON_MODEL"].startswith(target + "/")
    # The router image holds only the tokenizer: it must not be what fills the volume.
    (volume,) = router["volumes"]
    assert volume["volume"]["nocopy"] is True


def test_compose_gpu_workers_use_their_own_gpu_and_move_gpu_memory():
    gpu = [s for s in _compose()["services"].values()
           if "gpu" in s.get("profiles", ["gpu"]) and s["environment"]["BATON_ROLE"] != "router"]
    ids = []
    for svc in gpu:
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in device
        ids += device["device_ids"]
        assert svc["environment"]["BATON_DEVICE"].startswith("cuda")
        assert {"cuda_copy", "tcp"} <= set(svc["environment"]["UCX_TLS"].split(","))
    assert len(ids) == len(set(ids)) == 2


# -- Dockerfile -----------------------------------------------------------------------

def _stages() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """{stage: (what it is FROM, [(instruction, arguments)])}, in order."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    stages: dict[str, tuple[str, list]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, args = line.partition(" ")
        if op.upper() == "FROM":
            words = args.split()
            name = words[2] if len(words) > 2 and words[1].upper() == "AS" else str(len(stages))
            stages[name] = (words[0], [])
        else:
            next(reversed(stages.values()))[1].append((op.upper(), args))
    return stages


def _chain(stages, name: str) -> list[tuple[str, str]]:
    """The instructions an image runs: its stage's and those of the stages it is FROM."""
    parent, ops = stages[name]
    return (_chain(stages, parent) if parent in stages else []) + ops


def test_router_image_installs_no_torch_and_worker_image_does():
    stages = _stages()
    assert list(stages)[-1] == "worker"  # the default target
    router_runs = [a for op, a in _chain(stages, "router") if op == "RUN"]
    extras = {e.strip() for r in router_runs for group in re.findall(r"\.\[([^\]]*)\]", r)
              for e in group.split(",")}
    assert "http" in extras and not extras & {"engine", "nixl"}, extras
    assert not any("torch" in r for r in router_runs)
    worker_runs = [a for op, a in _chain(stages, "worker") if op == "RUN"]
    torch_at = next(i for i, r in enumerate(worker_runs) if re.search(r"install torch", r))
    engine_at = next(i for i, r in enumerate(worker_runs) if re.search(r"\.\[engine", r))
    assert torch_at < engine_at and "TORCH_INDEX" in worker_runs[torch_at]
    for image in ("router", "worker"):
        users = [a for op, a in _chain(stages, image) if op == "USER"]
        assert users and users[-1] not in ("root", "0")
    # The router reads the default model's tokenizer (no torch to build it from the GGUF).
    tokenizer = tokenizer_dir(Path("/opt/baton/cache/models") / GGUF_NAME)
    copies = [shlex.split(a) for op, a in _chain(stages, "router") if op == "COPY"]
    assert any(c[0].startswith("--from=") and c[-1] == str(tokenizer) for c in copies)


def _copied(stages, ops) -> set[str]:
    """What these instructions take from the build context: their own COPYs, and those of
    the stages they copy from."""
    sources = set()
    for op, args in ops:
        words = shlex.split(args) if op == "COPY" else []
        origin = next((w[len("--from="):] for w in words if w.startswith("--from=")), None)
        if origin is None:
            sources |= {w.rstrip("/") for w in words[:-1] if not w.startswith("--")}
        elif origin in stages:
            sources |= _copied({}, stages[origin][1])
    return sources


def test_both_images_copy_every_package_pyproject_installs():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    find = pyproject["tool"]["setuptools"]["packages"]["find"]
    needed = {"pyproject.toml", "README.md"}
    for where in find["where"]:  # top-level packages, as setuptools finds them
        for d in (ROOT / where).iterdir():
            if d.is_dir() and d.name.isidentifier() and any(
                    fnmatch(d.name, pattern) for pattern in find["include"]):
                needed.add(Path(where, d.name).parts[0])
    assert {"services", "protos", "cli"} <= needed  # the finder saw the project
    stages = _stages()
    for image in ("router", "worker"):
        missing = needed - _copied(stages, _chain(stages, image))
        assert not missing, f"{image} image lacks {sorted(missing)}"
