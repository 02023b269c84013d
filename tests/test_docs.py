"""The code blocks README.md and docs/*.md mark runnable run as written, on the committed tiny checkpoint.

A block is runnable when the line before its ```python fence is `<!-- runnable -->`: it runs here as a script's
`__main__` in an empty directory of its own, on 8 virtual CPU devices, with the placeholder `path/to/checkpoint`
read as the committed tiny Qwen3-MoE. The blocks run one after another in one fresh process (a process each would
import JAX and the library once per block). `<!-- runnable: tests/PATH.py -->` says another test runs it (with inputs of its
own); that test must exist and name the document.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHECKPOINT_PLACEHOLDER = "path/to/checkpoint"
CHECKPOINT = ROOT / "tests" / "fixtures" / "models" / "qwen3_moe"
BLOCK = re.compile(r"^<!-- runnable(?:: (?P<runner>\S+))? -->\n```python\n(?P<code>.*?)^```", re.S | re.M)
PRELUDE = "from moe_jax.host_devices import use_cpu_devices\nuse_cpu_devices(8)\n"


def runnable_blocks() -> list[tuple[str, int, str | None, str]]:
    """(document, block number, the test that runs it or None, code) of every block marked runnable."""
    blocks = []
    for document in DOCUMENTS:
        for number, match in enumerate(BLOCK.finditer(document.read_text(encoding="utf-8")), 1):
            blocks.append((str(document.relative_to(ROOT)), number, match["runner"], match["code"]))
    return blocks


BLOCKS = runnable_blocks()


def test_every_guide_has_runnable_examples():
    documents = {document for document, *_ in BLOCKS}
    assert {"README.md", "docs/parallelism.md", "docs/training.md", "docs/inference.md",
            "docs/checkpoints.md"} <= documents, documents


def test_a_marker_names_the_block_that_follows():
    """A marker not directly above a ```python fence would silently mark nothing."""
    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        assert text.count("<!-- runnable") == len(BLOCK.findall(text)), document


# Runs each block as `__main__` in its own empty directory, in order; writes {block id: None or the traceback}
# after each block, so a block that ends the process still leaves the earlier blocks' results.
DRIVER = """import gc, json, os, sys, traceback
from moe_jax.host_devices import use_cpu_devices
use_cpu_devices(8)
blocks, results_path = json.loads(open(sys.argv[1]).read()), sys.argv[2]
results = {}
for name, directory, code in blocks:
    os.chdir(directory)
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
        results[name] = None
    except BaseException:
        results[name] = traceback.format_exc()
    gc.collect()
    with open(results_path, "w") as out:
        json.dump(results, out)
"""


def block_id(document: str, number: int) -> str:
    return f"{document}-{number}"


@pytest.fixture(scope="module")
def block_runs(tmp_path_factory) -> tuple[dict[str, str | None], str]:
    """Every runnable block without a runner of its own, run in one fresh process -> ({block id: None, or the
    traceback it raised}, the process's stderr tail)."""
    root = tmp_path_factory.mktemp("runnable_blocks")
    blocks = []
    for document, number, runner, code in BLOCKS:
        if runner is None:
            directory = root / block_id(document, number).replace("/", "_")
            directory.mkdir()
            blocks.append((block_id(document, number), str(directory),
                           code.replace(CHECKPOINT_PLACEHOLDER, str(CHECKPOINT))))
    (root / "blocks.json").write_text(json.dumps(blocks))
    (root / "driver.py").write_text(DRIVER)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(root / "driver.py"), str(root / "blocks.json"),
                             str(root / "results.json")], cwd=root, capture_output=True, text=True, timeout=1200,
                            env=environment)
    results = json.loads((root / "results.json").read_text()) if (root / "results.json").exists() else {}
    return results, f"exit code {result.returncode}:\n{result.stderr[-3000:]}"


@pytest.mark.parametrize(("document", "number", "runner", "code"), BLOCKS,
                         ids=[block_id(document, number) for document, number, *_ in BLOCKS])
def test_runnable_block(document, number, runner, code, request):
    if runner is not None:
        runner_text = (ROOT / runner).read_text(encoding="utf-8")
        assert document in runner_text, f"{runner} does not read {document}"
        return
    results, process = request.getfixturevalue("block_runs")
    name = block_id(document, number)
    assert name in results, f"{name}: the blocks' process ended before this block ran ({process})"
    assert results[name] is None, f"{document}, runnable block {number}:\n{results[name][-3000:]}"


def test_pointers_to_a_guides_section_name_a_section_it_has():
    """`docs/NAME.md, "Section"` (or `docs/NAME.md "Section"`) anywhere in the docs, code or tests names a
    heading of that document."""
    pointer = re.compile(r'(docs/[\w-]+\.md),?\s+"([^"]+)"')
    headings = {}
    for document in DOCUMENTS:
        lines = document.read_text(encoding="utf-8").splitlines()
        headings[str(document.relative_to(ROOT))] = {line.lstrip("#").strip() for line in lines if line.startswith("#")}
    files = [*DOCUMENTS, *ROOT.glob("moe_jax/**/*.py"), *ROOT.glob("converters/**/*.py"), *ROOT.glob("tests/**/*.py"),
             *ROOT.glob("scripts/**/*.py")]
    missing = []
    for path in files:
        flat = re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text(encoding="utf-8", errors="replace"))
        missing += [f"{path.relative_to(ROOT)}: {target} {section!r}" for target, section in pointer.findall(flat)
                    if target in headings and section not in headings[target]]
    assert not missing, "\n".join(missing)


LAYOUT_PICTURE = re.compile(r"^```bash\n(?P<command>moe-jax layout [^\n]*)\n```\n\n```\n(?P<output>.*?)^```", re.S | re.M)


def test_a_layout_picture_is_what_the_command_prints(capsys):
    """A `moe-jax layout ...` command shown in a guide with a plain block after it: the block is its output."""
    from moe_jax.cli import main

    pictures = [(document, match) for document in DOCUMENTS
                for match in LAYOUT_PICTURE.finditer(document.read_text(encoding="utf-8"))]
    assert any(str(document).endswith("docs/parallelism.md") for document, _ in pictures), pictures
    for document, match in pictures:
        capsys.readouterr()
        assert main(match["command"].split()[1:]) == 0, match["command"]
        assert capsys.readouterr().out == match["output"], f"{document.relative_to(ROOT)}: {match['command']}"
