"""A plan as a kustomize overlay of deploy/kubernetes: each worker Deployment's replicas,
and every flag of the plan as the BATON_* variable the container reads (each flag of
`baton serve` has one, cli/flag_table.py), patched into its container's env by name.

    baton plan ... --out plan.json --kustomize overlays/planned \\
        --kustomize-base ../../deploy/kubernetes
    kubectl apply -k overlays/planned -n NAMESPACE

Each pod's CPU request is the deployment's to set (a worker of t threads wants t cores).
"""

from __future__ import annotations

from pathlib import Path

import yaml

# (Deployment, its container) per plan role; the router's flags go to the router's.
TARGETS = {"prefill": ("baton-prefill", "prefill"), "decode": ("baton-decode", "decode"),
           "router": ("baton-router", "router")}


def env_of(flags: list[str], role: str) -> list[dict]:
    """`--name value` pairs (and bare `--name` / `--no-name` switches) as the role's
    BATON_* variables; ValueError for a flag the role does not take."""
    from baton.cli.flag_table import FLAGS

    by_name = {f.name: f for f in FLAGS if role in f.roles}
    out, i = [], 0
    while i < len(flags):
        name = flags[i].removeprefix("--")
        value = "true"
        if name.startswith("no-") and name[3:] in by_name and by_name[name[3:]].kind is bool:
            name, value = name[3:], "false"
        elif i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            value, i = flags[i + 1], i + 1
        flag = by_name.get(name)
        if flag is None:
            raise ValueError(f"--{name}: not a flag of the {role} role")
        out.append({"name": flag.env, "value": value})
        i += 1
    return out


def patches(plan: dict) -> list[dict]:
    """One strategic-merge patch per Deployment the plan sets."""
    out = []
    roles = dict(plan["roles"])
    if "prefill" not in roles:  # colocated: no prefill worker at all
        roles["prefill"] = {"replicas": 0, "flags": []}
    for role, spec in [*roles.items(), ("router", {"flags": plan["router"]["flags"]})]:
        deployment, container = TARGETS[role]
        patch: dict = {"apiVersion": "apps/v1", "kind": "Deployment",
                       "metadata": {"name": deployment},
                       "spec": {"template": {"spec": {"containers": [
                           {"name": container, "env": env_of(spec["flags"], role)}]}}}}
        if "replicas" in spec:
            patch["spec"]["replicas"] = spec["replicas"]
        out.append(patch)
    return out


def write(plan: dict, folder: Path, base: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for patch in patches(plan):
        name = f"{patch['metadata']['name']}.yaml"
        (folder / name).write_text(yaml.safe_dump(patch, sort_keys=False))
        names.append(name)
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": [base], "patches": [{"path": n} for n in names]}
    path = folder / "kustomization.yaml"
    path.write_text("# Written by `baton plan --kustomize` (tools/plan/kustomize.py).\n"
                    + yaml.safe_dump(kustomization, sort_keys=False))
    return path
