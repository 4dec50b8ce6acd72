"""Every Python block of README.md and docs/*.md runs as written; the other blocks are listed, with why.

pytest-examples finds the blocks and runs each as a module (with tracebacks pointing at the Markdown line). Each
block runs in its own empty working directory, so the checkpoints and files it writes go there. Blocks are
whole programs: nothing is injected into their globals. A block that starts a process group (docs/distributed.md)
runs in a fresh Python process with the environment torchrun would give it, for a world of one process
(re-initialising a process group in one process can hang: pytorch/pytorch#55967, #74666).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.rendezvous import rendezvous_env

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
    "docs/api.md": ["text"] * 6,  # signatures
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


def _marked(example):
    # a block marked test="cuda" is a GPU test: skipped without CUDA (conftest), run by `pytest -m gpu`; a block
    # that starts a process group runs in a process of its own (seconds): slow
    cuda = example.prefix_settings().get("test") == "cuda"
    marks = [pytest.mark.gpu] if cuda else []
    return pytest.param(
        example,
        id=_id(example),
        marks=[*marks, pytest.mark.slow] if "init_process_group" in example.source else marks,
    )


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
    with rendezvous_env(1) as meeting:
        env = {**os.environ, **meeting}
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
    package = re.search(r"^python -m pip install -q (-e '\.\[[a-z0-9,]+\]')$", ci, re.M).group(1)
    blocks = re.findall(r"^```bash\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    test_blocks = [b.splitlines() for b in blocks if command in b.splitlines()]
    assert len(test_blocks) == 1, f"one README bash block runs {command!r}"
    block = test_blocks[0]
    assert block[-1] == command
    assert f"pip install {torch_pin} --index-url https://download.pytorch.org/whl/cpu" in block
    assert f"pip install {package}" in block


# --- the API reference: every public name, Config field, Engine member and constructor option is in it ---------
API = ROOT / "docs" / "api.md"


def _api_section(heading: str) -> str:
    """The text of docs/api.md's ``## `` section whose heading contains ``heading``."""
    sections = re.split(r"^## ", API.read_text(), flags=re.M)
    found = [text for text in sections if heading in text.splitlines()[0]]
    assert len(found) == 1, f"docs/api.md has no single '## ' section headed {heading!r}"
    return found[0]


def _named(text: str, name: str) -> bool:
    """``name`` in a code span (``name``, ``module.name``, ``name(...)``) or as ``name=`` / ``name:`` in a signature."""
    return re.search(rf"`(?:[\w.]+\.)?{re.escape(name)}\b|\b{re.escape(name)}(?:=|: )", text) is not None


def _options(*functions) -> list[str]:
    """The parameters a caller may pass by name: keyword-only ones and those with a default."""
    names = []
    for function in functions:
        for p in inspect.signature(function).parameters.values():
            keyword = p.kind is p.KEYWORD_ONLY or (
                p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not p.empty
            )
            if keyword and p.name not in names:
                names.append(p.name)
    return names


def _constructors(cls, stop) -> list:
    """The ``__init__`` of ``cls`` and of its bases up to ``stop`` (the contract's, whose arguments the strategies
    pass): the options a subclass passes on by ``**``."""
    return [k.__init__ for k in cls.__mro__[: cls.__mro__.index(stop)] if "__init__" in vars(k)]


def _missing(text: str, names) -> list[str]:
    return [name for name in names if not _named(text, name)]


def test_api_reference_names_every_public_name():
    import halfprec
    import halfprec.distributed
    import halfprec.optim

    text = API.read_text()
    for module in (halfprec, halfprec.optim, halfprec.distributed):
        missing = _missing(text, module.__all__)
        assert not missing, f"docs/api.md lacks {missing} of {module.__name__}.__all__"


def test_api_reference_has_every_config_field():
    import dataclasses

    from halfprec import Config

    section = _api_section("`Config`")
    missing = [
        f.name for f in dataclasses.fields(Config) if not re.search(rf"^\| `{f.name}` \|", section, re.M)
    ]
    assert not missing, f"docs/api.md's Config table lacks the fields {missing}"


def test_api_reference_has_every_engine_member():
    import halfprec

    model = torch.nn.Linear(2, 2)
    engine = halfprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    members = [n for n in dir(halfprec.Engine) if not n.startswith("_")]
    attributes = [n for n in vars(engine) if not n.startswith("_")]
    missing = _missing(_api_section("`Engine`"), members + attributes)
    assert not missing, f"docs/api.md's Engine section lacks {missing}"
    missing = _missing(_api_section("`halfprec.initialize`"), _options(halfprec.initialize))
    assert not missing, f"docs/api.md's initialize section lacks the options {missing}"


def test_api_reference_has_every_constructor_option():
    import halfprec
    import halfprec.optim
    from halfprec.distributed import ShardedMixedPrecisionOptimizer

    mp = halfprec.MixedPrecisionOptimizer
    exact = halfprec.optim.ExactMixedPrecisionOptimizer
    fused = [getattr(halfprec.optim, name) for name in halfprec.optim.__all__ if name.startswith("Fused")]
    sections = {
        # MixedPrecisionOptimizer(...) is halfprec.optim.build(...): its options are the factory's
        "`MixedPrecisionOptimizer`": _options(halfprec.optim.build, *_constructors(exact, mp)),
        "`ShardedMixedPrecisionOptimizer`": _options(*_constructors(ShardedMixedPrecisionOptimizer, mp)),
        "Loss scalers": _options(halfprec.DynamicLossScaler, halfprec.StaticLossScaler),
        "Fused optimizers": _options(*(init for cls in fused for init in _constructors(cls, mp))),
    }
    for heading, options in sections.items():
        missing = _missing(_api_section(heading), options)
        assert not missing, f"docs/api.md's {heading} section lacks the options {missing}"


# --- what a reader can open: sizes, links, and provenance instead of how the code came about -------------------
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
RAW = ROOT / "benchmarks" / "results"
PROSE = [*MARKDOWN, RESULTS]


def test_readme_and_results_stay_short():
    assert (ROOT / "README.md").stat().st_size <= 10 * 1024, "README.md: at most 10 KB"
    assert RESULTS.stat().st_size <= 20 * 1024, "benchmarks/RESULTS.md: at most 20 KB"
    raw = sorted(p.name for p in RAW.iterdir())
    assert len(raw) <= 20, (
        f"benchmarks/results/: at most 20 raw files (one per benchmark and date), got {raw}"
    )


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _anchors(path: Path) -> set[str]:
    """The ids GitHub gives the headings of ``path``: lower case, punctuation dropped, spaces as hyphens,
    a repeated id suffixed -1, -2, ..."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#+ (.*)$", _without_code_blocks(path.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n, unique = 0, slug
        while unique in anchors:
            n += 1
            unique = f"{slug}-{n}"
        anchors.add(unique)
    return anchors


@pytest.mark.parametrize("path", PROSE, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_code_blocks(path.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)} links to what is not there: {broken}"


# How the project was developed is not the reader's business: work periods, device calls, tracker numbers, files
# outside the repository. Dates, devices, versions and commits say where a figure came from.
NARRATION = re.compile(
    r"\bsessions?\b|\bcalls? \d|\bissues? #?\d|\bwork period|\bour earlier\b|\.\./shared/|\bdesign\.md\b",
    re.I,
)


def test_docs_and_results_give_provenance_not_history():
    files = [*PROSE, *sorted((ROOT / "benchmarks").glob("*.py"))]
    found = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in files
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if NARRATION.search(line)
    ]
    assert not found, "\n".join(found)
    names = [
        p.name for p in RAW.iterdir() if re.search(r"_(s\d+|call\d*|final|keep|all|[a-c])(_|\.)", p.name)
    ]
    assert not names, f"raw result files named after how they were made, not what and when: {names}"
