"""Every Python block of README.md and docs/*.md runs as written; the other blocks are listed, with why.

pytest-examples finds the blocks and runs each as a module (with tracebacks pointing at the Markdown line). Each
block runs in its own empty working directory, so the checkpoints and files it writes go there. Blocks are
whole programs: nothing is injected into their globals. A block that starts a process group (docs/distributed.md)
runs in a fresh Python process with the environment torchrun would give it, for a world of one process
(re-initialising a process group in one process can hang: pytorch/pytorch#55967, #74666).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest_examples = pytest.importorskip("pytest_examples")

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = list(pytest_examples.find_examples(*MARKDOWN))

# Blocks that are not run, per file: shell commands (installing, the demo, the test suite itself, torchrun of
# examples/train_ddp.py, which tests/distributed/test_example.py runs). A new non-Python block must be added
# here on purpose.
NOT_RUN = {
    "README.md": [
        "bash",
        "bash",
    ],  # pip install + halfprec demo (tests/cli); pip install + pytest (this suite)
    "docs/distributed.md": ["bash"],  # torchrun examples/train_ddp.py (tests/distributed/test_example.py)
}


def _id(example) -> str:
    return f"{example.path.relative_to(ROOT)}:{example.start_line}"


def test_every_block_is_run_or_listed():
    fence = re.compile(r"^```(\S*)", re.M)
    for path in MARKDOWN:
        # [::2]: the opening fences (a closing fence has no language)
        languages = fence.findall(path.read_text())[::2]
        rel = str(path.relative_to(ROOT))
        assert [lang for lang in languages if lang != "python"] == NOT_RUN.get(rel, []), rel
        assert languages.count("python") == sum(e.path == path for e in EXAMPLES), rel


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _marked(example):
    # a block marked test="cuda" is a GPU test: skipped without CUDA (conftest), run by `pytest -m gpu`
    cuda = example.prefix_settings().get("test") == "cuda"
    return pytest.param(example, id=_id(example), marks=[pytest.mark.gpu] if cuda else [])


@pytest.mark.parametrize("example", [_marked(e) for e in EXAMPLES])
def test_block_runs(example, eval_example, tmp_path, monkeypatch):
    for module in re.findall(r"^(?:from|import) (accelerate|transformers|lightning)\b", example.source, re.M):
        pytest.importorskip(module, reason=f"{module} is in the [integrations] extra")
    monkeypatch.chdir(tmp_path)
    if "init_process_group" in example.source:
        _run_as_torchrun_would(example, tmp_path)
        return
    # pytest-examples runs the block as __main__ and leaves it in sys.modules; later spawned processes read it.
    monkeypatch.setitem(sys.modules, "__main__", sys.modules["__main__"])
    threads = torch.get_num_threads()
    try:
        eval_example.run(example)
    finally:
        torch.set_num_threads(threads)


def _run_as_torchrun_would(example, cwd: Path) -> None:
    """Run a block that starts a process group as rank 0 of a world of one, in a process of its own."""
    script = cwd / "block.py"
    # Blank lines first, so that a traceback's line numbers are the Markdown file's.
    script.write_text("\n" * (example.start_line) + example.source)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1")
    try:
        done = subprocess.run(
            [sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{_id(example)} did not finish in {e.timeout} s:\n{e.stderr}") from None
    assert done.returncode == 0, f"{_id(example)} exited {done.returncode}:\n{done.stderr[-4000:]}"


def test_readme_test_command_is_what_ci_runs():
    """The README's test block installs the torch version CI pins (its CPU build) and the package with CI's extras,
    then runs CI's test command, as its last line."""
    ci = (ROOT / ".ci" / "run").read_text()
    lines = ci.splitlines()
    command = lines[lines.index("# The README's test command:") + 1]
    torch_pin = re.search(r"^python -m pip install -q (torch==\S+)$", ci, re.M).group(1)
    package = re.search(r"^python -m pip install -q (-e '\.\[[a-z,]+\]')$", ci, re.M).group(1)
    blocks = re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    test_blocks = [b.splitlines() for b in blocks if command in b.splitlines()]
    assert len(test_blocks) == 1, f"one README bash block runs {command!r}"
    block = test_blocks[0]
    assert block[-1] == command
    assert f"pip install {torch_pin} --index-url https://download.pytorch.org/whl/cpu" in block
    assert f"pip install {package}" in block
