"""Comments and docstrings state rules; the evidence behind a rule lives in docs/method.md.

A comment says what the code does and why, in the present tense. What was measured to find
that out (a benchmark landscape's figures, a run on real GPUs, a CI run, an incident, the way
things used to be) goes into the table of docs/method.md, "Evidence", and the comment may point
there. This test reads every comment and docstring of our packages and fails on the tell-tale
shapes of such a story. Names of hardware that code models (an H200's memory, its peak FLOPs)
are not a story and do not match.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from support import REPO

pytestmark = pytest.mark.fast
PACKAGES = ("search", "spaces", "objectives", "launchers")


#: landscape names that are also ordinary words or our own identifiers: a mention says nothing
_COMMON_NAMES = frozenset({"default", "slow_start"})


def _landscape_names() -> list[str]:
    files = [*(REPO / "launchers" / "simulator" / "landscapes").glob("*.yaml"), *(REPO / "benchmarks" / "blind").glob("*.yaml")]
    return sorted({p.stem for p in files} - _COMMON_NAMES)


#: (what the story is, its shape). Each catches a class of sentence, not one sentence.
PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("an incident's number", re.compile(r"\b(?:stop|incident) \d+\b")),
    ("a CI run", re.compile(r"\bCI run\b(?! ?the\b)|\bCI,? (?:run|job|stop) ?#?\d+")),
    ("a run on a named GPU", re.compile(r"\b(?:on|in|from) (?:the|an?|one|a real) [AHB]\d00s?\b(?!/)|\bthe [AHB]\d00's\b"
                                         r"|(?:^|[\s(#])[AHB]\d00: ")),
    ("a simulated benchmark's figure", re.compile(r"\b(?:in|on) the simulated benchmark\b|\bsimulated benchmark (?:lost|kept|ended|showed|found|measured)\b"
                                                  r"|\bsimulated [\w+-]+ worlds?\b")),
    ("a landscape's figure", re.compile(r"\b(?:on|in|of) (?:the |a |one |two |three |\d+ )?(?:[\w-]+ )?(?:landscapes?|worlds?)\b"
                                        r"(?:[^.;:]|\.(?=\d))*?\d+(?:\.\d+)?(?: ?%| of \d+)"
                                        r"|\d+(?:\.\d+)?% (?:on|in) (?:the |a )?(?:[\w-]+ )?(?:landscapes?|worlds?)\b")),
    ("runs counted", re.compile(r"\b\d+ (?:of|in) \d+ runs\b|\b\d+/\d+ runs\b|(?<![-\w])rep \d+\b")),
    ("a share of the best", re.compile(r"\b\d\.\d+ of (?:the )?best\b")),
    ("a timing taken here", re.compile(r"\b\d[\d.,]* ?(?:s|ms|min|x|×|%) (?:here\b|on (?:this|a|the|one) (?:machine|server|host|GPU)\b)"
                                       r"|\b(?:took|was|were) [\d.,]+ ?(?:s|ms|min|minutes|x)\b(?! a\b)")),
    ("history", re.compile(r"\b[Uu]ntil release\b|(?<!been )(?<!yet )(?<!were )(?<!was )(?<!is )(?<!are )(?<!be )\bused to\b"
                           r"|\bbefore the change\b|\b[Tt]aken back on the way\b")),
)


def _files() -> list[Path]:
    found = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    return sorted(found + list((REPO / "benchmarks").glob("*.py")))


def _texts(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every comment block (consecutive comment lines as one) and
    every docstring."""
    out: list[tuple[int, str]] = []
    block: list[str] = []
    start = last = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        if block and line != last + 1:
            out.append((start, " ".join(block)))
            block = []
        if not block:
            start = line
        block.append(tok.string.lstrip("#:").strip())
        last = line
    if block:
        out.append((start, " ".join(block)))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                out.append((node.body[0].lineno, doc))
    return [(line, re.sub(r"\s+", " ", text)) for line, text in out]


def narratives(source: str, landscapes: list[str]) -> list[tuple[int, str, str]]:
    """(line, what, the matched words) for each story in ``source``'s comments and docstrings."""
    named = re.compile(r"(?<![\w/])`{0,2}(?:" + "|".join(map(re.escape, landscapes)) + r")`{0,2}(?![\w/.])") if landscapes else None
    found = []
    for line, text in _texts(source):
        for what, pattern in PATTERNS:
            m = pattern.search(text)
            if m:
                found.append((line, what, m.group(0)))
        if named and (m := named.search(text)):
            found.append((line, "a landscape named", m.group(0)))
    return found


def _scan() -> dict[str, list[tuple[int, str, str]]]:
    landscapes = _landscape_names()
    hits = {}
    for path in _files():
        rel = path.relative_to(REPO).as_posix()
        found = narratives(path.read_text(encoding="utf-8"), landscapes)
        if found:
            hits[rel] = found
    return hits


def test_comments_state_rules_not_stories() -> None:
    hits = _scan()
    lines = [f"{rel}:{line}: {what}: {words!r}" for rel, found in hits.items() for line, what, words in found]
    assert not lines, (
        "a comment or docstring tells a story instead of a rule; keep the rule in the code and move "
        "the evidence to docs/method.md, Evidence:\n" + "\n".join(lines)
    )


@pytest.mark.parametrize(
    "text",
    [
        "# (CI, stop 34) answered too many clients",
        "# CI run 3 counted one",
        "# on the H200 a candidate at η 0.859 read within 2%",
        "# on one H200 with a 0.36B model the GPU sat idle",
        "# the H200's 11-step probes reported once",
        "# H200: all the probe's stderr says",
        "# in the simulated benchmark the best lr was the bound",
        "# On the simulated 3x-noise world a true +6% gain stayed at 0.77",
        "# what the polish can add is small (true 1.5-3% on the coupled worlds)",
        "# (on the report landscapes true 4-7% gains of the mini-batch stage)",
        "# the simulated benchmark lost 2 of 10 runs on two worlds",
        "# (oom_sharp rep 4: tokens stage 0.881 → 0.838 of best)",
        "# at 50 steps the pruner stopped every candidate of kl_edge",
        "# a PostgreSQL restart takes seconds (2.3 s here)",
        "# summaries would read every trial (26 s on a server with 480)",
        "# which took 94 s for 10,000 on SQLite",
        "# Until release 0de9162 a stage's result held a sentence",
        "# the space used to take the baseline's fraction",
    ],
)
def test_a_story_matches(text: str) -> None:
    assert narratives(text + "\n", _landscape_names()), text


@pytest.mark.parametrize(
    "text",
    [
        "PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16\n",
        '"""One GPU\'s memory in GB (80 for an A100/H100 80 GB, 141 for an H200)."""\n',
        "# CI runs the newest Optuna in range, where the fork test fails on such a release\n",
        "# Round down to two significant figures: 106,496 → 100,000; 91,136 → 91,000.\n",
        "# the files of benchmarks/blind not yet used to change the method\n",
        "# The default landscape models 8 GPUs per run (7B on 8×A100)\n",
        "# python benchmarks/diagnose.py LANDSCAPE [--reps 3] [--first-rep 0]\n",
        '"""Runs each landscape on the simulated-time ReplayLauncher."""\n',
        '"""Parameters of one simulated world; build with load_landscape."""\n',
        "# per landscape and method, the runs whose final choice reaches 95% of the best\n",
        "# stop early on a study whose baseline is near-optimal: after 3 flat stages\n",
        "# ``slow_start``: a learning stage after a slow start, 4 times longer\n",
        "# a dead address fails in about 20 s, two attempts (docs/method.md, Evidence)\n",
    ],
)
def test_a_rule_does_not_match(text: str) -> None:
    assert not narratives(text, _landscape_names()), text
