"""Kubernetes manifests: they parse, kustomize renders them, and what they set is real.

The overlays are rendered by a small strategic-merge renderer here (enough for
the features these kustomizations use) and, where `kubectl` is installed, the
result is compared with `kubectl kustomize`.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml is in the test extra")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = [
    K8S / "base",
    K8S / "overlays" / "daemonset",
    K8S / "overlays" / "production",
    K8S / "overlays" / "relay",
]
EXAMPLES = sorted((K8S / "examples").glob("*.yaml"))
Obj = dict[str, Any]

# --- a small kustomize ------------------------------------------------------

_MERGE_KEYS = ("name", "mountPath", "containerPort")


def _merge_key(items: list[Any]) -> str | None:
    if not items or not all(isinstance(i, dict) for i in items):
        return None
    return next((k for k in _MERGE_KEYS if all(k in i for i in items)), None)


def _smp(base: Any, patch: Any) -> Any:
    """Strategic merge: maps merge, named lists merge by key, everything else is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _smp(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        key = _merge_key(base + patch)
        if key is None:
            return copy.deepcopy(patch)
        out_list = [copy.deepcopy(i) for i in base]
        for item in patch:
            idx = next((n for n, b in enumerate(out_list) if b[key] == item[key]), None)
            if idx is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[idx] = _smp(out_list[idx], item)
        return out_list
    return copy.deepcopy(patch)


def _ident(o: Obj) -> tuple[str, str]:
    return o["kind"], o["metadata"]["name"]


def _containers(o: Obj) -> list[Obj]:
    spec = o["spec"] if o["kind"] == "Pod" else o["spec"]["template"]["spec"]
    return list(spec.get("initContainers", [])) + list(spec.get("containers", []))


def load_docs(path: Path) -> list[Obj]:
    with path.open(encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def render(kdir: Path) -> list[Obj]:
    k = load_docs(kdir / "kustomization.yaml")[0]
    assert k["kind"] == "Kustomization", kdir
    objs: list[Obj] = []
    for res in k.get("resources", []):
        p = (kdir / res).resolve()
        assert p.exists(), f"{kdir}/kustomization.yaml: resource {res} does not exist"
        objs += render(p) if p.is_dir() else load_docs(p)
    for patch in k.get("patches", []):
        assert set(patch) == {"path"}, f"renderer supports file patches only: {patch}"
        pp = kdir / patch["path"]
        assert pp.exists(), f"{kdir}: patch {patch['path']} does not exist"
        for doc in load_docs(pp):
            hits = [n for n, o in enumerate(objs) if _ident(o) == _ident(doc)]
            assert hits, f"{pp.name} patches {_ident(doc)}, which no resource defines"
            objs[hits[0]] = _smp(objs[hits[0]], doc)
    for lab in k.get("labels", []):
        assert not lab.get("includeSelectors") and not lab.get("includeTemplates")
        for o in objs:
            o["metadata"]["labels"] = {**o["metadata"].get("labels", {}), **lab["pairs"]}
    for img in k.get("images", []):
        for o in objs:
            if o["kind"] in ("Deployment", "DaemonSet", "Pod"):
                for c in _containers(o):
                    if c["image"].split(":")[0] == img["name"]:
                        c["image"] = f"{img.get('newName', img['name'])}:{img['newTag']}"
    return objs


def _normalized(objs: list[Obj]) -> dict[tuple[str, str], Any]:
    def norm(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        if isinstance(v, list):
            items = [norm(x) for x in v]
            key = _merge_key(items)
            return sorted(items, key=lambda i: str(i[key])) if key else items
        return v

    return {_ident(o): norm(o) for o in objs}


# --- helpers over rendered objects --------------------------------------------


def find(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    hits = [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def pod_spec(o: Obj) -> Obj:
    return o["spec"] if o["kind"] == "Pod" else o["spec"]["template"]["spec"]


def container_env(c: Obj, objs: list[Obj]) -> dict[str, str | None]:
    """Env a container gets: envFrom ConfigMaps, then env (valueFrom -> None)."""
    out: dict[str, str | None] = {}
    for ef in c.get("envFrom", []):
        out.update(find(objs, "ConfigMap", ef["configMapRef"]["name"])["data"])
    for e in c.get("env", []):
        out[e["name"]] = e.get("value")
    return out


def hangwatch_command(c: Obj) -> tuple[str, list[str]]:
    """The hangwatch subcommand a container runs and its argv after it."""
    argv = list(c.get("command", [])) + list(c.get("args", []))
    if argv and argv[0] == "hangwatch":
        argv = argv[1:]
    # Images use ENTRYPOINT ["hangwatch"]; a container without `command` runs it.
    assert argv, f"container {c['name']} runs nothing"
    assert argv[0] in ("server", "agent", "run", "relay"), f"container {c['name']}: {argv}"
    return argv[0], argv[1:]


def mount_of(c: Obj, volume: str) -> str:
    hits = [m["mountPath"] for m in c.get("volumeMounts", []) if m["name"] == volume]
    assert len(hits) == 1, f"{c['name']} mounts volume {volume} {len(hits)} times"
    return hits[0]


def effective(envs: dict[str, str | None], name: str, defaults: dict[str, object]) -> str:
    return str(envs[name]) if name in envs else str(defaults[name])


def all_rendered() -> list[tuple[str, list[Obj]]]:
    out = [(str(k.relative_to(K8S)), render(k)) for k in KUSTOMIZATIONS]
    out += [(str(p.relative_to(K8S)), load_docs(p)) for p in EXAMPLES]
    return out


# --- tests ----------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_every_yaml_parses() -> None:
    files = sorted(K8S.rglob("*.yaml"))
    assert len(files) >= 10
    for f in files:
        docs = load_docs(f)
        assert docs, f"{f} is empty"
        for d in docs:
            assert {"apiVersion", "kind"} <= set(d), f"{f}: a document without apiVersion/kind"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kdir", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_renderer_matches_kubectl_kustomize(kdir: Path) -> None:
    ours = render(kdir)
    assert len({_ident(o) for o in ours}) == len(ours), "duplicate resources"
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: checked with the built-in renderer only")
    out = subprocess.run(
        [kubectl, "kustomize", str(kdir)], capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 0, out.stderr
    theirs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert _normalized(ours) == _normalized(theirs)


@pytest.mark.timeout(30)
def test_hangwatch_containers_use_real_flags_and_env(
    cli_flags: dict[str, set[str]], env_for_command: dict[str, set[str]]
) -> None:
    seen = 0
    for where, objs in all_rendered():
        for o in objs:
            if o["kind"] not in ("Deployment", "DaemonSet", "Pod"):
                continue
            for c in _containers(o):
                cmd, rest = hangwatch_command(c)
                seen += 1
                for tok in rest:
                    if tok == "--":
                        break
                    if tok.startswith("-"):
                        flag = tok.split("=", 1)[0]
                        assert flag in cli_flags[cmd], f"{where}: `hangwatch {cmd}` has no {flag}"
                for name in container_env(c, objs):
                    if name.startswith("HANGWATCH_"):
                        assert name in env_for_command[cmd], (
                            f"{where}/{c['name']}: {name} is not a setting `hangwatch {cmd}` reads"
                        )
    assert seen >= 5


@pytest.mark.timeout(30)
def test_coordinator_ports_paths_and_probes(config_defaults: dict[str, object]) -> None:
    for kdir in KUSTOMIZATIONS:
        objs = render(kdir)
        dep = find(objs, "Deployment", "hangwatch-coordinator")
        spec = pod_spec(dep)
        (c,) = spec["containers"]
        envs = container_env(c, objs)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == int(effective(envs, "HANGWATCH_GRPC_PORT", config_defaults))
        assert ports["http"] == int(effective(envs, "HANGWATCH_HTTP_PORT", config_defaults))
        # Listening beyond loopback needs a token; it comes from the Secret.
        assert effective(envs, "HANGWATCH_HOST", config_defaults) == "0.0.0.0"
        assert "HANGWATCH_INSECURE" not in envs
        vols = {v["name"]: v for v in spec["volumes"]}
        token_file = PurePosixPath(str(envs["HANGWATCH_TOKEN_FILE"]))
        assert str(token_file.parent) == mount_of(c, "token")
        assert vols["token"]["secret"]["secretName"] == "hangwatch-token"
        assert vols["token"]["secret"]["defaultMode"] & 0o040, "fsGroup must be able to read it"
        data_dir = effective(envs, "HANGWATCH_DATA_DIR", config_defaults)
        assert mount_of(c, "data") == data_dir
        pvc = vols["data"]["persistentVolumeClaim"]["claimName"]
        find(objs, "PersistentVolumeClaim", pvc)
        assert dep["spec"]["strategy"]["type"] == "Recreate", "one SQLite writer at a time"
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
        assert c["startupProbe"]["tcpSocket"]["port"] == "grpc"
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
        assert spec["securityContext"]["runAsNonRoot"]
        svc = find(objs, "Service", "hangwatch-coordinator")
        for sp in svc["spec"]["ports"]:
            assert sp["targetPort"] in ports and sp["port"] == ports[sp["targetPort"]]
        assert (
            svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        )
        for path in ("HANGWATCH_TLS_CERT", "HANGWATCH_TLS_KEY", "HANGWATCH_TLS_CA"):
            if path in envs:
                assert str(PurePosixPath(str(envs[path])).parent) == mount_of(c, "tls")


@pytest.mark.timeout(30)
def test_sidecar_training_pod(config_defaults: dict[str, object]) -> None:
    (pod,) = load_docs(K8S / "examples" / "training-pod.yaml")
    base = render(K8S / "base")
    spec = pod_spec(pod)
    assert spec["shareProcessNamespace"] is True
    agent = next(c for c in _containers(pod) if hangwatch_command(c)[0] == "agent")
    trainer = next(c for c in _containers(pod) if hangwatch_command(c)[0] == "run")
    # A native sidecar: starts first, keeps running, does not hold the pod open.
    assert agent in spec["initContainers"] and agent["restartPolicy"] == "Always"
    assert trainer["command"][:4] == ["hangwatch", "run", "--", "torchrun"]
    assert "SYS_PTRACE" in agent["securityContext"]["capabilities"]["add"]
    for c in (agent, trainer):
        assert c["resources"]["limits"]["memory"], c["name"]
    a_env, t_env = container_env(agent, []), container_env(trainer, [])
    vols = {v["name"]: v for v in spec["volumes"]}
    run_dir = effective(a_env, "HANGWATCH_RUN_DIR", config_defaults)
    assert effective(t_env, "HANGWATCH_RUN_DIR", config_defaults) == run_dir
    assert mount_of(agent, "hangwatch-run") == mount_of(trainer, "hangwatch-run") == run_dir
    assert "emptyDir" in vols["hangwatch-run"]
    # Unix socket paths must fit in 108 bytes: <run_dir>/hook/<pid>.sock.
    assert len(f"{run_dir}/hook/4194304.sock") < 100
    assert a_env["HANGWATCH_JOB_ID"] == t_env["HANGWATCH_JOB_ID"]
    svc = find(base, "Service", "hangwatch-coordinator")
    grpc = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert a_env["HANGWATCH_COORDINATOR"] == f"{svc['metadata']['name']}:{grpc}"
    token_file = PurePosixPath(str(a_env["HANGWATCH_TOKEN_FILE"]))
    assert str(token_file.parent) == mount_of(agent, "hangwatch-token")
    assert vols["hangwatch-token"]["secret"]["secretName"] == "hangwatch-token"
    # The coordinator's NetworkPolicy admits this pod's agent.
    np = find(base, "NetworkPolicy")
    grpc_rule = next(r for r in np["spec"]["ingress"] if r["ports"][0]["port"] == "grpc")
    sel = grpc_rule["from"][0]["podSelector"]["matchLabels"]
    assert sel.items() <= pod["metadata"]["labels"].items()


@pytest.mark.timeout(30)
def test_daemonset_agent_and_its_training_pod(config_defaults: dict[str, object]) -> None:
    objs = render(K8S / "overlays" / "daemonset")
    ds = find(objs, "DaemonSet", "hangwatch-agent")
    spec = pod_spec(ds)
    assert spec["hostPID"] is True
    (agent,) = spec["containers"]
    envs = container_env(agent, objs)
    run_dir = effective(envs, "HANGWATCH_RUN_DIR", config_defaults)
    vols = {v["name"]: v for v in spec["volumes"]}
    assert mount_of(agent, "run") == run_dir
    assert vols["run"]["hostPath"]["path"] == run_dir
    assert "SYS_PTRACE" in agent["securityContext"]["capabilities"]["add"]
    (pod,) = load_docs(K8S / "examples" / "training-pod-daemonset.yaml")
    pspec = pod_spec(pod)
    assert pspec["hostPID"] is True, "pids the hook records must be host pids"
    (trainer,) = pspec["containers"]
    t_env = container_env(trainer, [])
    assert t_env["HANGWATCH_RUN_DIR"] == run_dir
    assert t_env["HANGWATCH_JOB_ID"] == envs["HANGWATCH_JOB_ID"]
    assert {v["name"]: v for v in pspec["volumes"]}["hangwatch-run"]["hostPath"]["path"] == run_dir
    assert pspec["nodeSelector"].items() <= spec["nodeSelector"].items()


def _admits(policy: Obj, port: str, labels: dict[str, str]) -> bool:
    """Whether a NetworkPolicy lets pods with `labels` reach `port`."""
    return any(
        any(p["port"] == port for p in rule["ports"])
        and any(
            f["podSelector"].get("matchLabels", {}).items() <= labels.items() for f in rule["from"]
        )
        for rule in policy["spec"]["ingress"]
    )


@pytest.mark.timeout(30)
def test_relay_overlay_puts_the_agents_progress_through_relays(
    config_defaults: dict[str, object],
) -> None:
    objs = render(K8S / "overlays" / "relay")
    dep = find(objs, "Deployment", "hangwatch-relay")
    spec = pod_spec(dep)
    (c,) = spec["containers"]
    assert hangwatch_command(c)[0] == "relay"
    envs = container_env(c, objs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    # The relay's own defaults differ from the coordinator's: the env sets both ports.
    assert ports == {"grpc": int(str(envs["HANGWATCH_GRPC_PORT"])), "http": 7453}
    assert int(str(envs["HANGWATCH_HTTP_PORT"])) == 7453
    assert envs["HANGWATCH_HOST"] == "0.0.0.0" and "HANGWATCH_INSECURE" not in envs
    # The probes are the paths server/relay_http.py serves (tests/server/test_relay_http.py).
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    token_file = PurePosixPath(str(envs["HANGWATCH_TOKEN_FILE"]))
    assert str(token_file.parent) == mount_of(c, "token")
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["token"]["secret"]["secretName"] == "hangwatch-token"
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert spec["securityContext"]["runAsNonRoot"]
    # The relay dials the coordinator's Service, and the agents the relay's.
    coord = find(objs, "Service", "hangwatch-coordinator")
    coord_grpc = next(p["port"] for p in coord["spec"]["ports"] if p["name"] == "grpc")
    assert envs["HANGWATCH_COORDINATOR"] == f"hangwatch-coordinator:{coord_grpc}"
    svc = find(objs, "Service", "hangwatch-relay")
    for sp in svc["spec"]["ports"]:
        assert sp["targetPort"] in ports and sp["port"] == ports[sp["targetPort"]]
    relay_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= relay_labels.items()
    ds = find(objs, "DaemonSet", "hangwatch-agent")
    agent_envs = container_env(pod_spec(ds)["containers"][0], objs)
    assert agent_envs["HANGWATCH_PROGRESS_RELAY"] == f"hangwatch-relay:{ports['grpc']}"
    assert agent_envs["HANGWATCH_COORDINATOR"] == f"hangwatch-coordinator:{coord_grpc}"
    # Agents reach the relays' and the coordinator's gRPC; the relays reach
    # the coordinator's; no one else reaches either gRPC port.
    agent_labels = ds["spec"]["template"]["metadata"]["labels"]
    relay_np = find(objs, "NetworkPolicy", "hangwatch-relay")
    coord_np = find(objs, "NetworkPolicy", "hangwatch-coordinator")
    assert relay_np["spec"]["podSelector"]["matchLabels"].items() <= relay_labels.items()
    assert _admits(relay_np, "grpc", agent_labels)
    assert _admits(coord_np, "grpc", agent_labels) and _admits(coord_np, "grpc", relay_labels)
    stranger = {"app": "something-else"}
    assert not _admits(relay_np, "grpc", stranger) and not _admits(coord_np, "grpc", stranger)
