"""Slurm script, Dockerfile and systemd units: they lint clean and use only real settings."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.deploy.conftest import require_tool

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SBATCH = DEPLOY / "slurm" / "hangwatch.sbatch"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
SYSTEMD = DEPLOY / "systemd"
_ENV_NAME = re.compile(r"\bHANGWATCH_[A-Z0-9_]+\b")


def _check_flags(cmd: str, argv: list[str], flags: dict[str, set[str]], where: str) -> None:
    for tok in argv:
        if tok == "--":
            break
        if tok.startswith("-"):
            assert tok.split("=", 1)[0] in flags[cmd], f"{where}: `hangwatch {cmd}` has no {tok}"


# --- Slurm ------------------------------------------------------------------------

SBATCH_FUNCS = {"hw_coordinator_cmd": "server", "hw_agent_cmd": "agent", "hw_train_cmd": "run"}


def sbatch_command(func: str, env: dict[str, str], *args: str) -> list[str]:
    """The argv a hw_*_cmd function of the batch script builds, from real bash."""
    script = (
        f"source {shlex.quote(str(SBATCH))}\n"
        f'hw_defaults\n{func} "$@"\n'
        "printf '%s\\0' \"${HW_CMD[@]}\"\n"
    )
    out = subprocess.run(
        ["bash", "-c", script, "bash", *args],
        env=env,
        capture_output=True,
        timeout=10,
        check=False,
    )
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout.decode().split("\0")[:-1]


def _lints_clean(argv: list[str], timeout: float) -> None:
    """A linter run that finds nothing; what it found is the failure message."""
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(20)
def test_sbatch_parses_and_lints() -> None:
    subprocess.run(["bash", "-n", str(SBATCH)], check=True, timeout=10)
    _lints_clean([require_tool("shellcheck"), "--shell=bash", "--severity=style", str(SBATCH)], 15)


@pytest.mark.timeout(20)
def test_sbatch_commands_use_real_flags(
    cli_flags: dict[str, set[str]], config_env: dict[str, object]
) -> None:
    env = {
        "PATH": os.environ["PATH"],
        "HW_HEAD": "node001",
        "SLURM_JOB_ID": "42",
        "SLURM_NNODES": "4",
    }
    for func, cmd in SBATCH_FUNCS.items():
        argv = sbatch_command(func, env, "train.py", "--lr", "3e-4")
        assert argv[:2] == ["hangwatch", cmd], argv
        _check_flags(cmd, argv[2:], cli_flags, f"{SBATCH.name}:{func}")
    train = sbatch_command("hw_train_cmd", env, "train.py", "--lr", "3e-4")
    sep = train.index("--")
    assert train[sep + 1] == "torchrun" and train[-3:] == ["train.py", "--lr", "3e-4"]
    assert train[train.index("--rdzv-endpoint") + 1] == "node001:29500"
    agent = sbatch_command("hw_agent_cmd", env)
    assert agent[agent.index("--coordinator") + 1] == "node001:7451"
    for name in set(_ENV_NAME.findall(SBATCH.read_text(encoding="utf-8"))):
        assert name in config_env, f"{SBATCH.name} uses {name}, which is not a setting"


# --- Docker -------------------------------------------------------------------------


def docker_stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> [(INSTRUCTION, arguments)], continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        if instr.upper() == "FROM":
            m = re.search(r"\bAS\s+(\S+)", rest, re.IGNORECASE)
            current = []
            stages[m.group(1) if m else f"stage{len(stages)}"] = current
        current.append((instr.upper(), rest.strip()))
    return stages


@pytest.mark.timeout(30)
def test_dockerfile_lints() -> None:
    _lints_clean([require_tool("hadolint"), "--no-color", str(DOCKERFILE)], 25)


@pytest.mark.timeout(10)
def test_docker_images_are_consistent(
    env_for_command: dict[str, set[str]], config_defaults: dict[str, object]
) -> None:
    stages = docker_stages()
    assert {"builder", "server", "agent"} <= set(stages)
    for target in ("server", "agent"):
        instrs = stages[target]
        assert instrs[0][1].startswith("runtime"), f"{target} must build on the slim runtime stage"
        envs: dict[str, str] = {}
        for instr, rest in instrs:
            if instr == "ENV":
                envs.update(dict(kv.split("=", 1) for kv in shlex.split(rest)))
        for name in envs:
            if name.startswith("HANGWATCH_"):
                assert name in env_for_command[target], f"{target} image sets {name}"
        user = [rest for instr, rest in instrs if instr == "USER"][-1]
        uid = user.split(":")[0]
        assert uid.isdigit() and uid != "0", f"{target} runs as {user}: numeric non-root"
        entry = [rest for instr, rest in instrs if instr == "ENTRYPOINT"][-1]
        assert entry == '["hangwatch"]'
        cmd = [rest for instr, rest in instrs if instr == "CMD"][-1]
        assert cmd == f'["{target}"]'
    server = dict(stages["server"])
    exposed = {int(p) for p in server["EXPOSE"].split()}
    envs = dict(kv.split("=", 1) for kv in shlex.split(server["ENV"]))
    for name in ("HANGWATCH_GRPC_PORT", "HANGWATCH_HTTP_PORT"):
        assert int(str(envs.get(name, config_defaults[name]))) in exposed
    assert "/healthz" in server["HEALTHCHECK"] and "HANGWATCH_HTTP_PORT" in server["HEALTHCHECK"]
    assert "py-spy" in " ".join(rest for _, rest in stages["builder-agent"])
    runs = " ".join(rest for st in stages.values() for instr, rest in st if instr == "RUN")
    assert "torch" not in runs.lower(), (
        "no torch in the images: the coordinator and agent never import it"
    )


@pytest.mark.timeout(10)
def test_docker_context_holds_every_package_dir() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    dirs = set(pyproject["tool"]["setuptools"]["package-dir"].values()) | {"proto"}
    ignore = (DEPLOY / "docker" / "Dockerfile.dockerignore").read_text(encoding="utf-8")
    copies = " ".join(rest for instr, rest in docker_stages()["builder"] if instr == "COPY")
    for d in sorted(dirs):
        assert f"!{d}/" in ignore.splitlines(), f"Dockerfile.dockerignore excludes {d}/"
        assert f" ./{d}" in copies, f"the builder does not COPY {d}/"


# --- systemd ---------------------------------------------------------------------------


def unit_settings(path: Path) -> list[tuple[str, str]]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            k, _, v = line.partition("=")
            out.append((k.strip(), v.strip()))
    return out


UNITS = {
    "hangwatch-server.service": "server",
    "hangwatch-agent.service": "agent",
    "hangwatch-relay.service": "relay",
}
ENV_FILES = {
    "server.env.example": "server",
    "agent.env.example": "agent",
    "relay.env.example": "relay",
}


@pytest.mark.timeout(10)
def test_units_use_real_settings_and_are_hardened(
    cli_flags: dict[str, set[str]], env_for_command: dict[str, set[str]]
) -> None:
    for unit, cmd in UNITS.items():
        s = unit_settings(SYSTEMD / unit)
        d = dict(s)
        exec_argv = shlex.split(d["ExecStart"])
        assert Path(exec_argv[0]).name == "hangwatch" and exec_argv[1] == cmd
        _check_flags(cmd, exec_argv[2:], cli_flags, unit)
        envs = dict(v.split("=", 1) for k, v in s if k == "Environment")
        for name in envs:
            assert name in env_for_command[cmd], f"{unit} sets {name}"
        rw = {p for k, v in s if k == "ReadWritePaths" for p in v.split()}
        state = {"server": "HANGWATCH_DATA_DIR", "agent": "HANGWATCH_RUN_DIR"}.get(cmd)
        if state is not None:  # the relay keeps nothing on disk
            assert envs[state] in rw, f"{unit}: {state} is not writable under ProtectSystem=strict"
        for k, v in {
            "NoNewPrivileges": "yes",
            "ProtectSystem": "strict",
            "PrivateTmp": "yes",
            "User": "hangwatch",
        }.items():
            assert d.get(k) == v, f"{unit}: {k}={d.get(k)}"
        assert d.get("ProtectHome") in ("yes", "read-only")
        assert d["EnvironmentFile"].lstrip("-") == f"/etc/hangwatch/{cmd}.env"
    agent = dict(unit_settings(SYSTEMD / "hangwatch-agent.service"))
    assert "CAP_SYS_PTRACE" in agent["AmbientCapabilities"].split()
    assert set(agent["AmbientCapabilities"].split()) == set(agent["CapabilityBoundingSet"].split())
    for unit in ("hangwatch-server.service", "hangwatch-relay.service"):
        assert dict(unit_settings(SYSTEMD / unit))["CapabilityBoundingSet"] == ""
    for name, cmd in ENV_FILES.items():
        text = (SYSTEMD / name).read_text(encoding="utf-8")
        for var in _ENV_NAME.findall(text):
            assert var in env_for_command[cmd], f"{name} mentions {var}"
        assert "HANGWATCH_TOKEN=" not in text, "the token goes through LoadCredential, not a file"


@pytest.mark.timeout(30)
def test_units_verify_and_score(tmp_path: Path) -> None:
    sa = require_tool("systemd-analyze")
    hangwatch = Path(sys.executable).parent / "hangwatch"
    assert hangwatch.exists(), "the hangwatch console script is not installed beside python"
    units = []
    for unit in UNITS:
        text = (SYSTEMD / unit).read_text(encoding="utf-8")
        # verify insists that ExecStart exists; point it at the installed script.
        (tmp_path / unit).write_text(text.replace("/usr/local/bin/hangwatch", str(hangwatch)))
        units.append(f"./{unit}")
    out = subprocess.run(
        [sa, "verify", *units], cwd=tmp_path, capture_output=True, text=True, timeout=20
    )
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr
    for unit in units:
        # Exposure on systemd's 0-10 scale, times ten: 3.0 is "OK" territory.
        out = subprocess.run(
            [sa, "security", "--offline=yes", "--threshold=30", unit],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert out.returncode == 0, out.stdout[-2000:]
