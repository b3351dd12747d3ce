"""The deployment files besides Kubernetes: docker-compose.yml (profiles, DNS discovery,
GPUs, secrets) and the Dockerfile's images (what each installs and copies)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from baton.services.common.default_model import GGUF_NAME
from baton.services.common.tokenizer import tokenizer_dir
from tests.unit.test_deploy import ROOT, SECRET_VARIABLES

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


def test_compose_routers_take_their_api_keys_from_a_secret_file_kept_out_of_git():
    compose = _compose()
    routers = [s for s in compose["services"].values()
               if s["environment"]["BATON_ROLE"] == "router"]
    assert len(routers) == 2  # one a profile
    for router in routers:
        _compose_secret(compose, router, "BATON_API_KEY_FILE")
    for svc in compose["services"].values():
        assert not set(svc["environment"]) & set(SECRET_VARIABLES)  # no literal key


def _compose_secret(compose: dict, svc: dict, variable: str) -> str:
    """The secret whose file `variable` names in `svc`; checks it stays out of git."""
    path = svc["environment"][variable]
    (name,) = [n for n in svc["secrets"] if path == f"/run/secrets/{n}"]
    top = Path(compose["secrets"][name]["file"]).parts[0]
    for ignore in (".gitignore", ".dockerignore"):  # never committed, never in an image
        lines = (ROOT / ignore).read_text().splitlines()
        assert top in {line.strip().rstrip("/") for line in lines}, ignore
    return name


def test_compose_services_share_one_cluster_token_from_a_secret_file():
    compose = _compose()
    names = {_compose_secret(compose, svc, "BATON_CLUSTER_TOKEN_FILE")
             for svc in compose["services"].values()}
    assert len(names) == 1
    # Every service is reached over the network: said (a worker's default is loopback),
    # and never open.
    for svc in compose["services"].values():
        env = svc["environment"]
        assert env["BATON_ADDRESS"].startswith("0.0.0.0:")
        assert "BATON_INSECURE_NO_CLUSTER_AUTH" not in env


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


def _pip_installs(stages, image: str) -> list[list[str]]:
    """The arguments of every `pip install` the image runs, build args filled in."""
    args = {}
    for op, a in _chain(stages, image):
        if op == "ARG" and "=" in a:
            name, _, value = a.partition("=")
            args[name.strip()] = value.strip()
    installs = []
    for op, a in _chain(stages, image):
        for command in a.split("&&") if op == "RUN" else []:
            words = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), command))
            if words[:2] == ["pip", "install"]:
                installs.append(words[2:])
    return installs


def _lock_read(words: list[str]) -> Path | None:
    """The lock file an install reads, if it is an install of a whole lock, hashed."""
    if "--no-deps" not in words or "--require-hashes" not in words or "-r" not in words:
        return None
    return Path(words[words.index("-r") + 1].removeprefix("/tmp/"))


def test_every_install_line_of_both_images_reads_the_lock():
    # Each image installs one whole lock (pinned, hashed, no dependency resolved at build
    # time) and then Baton itself, with no dependencies and the lock's setuptools.
    stages = _stages()
    assert list(stages)[-1] == "worker"  # the default target
    locks = {}
    for image in ("router", "worker"):
        installs = _pip_installs(stages, image)
        assert installs, image
        read = [_lock_read(w) for w in installs]
        baton = [w for w in installs if w[-1] == "." and {"--no-deps", "--no-build-isolation"}
                 <= set(w) and "-r" not in w]
        assert len(baton) == 1 and installs[-1] == baton[0], installs
        assert all(r is not None for r in read[:-1]), installs
        locks[image] = read[:-1]
    assert locks == {"router": [Path("requirements/router.txt")],
                     "worker": [Path("requirements/worker.txt")]}
    router = (ROOT / "requirements/router.txt").read_text()
    worker = (ROOT / "requirements/worker.txt").read_text()
    assert not re.search(r"^(torch|triton|nvidia-|nixl)", router, re.M)
    assert re.search(r"^torch==[\d.]+\+cpu ", worker, re.M)  # PyTorch's CPU build
    # ... found on PyTorch's CPU index, the worker's extra index by default
    worker_install = _pip_installs(stages, "worker")[0]
    assert worker_install[worker_install.index("--extra-index-url") + 1] == \
        "https://download.pytorch.org/whl/cpu"
    for image in ("router", "worker"):
        users = [a for op, a in _chain(stages, image) if op == "USER"]
        assert users and users[-1] not in ("root", "0")
    # The router reads the default model's tokenizer (no torch to build it from the GGUF).
    tokenizer = tokenizer_dir(Path("/opt/baton/cache/models") / GGUF_NAME)
    copies = [shlex.split(a) for op, a in _chain(stages, "router") if op == "COPY"]
    assert any(c[0].startswith("--from=") and c[-1] == str(tokenizer) for c in copies)


def test_the_gpu_image_reads_its_own_lock():
    args = _compose()["x-gpu-worker"]["build"]["args"]
    gpu = ROOT / args["WORKER_LOCK"]
    text = gpu.read_text()
    assert re.search(r"^torch==[\d.]+ ", text, re.M)  # PyPI's torch: its CUDA build
    assert re.search(r"^nvidia-", text, re.M) and "--hash=sha256:" in text


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
    setup = pyproject["tool"]["setuptools"]
    needed = {"pyproject.toml", "README.md"}
    for package in setup["packages"]:  # the folder each installed package comes from
        parent = max((p for p in setup["package-dir"] if package == p or
                      package.startswith(p + ".")), key=len, default=None)
        needed.add(Path(setup["package-dir"][parent] if parent else package).parts[0])
    assert {"services", "protos", "cli", "tools"} <= needed  # pyproject lists the project
    stages = _stages()
    for image in ("router", "worker"):
        missing = needed - _copied(stages, _chain(stages, image))
        assert not missing, f"{image} image lacks {sorted(missing)}"


def test_the_worker_images_cpu_kernels_stay_roots_and_read_only_to_its_user():
    """Built as root, and never given to the user the services run as (nor any folder
    above them): a file-write bug in a service cannot become native code at its next
    start (kernels/cpu_ops.py loads only from folders that user cannot write)."""
    ops = _chain(_stages(), "worker")
    env = dict(a.split("=", 1) for op, a in ops if op == "ENV" and "=" in a and " " not in a)
    kernels = Path(env["TORCH_EXTENSIONS_DIR"])
    build = next(i for i, (op, a) in enumerate(ops) if op == "RUN" and "cpu_ops" in a)
    assert not [a for op, a in ops[:build] if op == "USER"], "the kernels build as root"
    for op, args in ops:
        commands = [c.split() for c in args.split("&&")] if op == "RUN" else []
        given = [w for c in commands if c and c[0] in ("chown", "chmod")
                 for w in c[1:] if w.startswith("/")]
        if op == "COPY" and "--chown" in args:
            given.append(shlex.split(args)[-1])
        for path in map(Path, given):
            assert not (kernels == path or kernels.is_relative_to(path)
                        or path.is_relative_to(kernels)), f"{op} {args}: gives {path} away"
    users = [a for op, a in ops if op == "USER"]
    assert users[-1] == "baton"
