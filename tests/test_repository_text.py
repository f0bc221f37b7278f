"""The repository speaks to its users: nothing points outside it, no machine's paths, no
development log.

Every tracked text file is read as a reader on the hosting page would read it:

* no reference to files beside the checkout (the shared folder one level up) and no
  absolute path of one machine (under its work, root or home folders): write
  ``~/.cache/...``, a path relative to the repository, or a placeholder such as ``MODEL_DIR``;
* in documentation, code, comments and scripts (``.md``, ``.py``, ``.sh``, ``Makefile``), no
  development history: no "session N", "round N", "issue N" / "issue #N", and no commit hash
  written into the text. Say what the code does and why; git keeps the history.

``ALLOWED`` lists the few exact lines that may keep a match, each with its reason.
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Dict, List, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# documentation, code and scripts: where development history must not be written
PROSE_FILES = re.compile(r"(\.md|\.py|\.sh)$|(^|/)Makefile$")

# a file beside the checkout (the shared folder one level up), or an absolute path of one machine
OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w.~-])/(?:work|root|home)/")

# a session, round or issue named by its number or order (examples in the test below)
HISTORY = re.compile(
    r"\b(?:sessions?|rounds?|issues?)\s+#?\d+"
    r"|\bissue\s*#\s*\d+"
    r"|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth)\s+session\b",
    re.IGNORECASE,
)

# a commit hash: 7-40 hex digits with at least one digit and one letter, standing alone (not
# inside a longer word, a number with an exponent, a 64-digit checksum or a 0x literal)
COMMIT = re.compile(r"(?<![\w.+/-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])")

# (path, a substring of the line) -> why the match is not what the test is after
ALLOWED: Dict[Tuple[str, str], str] = {}


def tracked_files() -> List[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError):  # pragma: no cover - not a git checkout
        pytest.skip("not a git checkout")
    return [p for p in out.decode().split("\0") if p]


def _text(path: str) -> str | None:
    full = os.path.join(ROOT, path)
    if not os.path.isfile(full) or os.path.getsize(full) > 8 * 2**20:
        return None
    with open(full, "rb") as f:
        data = f.read()
    if b"\0" in data:
        return None  # binary: weights, images
    return data.decode("utf-8", errors="replace")


def find(pattern: re.Pattern, only: re.Pattern | None = None) -> List[str]:
    """``path:line: text`` for every match not in ``ALLOWED``."""
    hits = []
    for path in tracked_files():
        if only is not None and not only.search(path):
            continue
        if path == "tests/test_repository_text.py":
            continue  # this file spells the patterns out
        text = _text(path)
        if text is None:
            continue
        lines = text.splitlines()
        seen = set()
        # over the whole text: a phrase may wrap ("issue" at a line's end, "16" on the next)
        for m in pattern.finditer(text):
            n = text.count("\n", 0, m.start()) + 1
            line = lines[n - 1] if n <= len(lines) else ""
            if n in seen or any(p == path and s in line for (p, s) in ALLOWED):
                continue
            seen.add(n)
            hits.append(f"{path}:{n}: {line.strip()[:160]}")
    return hits


def test_nothing_points_outside_the_repository():
    hits = find(OUTSIDE)
    assert not hits, (
        "references to files outside the repository or to one machine's paths (write "
        "~/.cache/..., a repository-relative path or a placeholder):\n" + "\n".join(hits)
    )


def test_no_development_history_in_docs_code_or_scripts():
    hits = find(HISTORY, PROSE_FILES)
    assert not hits, (
        "development history in the text (say what the code does and why; git keeps the "
        "history):\n" + "\n".join(hits)
    )


def test_no_commit_hashes_in_docs_code_or_scripts():
    hits = find(COMMIT, PROSE_FILES)
    assert not hits, "commit hashes in the text (git keeps the history):\n" + "\n".join(hits)


# build outputs and downloads a checkout rebuilds or fetches: never tracked
BUILD_OUTPUT = re.compile(r"\.(?:whl|egg|tar\.gz|tar\.xz|zip|pt|bin|gguf)$|(^|/)(?:dist|build)/")

# the shipped draft and length heads are the largest files the repository keeps (~2.4 MB)
MAX_TRACKED_BYTES = 4 * 2**20


def test_no_build_outputs_or_large_files_tracked():
    found = [p for p in tracked_files() if BUILD_OUTPUT.search(p)]
    big = [
        f"{p} ({os.path.getsize(os.path.join(ROOT, p)) / 2**20:.1f} MiB)"
        for p in tracked_files()
        if os.path.isfile(os.path.join(ROOT, p))
        and os.path.getsize(os.path.join(ROOT, p)) > MAX_TRACKED_BYTES
    ]
    assert not found, "build outputs or downloads tracked (rebuild or fetch them):\n" + "\n".join(
        found
    )
    assert not big, "files over 4 MiB tracked (weights and data are rebuilt):\n" + "\n".join(big)


@pytest.mark.parametrize(
    "line, pattern",
    [
        ("the paper is in ../" "shared/docs/paper.md", OUTSIDE),
        ("see /" "work/main/README.md", OUTSIDE),
        ("cache under /" "root/.cache/spexis", OUTSIDE),
        ("Round " "7 (2026-12-02)", HISTORY),
        ("this session " "4 run", HISTORY),
        ("issue " "#6's correctness", HISTORY),
        ("(issue " "16 item 2)", HISTORY),
        ("in the third session", HISTORY),
        ("as measured in (issue\n    16)", HISTORY),
        ('"before" = main at `3d60d11`', COMMIT),
        ("fixed in d8ab06b.", COMMIT),
    ],
)
def test_the_patterns_catch_what_they_are_for(line, pattern):
    assert pattern.search(line)


@pytest.mark.parametrize(
    "line, pattern",
    [
        ("SPEXIS_CACHE_DIR moves ~/.cache/spexis", OUTSIDE),
        ("relative paths such as benchmark/results/x.json", OUTSIDE),
        ("a round trip of 2 ms", HISTORY),
        ("rounds up to 64", HISTORY),
        ("eps 9.999999747378752e-06", COMMIT),
        ("token id 999999999", COMMIT),
        ("sha256 " + "ab12" * 16, COMMIT),
        ("the 0xdeadbeef marker", COMMIT),
        ("a decoded word: acceded", COMMIT),
    ],
)
def test_the_patterns_leave_ordinary_text_alone(line, pattern):
    assert not pattern.search(line)
