"""benchmark/results/: every file loads, is named by what it measures, is cited by the docs,
and every path the docs cite exists; the headline numbers of benchmark/README.md are the
files' own."""

from __future__ import annotations

import os
import re
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BENCH = os.path.join(ROOT, "benchmark")
RESULTS = os.path.join(BENCH, "results")
sys.path.insert(0, BENCH)

import read_results  # noqa: E402


def _doc_files():
    docs = [os.path.join(ROOT, "README.md")]
    for folder in ("docs", "benchmark"):
        for base, _, files in os.walk(os.path.join(ROOT, folder)):
            if os.path.join("benchmark", "results") in base:
                continue
            docs += [os.path.join(base, f) for f in files if f.endswith(".md")]
    return [d for d in docs if os.path.isfile(d)]


def _results_files():
    out = []
    for base, _, files in os.walk(RESULTS):
        out += [os.path.relpath(os.path.join(base, f), RESULTS) for f in files]
    return sorted(out)


def test_every_results_json_loads():
    names = read_results.names()
    assert len(names) > 20
    for name in names:
        assert read_results.load(name) is not None, name
    with pytest.raises(FileNotFoundError, match="no results file"):
        read_results.load("no_such_result")


# suffixes that name a moment in development, not a measurement
DEVELOPMENT_SUFFIX = re.compile(
    r"(^|[_-])(s\d+[a-z]?|run\d+|round\d+|before|after|ab_loop\d*|loop\d+|old|new|tmp)([_.-]|$)"
)


def test_results_files_are_named_by_what_they_measure():
    bad = [f for f in _results_files() if DEVELOPMENT_SUFFIX.search(os.path.basename(f))]
    assert not bad, f"results files named after a moment in development: {bad}"


def test_every_results_file_is_cited_by_the_docs():
    text = "\n".join(open(d, encoding="utf-8").read() for d in _doc_files())
    uncited = [f for f in _results_files() if f.replace(os.sep, "/") not in text]
    assert not uncited, f"results files no document cites (delete or cite them): {uncited}"


# a markdown link target (and its #anchor), or a backticked repository path
_LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")
_PATH = re.compile(r"`((?:benchmark|docs|python|tests|scripts)/[\w./-]+\.(?:py|sh|md|json|png))`")


def _anchors(md_path: str) -> set:
    """The anchors a hosting page gives a markdown file's headings (GitHub's rule)."""
    out, fenced = set(), False
    for line in open(md_path, encoding="utf-8"):
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#+\s+(.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_every_path_the_docs_cite_exists():
    missing = []
    for doc in _doc_files():
        text = open(doc, encoding="utf-8").read()
        base = os.path.dirname(doc)
        for target, anchor in _LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            path = os.path.normpath(os.path.join(base, target)) if target else doc
            if not os.path.exists(path):
                missing.append(f"{os.path.relpath(doc, ROOT)}: {target}")
            elif anchor and path.endswith(".md") and anchor not in _anchors(path):
                missing.append(f"{os.path.relpath(doc, ROOT)}: {target}#{anchor}")
        for target in _PATH.findall(text):
            if "*" in target or "<" in target:
                continue
            if not os.path.exists(os.path.join(ROOT, target)):
                missing.append(f"{os.path.relpath(doc, ROOT)}: {target}")
    assert not missing, "documents cite paths that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    "name, model",
    [
        ("gpu/decode_llama-3.1-8b_no_graphs_analysis", "Llama-3.1-8B-shaped"),
        ("gpu/decode_qwen3-8b_no_graphs_analysis", "Qwen3-8B-shaped"),
    ],
)
def test_the_decode_table_quotes_the_analysis(name, model):
    """benchmark/README.md section 1: the geometric means are the analysis files' own."""
    readme = open(os.path.join(BENCH, "README.md"), encoding="utf-8").read()
    every = read_results.decode_ratios(name)
    large = read_results.decode_ratios(name, min_batch=128)
    for theta, label in ((0.76, "0.76"), (0.523, "0.523 (measured head)")):
        cells = [
            every[theta]["sp_over_pp"],
            large[theta]["sp_over_pp"],
            every[theta]["sp_over_tp"],
            every[theta]["measured_over_eq2"],
        ]
        row = f"| {model} | {label} | " + " | ".join(f"{c:.2f}" for c in cells) + " |"
        plain = readme.replace("**", "")
        assert row in plain, f"benchmark/README.md lacks the row {row!r}"
