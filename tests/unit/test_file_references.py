"""Every Python file the package, the tests and the docs name (``catch_up.py``, ``node/run_layout.py``) exists: a
module moved or renamed leaves no docstring, comment or page pointing at a file that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("noloco_node", "benchmarks", "tests", "docs", "deploy")
NAMED_FILE = re.compile(r"(?<![\w/.-])([\w/]+\.py)\b")


def _repository_files() -> list[Path]:
    files = [path for top in SOURCES for path in (ROOT / top).rglob("*") if path.is_file()]
    return [*files, *ROOT.glob("*.md")]


def test_every_python_file_named_in_code_tests_and_docs_exists() -> None:
    files = _repository_files()
    relative = {path.relative_to(ROOT).as_posix() for path in files}
    names = {path.name for path in files}
    missing = []
    for path in files:
        if path.suffix not in (".py", ".md") or "_pb2" in path.name:
            continue
        for match in NAMED_FILE.finditer(path.read_text(encoding="utf-8")):
            named = match.group(1)
            known = any(p.endswith(named) for p in relative) if "/" in named else named in names
            if not known:
                missing.append(f"{path.relative_to(ROOT)}: {named}")
    assert not missing, "files named but not in the repository:\n" + "\n".join(sorted(set(missing)))
