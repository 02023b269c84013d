"""The repository reads as a product, not as a work log: no numbered work-log labels (a work period's or a
tracker item's name followed by its number) in tracked text, no dates in the docs' or code's prose, and no measured timings in the library's comments and
docstrings (they go stale; docs/benchmarks.md holds the figures, by topic). History lives in git."""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".ini", ".yml", ".yaml", ".json", ".jinja", ""}
# Data, not prose: recorded fixtures (generated text, configs, logits); and this file, whose patterns name labels.
SKIPPED = ("tests/fixtures/", "tests/test_repository.py")

# The words a work log numbers, and the words that point at a work period relative to now.
LOG_WORDS = ("sess" + "ion", "iss" + "ues?")
RELATIVE = ("this", "last", "next", "earlier", "previous")
WORK_LOG_LABEL = re.compile(r"\b(?i:" + "|".join(LOG_WORDS) + r")[ -]\d+"
                            + r"|\b(?:" + "|".join(RELATIVE) + r") " + LOG_WORDS[0] + r"\b")
ISO_DATE = re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b")
# A measured time: milli- or microseconds; a range of seconds or minutes ("60-69 s"); seconds next to a
# comparison ("28 -> 19 s", "15 s against 6 s"). Timeouts a comment explains ("up to 5 minutes", "10 s here")
# are settings, not measurements, and pass.
MEASURED_TIME = (
    re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|µs|us)\b"),
    re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?-\s?\d+(?:\.\d+)?\s?(?:s|sec|seconds|min|minutes)\b"),
)
SECONDS = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:s|sec|seconds)\b")
COMPARISON = re.compile(r"->|\bagainst\b|\bvs\.?\s")


def tracked_text_files() -> list[str]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split("\0")
    return [name for name in names if name and Path(name).suffix in TEXT_SUFFIXES
            and not name.startswith(SKIPPED) and (ROOT / name).is_file()]


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line, text) of a Python file's comments and docstrings."""
    source = path.read_text(encoding="utf-8")
    lines = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                first = node.body[0].lineno
                lines += [(first + offset, text) for offset, text in enumerate(docstring.splitlines())]
    return lines


def quotes_a_measured_time(text: str) -> bool:
    return (any(pattern.search(text) for pattern in MEASURED_TIME)
            or bool(SECONDS.search(text) and COMPARISON.search(text)))


def test_no_work_log_labels_in_tracked_files():
    found = []
    for name in tracked_text_files():
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{name}:{number}: {line.strip()[:120]}" for number, line in enumerate(text.splitlines(), 1)
                  if WORK_LOG_LABEL.search(line)]
    assert not found, "numbered work-log labels (say what the code does and why, not when):\n" + "\n".join(found)


def test_no_dates_in_docs_or_code_prose():
    found = []
    for name in tracked_text_files():
        path = ROOT / name
        if path.suffix == ".md":
            lines = list(enumerate(path.read_text(encoding="utf-8").splitlines(), 1))
        elif path.suffix == ".py":
            lines = prose_lines(path)
        else:
            continue
        found += [f"{name}:{number}: {line.strip()[:120]}" for number, line in lines if ISO_DATE.search(line)]
    assert not found, "dated text (history lives in git):\n" + "\n".join(found)


def test_no_measured_timings_in_library_comments():
    found = []
    for name in tracked_text_files():
        if name.endswith(".py") and name.startswith(("moe_jax/", "converters/")):
            found += [f"{name}:{number}: {text.strip()[:120]}" for number, text in prose_lines(ROOT / name)
                      if quotes_a_measured_time(text)]
    assert not found, ("measured times in comments go stale; point to docs/benchmarks.md's section by topic "
                       "instead:\n" + "\n".join(found))


@pytest.mark.parametrize(("text", "flagged"), [
    ("# train step 464 -> 438 ms", True),
    ("# the same start: 60-69 s the first time", True),
    ("# 16 layers: 15 s against 6 s scanned", True),
    ("# 0.51 -> 0.21 ms", True),
    ("alive for up to 5 minutes; `heartbeat_timeout_seconds` (10 s here, JAX's default is 100 s)", False),
    ("text with lone UTF-16 surrogates are all 400s", False),
    ("# 8 experts top-2, bf16", False),
])
def test_the_timing_pattern_tells_measurements_from_settings(text, flagged):
    assert quotes_a_measured_time(text) == flagged


def test_the_benchmark_report_is_a_report_and_its_sections_are_the_ones_cited():
    """docs/benchmarks.md stays a current report (history is in git), and every pointer to one of its sections
    by name (the report's path, a comma, the section's name in double quotes) names a section it has."""
    report = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert len(report.splitlines()) <= 600
    sections = {line.lstrip("#").strip() for line in report.splitlines() if line.startswith("## ")}
    cited = re.compile(r'benchmarks\.md[,;]?\s+"([^"]+)"')
    missing = []
    for name in tracked_text_files():
        text = (ROOT / name).read_text(encoding="utf-8", errors="replace")
        # A pointer may wrap: join the comment markers and line breaks out of the way.
        flat = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)
        missing += [f"{name}: {topic!r}" for topic in cited.findall(flat) if topic not in sections]
    assert not missing, f"pointers to sections docs/benchmarks.md does not have ({sorted(sections)}):\n" + \
        "\n".join(missing)


def test_the_readme_is_a_front_page():
    """README.md stays a user's front page (what, install, the two commands, examples, links); details live in
    the guides under docs/."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 180
    assert "moe-jax demo" in readme and "python -m pytest tests -q -n 2 --dist loadfile" in readme


# A library module longer than this holds more than one job: split it by job (docs/design.md, "How the code is
# laid out").
MAX_MODULE_LINES = 450


def test_no_library_module_is_over_the_line_limit():
    lengths = {file.relative_to(ROOT).as_posix(): len(file.read_text(encoding="utf-8").splitlines())
               for package in ("moe_jax", "converters") for file in sorted((ROOT / package).rglob("*.py"))}
    long = {path: lines for path, lines in lengths.items() if lines > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
