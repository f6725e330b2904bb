"""The CSE599-O scripts under a real Slurm, as the course staff run them.

A one-node cluster (``munged``, ``slurmctld``, ``slurmd``, node ``localhost`` with 2 CPUs) is started from a
temporary directory, and ``srun ... uv run benchmark_naive_ddp.py --model toy`` runs from
``cs336_systems/cse599o/`` both as one task that spawns its two ranks and as two tasks, one rank each.
Debian's ``slurm-wlm`` and ``munge`` are installed first where they are missing and this is root on a machine
with apt; where that or the daemons fail, the test is skipped with the reason. Every daemon started here is
stopped (its whole process group) and the directory removed, whatever the outcome.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = REPO_ROOT / "cs336_systems" / "cse599o"
PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sinfo", "scancel")
INSTALL_S = 420.0  # apt-get update and install together, inside pytest's 600 s per test
READY_S = 30.0  # how long the node may take to register as idle
RUN_S = 240  # one srun of the toy check (about 10 s here)
#: Variables of an enclosing Slurm job or torchrun that would send our srun (or its ranks) elsewhere.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def _program(name: str) -> str | None:
    """The daemons live in /usr/sbin, which a non-login PATH may lack."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin")


def _install_if_missing() -> str | None:
    """Install Debian's slurm-wlm and munge when a program is missing; a reason to skip when that cannot
    be done, else ``None``."""
    if all(_program(p) for p in PROGRAMS):
        return None
    missing = ", ".join(p for p in PROGRAMS if not _program(p))
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"Slurm programs missing ({missing}) and installing them needs root and apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"]
    last = ""
    deadline = time.monotonic() + INSTALL_S
    for attempt in ([install], [["apt-get", "update", "-q"], install]):
        try:
            for command in attempt:
                done = subprocess.run(command, env=env, capture_output=True, text=True, check=False,
                                      timeout=max(1.0, deadline - time.monotonic()))
                if done.returncode != 0:
                    last = _last_line(done.stderr or done.stdout) or f"{command[:2]} exited {done.returncode}"
                    break
            else:
                if all(_program(p) for p in PROGRAMS):
                    return None
                last = "installed, but still missing " + ", ".join(p for p in PROGRAMS if not _program(p))
        except (OSError, subprocess.TimeoutExpired) as exc:
            last = str(exc)
    return f"could not install slurm-wlm and munge with apt-get: {last}"


def _last_line(text: str) -> str:
    return next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_conf(root: Path) -> str:
    """A minimal one-node cluster: no cgroups (process tracking by /proc), no accounting, everything
    under ``root``; ``config_overrides`` lets the node claim 2 CPUs whatever the machine has."""
    return "\n".join([
        "ClusterName=cse599o-test",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge/munge.socket",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "JobCompType=jobcomp/none",
        "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd.log",
        "NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN",
        "PartitionName=test Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each daemon's process group (each was started in a session of its own), then SIGKILL
    what is still there after 10 s."""
    for p in reversed(processes):
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in reversed(processes):
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)


def _node_state(env: dict[str, str]) -> str:
    try:
        done = subprocess.run([_program("sinfo") or "sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True,
                              text=True, timeout=10, check=False)
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    return done.stdout.strip() or _last_line(done.stderr)


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[Cluster]:
    """A running one-node Slurm cluster of our own, torn down after the module's tests."""
    reason = _install_if_missing()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="slurm-"))  # short: munge's socket path must fit a sockaddr
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM") and k not in _LAUNCHER_VARS}
    env["SLURM_CONF"] = str(root / "slurm.conf")
    processes: list[subprocess.Popen[bytes]] = []
    up = False  # scancel only a cluster that answers (against none it retries for a while)
    try:
        for sub in ("munge", "state", "spool", "log"):
            (root / sub).mkdir(mode=0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        (root / "slurm.conf").write_text(_slurm_conf(root))
        munge = root / "munge"
        commands = [
            [_program("munged"), "-F", "-f", f"--key-file={key}", f"--socket={munge}/munge.socket",
             f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed"],
            [_program("slurmctld"), "-D", "-i"],
            [_program("slurmd"), "-D", "-N", "localhost"],
        ]
        for command in commands:
            name = Path(str(command[0])).name
            with open(root / "log" / f"{name}.out", "wb") as log:
                processes.append(subprocess.Popen([str(c) for c in command], env=env, stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True))
            if name == "munged":
                _wait_for(lambda: (munge / "munge.socket").exists(), 10)
        deadline = time.monotonic() + READY_S
        state = ""
        while time.monotonic() < deadline:
            dead = [Path(str(c[0])).name for c, p in zip(commands, processes) if p.poll() is not None]
            if dead:
                pytest.skip(f"Slurm test cluster: {', '.join(dead)} exited: {_log_tail(root, dead[0])}")
            state = _node_state(env)
            if state == "idle":
                break
            time.sleep(0.5)
        else:
            pytest.skip(f"Slurm test cluster: node not idle after {READY_S:.0f} s (sinfo: {state!r}; "
                        f"slurmd: {_log_tail(root, 'slurmd')})")
        up = True
        yield Cluster(root, env)
    finally:
        if up:
            subprocess.run([_program("scancel") or "scancel", "--user", str(os.getuid())], env=env,
                           capture_output=True, timeout=30, check=False)
        _stop(processes)
        shutil.rmtree(root, ignore_errors=True)


def _wait_for(ready: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not ready():
        time.sleep(0.1)


def _log_tail(root: Path, name: str) -> str:
    """The last line a daemon wrote to its captured output (in the foreground each also logs there)."""
    path = root / "log" / f"{name}.out"
    return (_last_line(path.read_text(errors="replace")) if path.exists() else "") or "no output"


def _script_command(script: str) -> list[str]:
    """The staff's ``uv run SCRIPT``; this interpreter on the script where uv is not on PATH."""
    uv = os.environ.get("UV") or shutil.which("uv")
    return [uv, "run", script] if uv else [sys.executable, script]


def _srun(cluster: Cluster, srun_args: list[str], args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    command = [_program("srun") or "srun", *srun_args, *_script_command("benchmark_naive_ddp.py"), *args]
    return subprocess.run(command, cwd=SCRIPTS, env={**cluster.env, **env}, capture_output=True, text=True,
                          timeout=RUN_S, check=False)


def _report(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"


@pytest.mark.slow
def test_naive_ddp_toy_check_as_one_task_spawning_its_ranks(slurm_cluster: Cluster) -> None:
    done = _srun(slurm_cluster, ["-N1", "-n1"], ["--model", "toy", "--nproc", "2", "--backend", "gloo"])
    assert done.returncode == 0, _report(done)
    assert "ranks: 2" in done.stdout and "Naive DDP matches baseline!" in done.stdout, _report(done)


@pytest.mark.slow
def test_naive_ddp_toy_check_with_a_task_per_rank(slurm_cluster: Cluster) -> None:
    done = _srun(slurm_cluster, ["-N1", "-n2"], ["--model", "toy", "--backend", "gloo"],
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    assert done.returncode == 0, _report(done)
    # Each task is a rank of one process group; rank 0 alone reports.
    assert "ranks: 2" in done.stdout and done.stdout.count("Naive DDP matches baseline!") == 1, _report(done)
