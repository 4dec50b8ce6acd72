"""Every Python block of README.md and docs/*.md runs as written; the other blocks are listed, with why.

pytest-examples finds the blocks and runs each as a module (with tracebacks pointing at the Markdown line). Each
block runs in its own empty working directory, so the checkpoints and files it writes go there. Blocks are
whole programs: nothing is injected into their globals. A block that starts a process group (docs/distributed.md)
gets the environment torchrun would give it, for a world of one process.
"""

from __future__ import annotations

import re
import socket
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


@pytest.mark.parametrize("example", EXAMPLES, ids=_id)
def test_block_runs(example, eval_example, tmp_path, monkeypatch):
    if example.prefix_settings().get("test") == "cuda" and not torch.cuda.is_available():
        pytest.skip("the block needs a CUDA device")
    for module in re.findall(r"^(?:from|import) (accelerate|transformers|lightning)\b", example.source, re.M):
        pytest.importorskip(module, reason=f"{module} is in the [integrations] extra")
    monkeypatch.chdir(tmp_path)
    # pytest-examples runs the block as __main__ and leaves it in sys.modules; later spawned processes read it.
    monkeypatch.setitem(sys.modules, "__main__", sys.modules["__main__"])
    threads = torch.get_num_threads()
    distributed = "init_process_group" in example.source
    if distributed:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1"}
        for name, value in {**env, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
            monkeypatch.setenv(name, value)
    try:
        eval_example.run(example)
    finally:
        torch.set_num_threads(threads)
        if distributed and torch.distributed.is_initialized():  # the block failed before tearing it down
            torch.distributed.destroy_process_group()


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = ci[ci.index("# The README's test command:") + 1]
    assert (
        f"```bash\npip install torch==2.13.0 && pip install -e '.[test,triton,demo,integrations]'\n{command}\n```"
        in (ROOT / "README.md").read_text()
    )
    assert "python -m pip install -q -e '.[test,triton,demo,integrations]'" in ci  # the same extras
