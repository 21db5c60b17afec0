"""Smoke tests of ``examples/``: each script runs in a subprocess with a tiny budget (as cleanrl's).

Each test runs its own script, one at a time, under a deadline that grows with the machine's load: the
suite must pass on a 2-core machine busy with other work (all the scripts started at once, each importing
torch, once overran a fixed deadline there, and the pipes of the killed ones leaked into other tests).
"""

from __future__ import annotations

import dataclasses
import os
import re
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

CASES = {
    "quickstart": ["quickstart.py", "--total-frames", "2000", "--num-envs", "4"]
    + ["--frames-per-batch", "400", "--uvloop"],
    "replay_buffer": ["replay_buffer.py", "--total-frames", "2400", "--frames-per-batch", "400"]
    + ["--learning-starts", "400", "--checkpoint-every", "2"],
    # the serial backend runs the same worker code in threads; test_multi.py covers processes
    # gymnasium's default (next-step) async vector env, with RecordEpisodeStatistics read from info
    "vector_envs": ["vector_envs.py", "--total-frames", "2000", "--vectorization", "async"],
    "multi_sync_ppo_style": ["multi_sync_ppo_style.py", "--total-frames", "2048"]
    + ["--frames-per-batch", "1024", "--envs-per-worker", "4", "--backend", "serial"],
    # the sinks that are installed (tensorboard: the test extra; wandb: nox -s sinks), into a temp dir
    "logging_sinks": ["logging_sinks.py", "--total-frames", "2000", "--frames-per-batch", "400"]
    + ["--every", "0.2", "--logdir", str(Path(tempfile.gettempdir()) / "aiocollect-example-runs")],
    # REINFORCE on whole episodes (trajs_per_batch)
    "episodes": ["episodes.py", "--total-frames", "3000", "--trajs-per-batch", "4"],
    # group-relative advantages on groups of episodes from one initial state (group_size)
    "groups": ["groups.py", "--total-frames", "3000"],
    "groups_workers": ["groups.py", "--total-frames", "3000", "--workers", "2", "--on-update", "restart"],
    "recurrent_policy": ["recurrent_policy.py", "--total-frames", "2000", "--frames-per-batch", "400"],
    "multi_async_onpolicy": ["multi_async_onpolicy.py", "--total-frames", "2048"]
    + ["--frames-per-update", "512", "--backend", "serial"],
    "async_envs": ["async_envs.py", "--total-frames", "4000", "--num-envs", "200"]
    + ["--frames-per-batch", "1000"],
    "async_envs_processes": ["async_envs.py", "--total-frames", "4000", "--num-envs", "200"]
    + ["--frames-per-batch", "1000", "--processes", "2"],
    "async_envs_vector": ["async_envs.py", "--total-frames", "4000", "--num-envs", "200"]
    + ["--frames-per-batch", "1000", "--vector-envs", "4"],
    # 2 env worker processes, the policy in the trainer (central inference over shared memory)
    "central_inference": ["central_inference.py", "--total-frames", "2560", "--frames-per-batch", "512"]
    + ["--envs-per-worker", "8"],
    "central_inference_split": ["central_inference.py", "--total-frames", "2560", "--frames-per-batch"]
    + ["512", "--envs-per-worker", "8", "--split"],
    # a fresh checkpoint file (an old one would be resumed); preemption: test_signals.py
    "long_run": ["long_run.py", "--total-frames", "2000", "--frames-per-batch", "400"]
    + ["--checkpoint", str(Path(tempfile.mkdtemp(prefix="aiocollect-long-run-")) / "run.pt")],
    # 2 env server processes, the policy served too
    "remote_envs": ["remote_envs.py", "--total-frames", "2000", "--frames-per-batch", "500"]
    + ["--envs-per-server", "4", "--remote-policy"],
    # docs/why-slow.md: the env-bound run as documented (defaults), the others smaller
    "why_slow": ["why_slow.py"],
    "why_slow_policy": ["why_slow.py", "--case", "policy", "--total-frames", "400", "--width", "256"],
    "why_slow_trainer": ["why_slow.py", "--case", "trainer", "--total-frames", "400", "--train-ms", "5"],
    "why_slow_handoff": ["why_slow.py", "--case", "handoff", "--total-frames", "320"],
    # an env that crashes about once every 800 steps, restarted (RestartPolicy)
    "restarts": ["restarts.py", "--total-frames", "4000", "--crash-every", "800"],
    # the multiagent extra: MAPPO on MPE simple_spread, self-play on tic-tac-toe
    "multiagent_mappo": ["multiagent_mappo.py", "--total-frames", "4000", "--frames-per-batch", "2000"],
    "multiagent_selfplay": ["multiagent_selfplay.py", "--total-frames", "4000", "--frames-per-batch", "2000"]
    + ["--eval-every", "1", "--eval-frames", "400"],
}


def scaled_timeout(seconds: float) -> float:
    """``seconds`` on an idle machine, stretched by the load per core (at most 5x)."""
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return seconds * min(5.0, max(1.0, load))


def run_example(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``examples/<argv[0]> argv[1:]``; our own warnings (e.g. a budget that is not a multiple of the
    batch) are UserWarnings, made errors. ``subprocess.run`` closes the pipes and kills on a timeout."""
    script, *flags = argv
    return subprocess.run(
        [sys.executable, "-W", "error::UserWarning", str(EXAMPLES / script), *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


#: the variants of an example the default suite leaves to ``nox -s longrun`` (it runs the example's default)
LONGRUN_CASES = {"why_slow_policy", "why_slow_trainer", "why_slow_handoff"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.longrun if n in LONGRUN_CASES else pytest.mark.examples)
        for n in CASES
    ],
)
def test_example_runs(name: str) -> None:
    """Each example end to end in a subprocess (``nox -s examples``; its variants in ``nox -s longrun``)."""
    proc = run_example(CASES[name], scaled_timeout(100))
    assert proc.returncode == 0, proc.stderr
    assert "frames/s" in proc.stdout, proc.stdout
    assert "mean return" in proc.stdout, proc.stdout


def example_args(path: Path) -> object | None:
    """The defaults of an example's ``Args`` dataclass (the script's ``__main__`` block does not run)."""
    namespace = runpy.run_path(str(path), run_name="example_under_test")
    args = namespace.get("Args")
    return args() if args is not None and dataclasses.is_dataclass(args) else None


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_example_defaults_collect_whole_batches(path: Path) -> None:
    """An example run as documented (no flags) must not warn about its own budget."""
    args = example_args(path)
    total = getattr(args, "total_frames", None)
    batch = getattr(args, "frames_per_batch", None)
    if not total or not batch or total < 0:
        pytest.skip("no frame budget")
    assert total % batch == 0, (
        f"{path.name}: total_frames={total} is not a multiple of frames_per_batch={batch}"
    )
    workers = getattr(args, "num_workers", None) or getattr(args, "nodes", None) or 1
    for size in ("num_envs", "envs_per_worker", "envs_per_node"):
        envs = getattr(args, size, None)
        if envs and path.name != "async_envs.py":  # async envs fill flat batches of any size
            share = batch // workers  # a synchronous collector's share per worker (the strictest case)
            assert share % envs == 0, f"{path.name}: {share} frames are not whole steps of {envs} envs"


# examples that start distributed engines (and need the distributed/ray extras): nox -s distributed
DISTRIBUTED_CASES = {
    f"distributed {' '.join(flags)}".strip(): ["distributed.py", "--total-frames", "4096", *flags]
    for flags in ([], ["--sync"], ["--engine", "rpc"], ["--engine", "ray"], ["--launcher", "submitit"])
}


@pytest.mark.distributed
@pytest.mark.timeout(1300)
@pytest.mark.parametrize("name", list(DISTRIBUTED_CASES))
def test_distributed_example_runs(name: str) -> None:
    script, *flags = DISTRIBUTED_CASES[name]
    if "ray" in flags:
        pytest.importorskip("ray")
    if "submitit" in flags:
        pytest.importorskip("submitit")
    proc = run_example([script, *flags], scaled_timeout(240))
    assert proc.returncode == 0, proc.stderr
    assert "frames/s" in proc.stdout and "mean return" in proc.stdout, proc.stdout
    assert "frames    4096" in proc.stdout, proc.stdout  # the whole budget, batch by batch
    assert "published v2" in proc.stdout, proc.stdout
    assert "the nodes' time: env " in proc.stdout, proc.stdout  # their time split reached the trainer


def test_every_example_is_tested() -> None:
    scripts = {argv[0] for argv in [*CASES.values(), *DISTRIBUTED_CASES.values()]}
    assert scripts == {path.name for path in EXAMPLES.glob("*.py")}


# -- the docs' code blocks are examples too ---------------------------------------------------------

ROOT = EXAMPLES.parent
# pages whose every ```python block is a complete program (a block after <!-- continue --> extends the one
# before it; <!-- skip --> before a block leaves out a fragment): add a page here once its blocks run
RUNNABLE_PAGES = [
    "index",
    "conventions",
    "collector",
    "envs",
    "policies",
    "async-envs",
    "serve",
    "long-runs",
    "episodes",
    "faults",
    "multiagent",
]
DOC_PAGES = [ROOT / "README.md", *(ROOT / "docs" / f"{name}.md" for name in RUNNABLE_PAGES)]
_BLOCK = re.compile(r"(<!-- (continue|skip) -->\s*\n)?^```python[^\n]*\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The page's ```python blocks as (line, source): a block after ``<!-- continue -->`` is appended
    to the one before it (they run as one program)."""
    groups: list[tuple[int, str]] = []
    for match in _BLOCK.finditer(text):
        marker, code = match.group(2), match.group(3)
        if marker == "skip":
            continue
        if marker == "continue" and groups:
            groups[-1] = (groups[-1][0], groups[-1][1] + "\n" + code)
        else:
            groups.append((text[: match.start(3)].count("\n") + 1, code))
    return groups


DOC_BLOCKS = [
    pytest.param(page, source, id=f"{page.name}:{line}")
    for page in DOC_PAGES
    for line, source in python_blocks(page.read_text())
]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("page", "source"), DOC_BLOCKS)
def test_doc_code_block_runs(page: Path, source: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", source],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, f"{page.name}:\n{source}\n{proc.stderr}"


def test_api_page_lists_every_public_name() -> None:
    import aiocollect

    api = (ROOT / "docs" / "api.md").read_text()
    # a lazily exported name is documented at its module's path: ::: aiocollect._private.Name
    documented = set(re.findall(r"^::: aiocollect(?:\.\w+)*\.(\w+)$", api, re.M))
    missing = [name for name in aiocollect.__all__ if name not in documented]
    assert not missing, f"docs/api.md lacks {missing}"
