"""Developer sessions: ``nox -s tests``, ``lint``, ``typecheck``, ``docs``, ``bench``, ``bench_core``,
``slow``, ``distributed``, ``realenvs``, ``torchrl``, ``bench_torchrl``, ``browser``, ``bench_dashboard``,
``soak``, ``package``, ``minimum_versions``, ``newest_python``, ``timing``, ``under_load``.

torch is pinned in the same pip command as everything that depends on it, so pip takes the CPU wheel that
the machine already has instead of pulling a multi-GB CUDA build.

The default suite runs three times in CI, each run under one loop per async test (``--loop-tier``, see
tests/conftest.py): the README's test command (tier 0, also every loop of the ``all_loops`` tests),
``minimum_versions`` (tier 1) and ``newest_python`` (tier 2): between them every test meets asyncio,
asyncio + uvloop and trio.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.default_venv_backend = "venv"

TORCH = "torch==2.13.0"
PYTHON = "3.11"
#: the README's test command's option (CI runs it as written): tier 0 of the loop rotation
README_TIER = "--loop-tier=0"
#: the README's test command runs the tests in two processes (pytest-xdist): the suite waits about half
#: its time, so two at once keep 2 cores busy; the suite's other runs (minimum_versions, newest_python,
#: examples, longrun) take it too
PARALLEL = ("-n", "2")
#: the marker expressions of the tiers that .ci/run runs in the README's virtualenv (the sessions below
#: run the same in their own); a ``timing`` test is never part of a tier's verdict
EXAMPLES = "examples and not timing"
LONGRUN = "longrun and not timing"
#: the speed figures this session's extras can run (the distributed ones: ``nox -s distributed -- -m
#: "distributed and timing"``)
TIMING = "timing and not (distributed or torchrl or realenvs or envpool or wandb or slow)"
#: the newest Python on our machines (tested by ``newest_python``; keep the README in sync)
NEWEST_PYTHON = "3.13"


def _interpreter(version: str) -> str:
    """``version``'s interpreter by path where pyenv installed it: pyenv's ``python3.13`` shim refuses to run
    a version that is not selected (CI's machines select 3.11 only), so nox would not find it by name."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", f"python{version}"))

    def patch(path: str) -> int:  # 3.13.10 after 3.13.9
        digits = re.match(r"\d*", path.split(f"{version}.")[1]).group()
        return int(digits or 0)

    return max(found, key=patch) if found else version


def install(session: nox.Session, *extras: str) -> None:
    spec = f".[{','.join(extras)}]" if extras else "."
    session.install(TORCH, "-e", spec)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The default suite as the README's test command runs it (``--loop-tier=0``: one loop per async test,
    every loop for the ``all_loops`` ones); plain ``pytest`` with no option runs every loop everywhere."""
    install(session, "test")
    session.run("python", "-m", "pytest", README_TIER, *PARALLEL, *session.posargs)


@nox.session(python=PYTHON)
def under_load(session: nox.Session) -> None:
    """The default suite (the README's test command) while another process keeps one core busy (a Python
    busy loop, started before the suite and killed after it): run it before stopping whenever tests or
    concurrency changed. A test whose verdict depends on time fails here first."""
    install(session, "test")
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        session.run("python", "-m", "pytest", README_TIER, *PARALLEL, *session.posargs)
    finally:
        burner.kill()
        burner.wait()


@nox.session(python=PYTHON)
def timing(session: nox.Session) -> None:
    """The speed figures (tests marked ``timing``: how long a fault takes to surface, a restart, a close; the
    loop's lag; shares of time): run alone on a quiet machine, each checked against its bound, the figures
    printed at the end. Not part of the default suite nor of CI's gate (a figure is not a verdict)."""
    install(session, "test")
    session.run(
        "python", "-m", "pytest", "-m", TIMING, README_TIER, "-p", "no:cacheprovider", *session.posargs
    )


@nox.session(python=PYTHON)
def browser(session: nox.Session) -> None:
    """Only the end-to-end dashboard test in headless Chromium (needs /usr/bin/chromium: apt-get install
    chromium; the default suite runs it too when Chromium is there)."""
    install(session, "test")
    session.run("python", "-m", "pytest", "-m", "browser", "-v", *session.posargs)


@nox.session(python=PYTHON)
def bench_dashboard(session: nox.Session) -> None:
    """Frames/s with and without two connected dashboard clients (benchmarks/dashboard.py)."""
    install(session, "dashboard")
    session.run("python", "benchmarks/dashboard.py", *session.posargs)


@nox.session(python=PYTHON)
def sinks(session: nox.Session) -> None:
    """The W&B sink's tests (marked ``wandb``: the offline run of tests/test_sinks.py and
    examples/logging_sinks.py) with both backends installed; the default suite runs the other sink tests,
    with tensorboard only."""
    install(session, "test", "tensorboard", "wandb")
    session.run("python", "-m", "pytest", "-m", "wandb and not timing", "-v", *session.posargs)


@nox.session(python=PYTHON)
def slow(session: nox.Session) -> None:
    """Tests marked slow."""
    install(session, "test")
    session.run("python", "-m", "pytest", "-m", "slow and not timing", *session.posargs)


@nox.session(python=PYTHON)
def examples(session: nox.Session) -> None:
    """Every example end to end in a subprocess (tests/test_examples.py, marked ``examples``; CI runs
    them in the README's virtualenv: ``pytest -m examples``)."""
    install(session, "test")
    session.run("python", "-m", "pytest", "-m", EXAMPLES, *PARALLEL, *session.posargs)


@nox.session(python=PYTHON)
def longrun(session: nox.Session) -> None:
    """Tests marked longrun: graceful stops on real signals and resumed runs (examples/long_run.py), each in
    subprocesses, under asyncio, uvloop and trio, and the variants of examples/why_slow.py (the default suite
    runs one case of each; CI runs them in the README's virtualenv: ``pytest -m longrun``)."""
    install(session, "test")
    session.run("python", "-m", "pytest", "-m", LONGRUN, *PARALLEL, *session.posargs)


@nox.session(python=PYTHON)
def distributed(session: nox.Session) -> None:
    """Tests marked distributed: DistributedWeightSync, DistributedCollector and RPCCollector over gloo and
    TensorPipe on 127.0.0.1, submitit's local executor, RayCollector on a local Ray cluster, and
    examples/distributed.py with each engine (no GPU, no
    cluster needed)."""
    install(session, "test", "distributed", "ray")
    session.run(
        "python",
        "-m",
        "pytest",
        "-m",
        "distributed and not timing",
        *session.posargs,
        env={
            "MASTER_ADDR": "127.0.0.1",
            "GLOO_SOCKET_IFNAME": "lo",
            "TP_SOCKET_IFNAME": "lo",
            "RAY_USAGE_STATS_ENABLED": "0",
        },
    )


@nox.session(python=PYTHON)
def realenvs(session: nox.Session) -> None:
    """Tests marked realenvs: ALE/Pong-v5 and MuJoCo HalfCheetah-v5 collected by every collector, with the
    data invariants checked (tests/test_real_envs.py; needs the bench extra: ale-py, mujoco), and the tests
    marked envpool (the envpool extra; the default suite leaves them out): only these, no default-suite
    test again."""
    install(session, "test", "bench", "envpool")
    session.run(
        "python", "-m", "pytest", "-m", "(realenvs or envpool) and not slow and not timing", *session.posargs
    )


@nox.session(python=PYTHON)
def tensordict014(session: nox.Session) -> None:
    """The suite against tensordict 0.14.x, the range torchrl 0.14 needs."""
    session.install(TORCH, "tensordict>=0.14.3,<0.15", "-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy on src/."""
    install(session, "test")
    session.install("mypy>=1.10")
    session.run("mypy")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the docs with mkdocs --strict (warnings fail)."""
    install(session, "docs")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """Soak run (benchmarks/soak.py): 2 workers x 32 envs, a weight update every batch, memory, fds and
    shared-memory segments sampled each minute; ``nox -s soak -- --minutes 3`` for a shorter one,
    ``nox -s soak -- --faults --minutes 5`` for issue 28's soak (env faults, a worker killed every 30 s)."""
    install(session)
    session.install("psutil>=5.9")
    session.run("python", "benchmarks/soak.py", *session.posargs)


TORCHRL = ("torchrl==0.14.*", "tensordict>=0.14.3,<0.15")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """The benchmark matrix of docs/benchmarks.md (benchmarks/matrix.py): CartPole, Pendulum, MuJoCo and
    Atari envs, each collector against the raw gymnasium loop and torchrl 0.14's collectors, in one run
    (``nox -s bench -- --quick --markdown``). torchrl 0.14 needs tensordict 0.14.x: both libraries run
    on it here."""
    session.install(TORCH, *TORCHRL, "-e", ".[bench]")
    session.run("python", "benchmarks/matrix.py", *session.posargs)


@nox.session(python=PYTHON)
def bench_core(session: nox.Session) -> None:
    """The first benchmark (benchmarks/run.py): Collector against the raw loop, CartPole and Pendulum, plain
    module policy, and the event-loop lag while collecting (see benchmarks/README.md)."""
    install(session)
    session.run("python", "benchmarks/run.py", *session.posargs)


@nox.session(python=PYTHON)
def torchrl(session: nox.Session) -> None:
    """The torchrl interop tests (pytest -m torchrl) beside torchrl 0.14, which needs tensordict 0.14.x."""
    session.install(TORCH, *TORCHRL, "-e", ".[test]")
    session.run("python", "-m", "pytest", "-m", "torchrl and not timing", *session.posargs)


@nox.session(python=PYTHON)
def bench_torchrl(session: nox.Session) -> None:
    """Side-by-side benchmarks against torchrl's collectors (see docs/benchmarks-torchrl.md)."""
    session.install(TORCH, *TORCHRL, "-e", ".[test]")
    session.run("python", "benchmarks/vs_torchrl.py", *session.posargs)


@nox.session(python=PYTHON)
def package(session: nox.Session) -> None:
    """What ``pip install aiocollect`` gives a user with no extras: build the sdist and the wheel
    (``python -m build``), install the wheel alone (its base dependencies, torch pinned) into this session's
    fresh virtualenv, then, from outside the source tree, import every public module, run 1,000-frame
    collectors and check that each extra's entry point names its extra when missing
    (tests/check_installed.py); and check that every import of ``import aiocollect`` is declared
    (shared/tools/check_declared_imports.py, where the shared folder is beside the repo)."""
    session.install("build>=1.2")
    dist = Path(session.create_tmp()) / "dist"
    # the build belongs to the install step (run_install): `nox --install-only` builds and installs the
    # wheel, and `nox -R` (no install) then checks the wheel installed then
    session.run_install("python", "-c", "import shutil, sys; shutil.rmtree(sys.argv[1], True)", str(dist))
    session.run_install("python", "-m", "build", "--sdist", "--wheel", "--outdir", str(dist))
    sdists, wheels = glob.glob(str(dist / "*.tar.gz")), glob.glob(str(dist / "*.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        session.error(f"expected one sdist and one wheel in {dist}, got {sdists + wheels}")
    session.install(TORCH, wheels[0])
    root = Path.cwd()
    session.run("python", str(root / "tests" / "check_installed.py"), external=False, env={"PYTHONPATH": ""})
    checker = root.parent / "shared" / "tools" / "check_declared_imports.py"
    if checker.exists():
        session.run("python", str(checker), "aiocollect.compat", "aiocollect.dashboard")


def dependency_floors() -> list[str]:
    """``name==floor`` for each of pyproject.toml's direct dependencies (the version after its ``>=``)."""
    pins = []
    for requirement in tomllib.loads(Path("pyproject.toml").read_text())["project"]["dependencies"]:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([^,;\s]+).*", requirement)
        if match is None:
            raise ValueError(f"dependency {requirement!r} has no >= floor to test")
        pins.append(f"{match[1]}=={match[2]}")
    return pins


@nox.session(python=PYTHON)
def minimum_versions(session: nox.Session) -> None:
    """The default suite on the lowest versions ``pyproject.toml`` claims for its direct dependencies (each
    ``>=`` floor, pinned exactly: torch's floor is a CUDA build from PyPI, which runs on the CPU), so that
    no floor is claimed untested. The test tools come on top of those pins (pip may not move them)."""
    floors = dependency_floors()
    constraints = Path(session.create_tmp()) / "floors.txt"
    constraints.write_text("\n".join(floors) + "\n")
    session.install(*floors)
    session.install("-c", str(constraints), "-e", ".[test]")
    # the versions installed (a uv-made virtualenv has no pip to list them)
    listing = (
        "import importlib.metadata as m; print(*sorted(f'{d.name}=={d.version}' for d in m.distributions()))"
    )
    session.run("python", "-c", listing)
    # mypy --strict on the examples reads the installed libraries' type stubs: older numpy and gymnasium
    # stubs differ (not a run-time matter), so that one test runs against the newest versions only
    typing = "--deselect=tests/test_typing.py::test_examples_and_a_user_script_pass_mypy_strict"
    # tier 1 of the loop rotation: each async test under the loop the README's run and newest_python do not
    # take for it
    session.run(
        "python",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        typing,
        "--loop-tier=1",
        *PARALLEL,
        *session.posargs,
    )


@nox.session(python=_interpreter(NEWEST_PYTHON))
def newest_python(session: nox.Session) -> None:
    """The default suite on the newest Python here (torch 2.13.0 for it comes from PyPI: a CUDA build that
    runs on the CPU), tier 2 of the loop rotation (the README's run and minimum_versions take the others)."""
    install(session, "test")
    session.run(
        "python", "-m", "pytest", "-p", "no:cacheprovider", "--loop-tier=2", *PARALLEL, *session.posargs
    )
