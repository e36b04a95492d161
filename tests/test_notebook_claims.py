"""Every number in a notebook's prose is one the prose may state.

A measured figure typed into markdown drifts from the rows it came from; a code cell prints it
instead (``lab.result_sentence`` for the recorded GPU rows). So a number in a markdown cell must
be one of:

- a target, written as such ("target >= 1.2x", "the targets: at most 20 µs");
- a cost-model input: a literal that also appears in a code cell of the same notebook;
- structural: part of a name (bf16, H100, fp32, ``01_sync``), a notebook, section or phase
  number, a numbered list's marker, a version.

Fenced code blocks in markdown are code shown to the reader, not claims: they are not read.

The prose is also held to a reading time: a word limit per notebook and for the workbook.
"""

from __future__ import annotations

import io
import json
import re
import tokenize
from pathlib import Path

import pytest

NOTEBOOKS = sorted(
    (Path(__file__).resolve().parent.parent / "notebooks").glob("[0-9][0-9]_*.ipynb")
)
NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?", re.IGNORECASE)
FENCED = re.compile(r"```.*?```", re.DOTALL)
SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n\s*\n|\n(?=\s*(?:[*-]|\d+\.) )")
PLACE = re.compile(
    r"\b(?:notebooks?|sections?|phases?|§|versions?|torch|python|triton|cuda|pytorch)"
    r"(?:\s*(?:\d+[a-z]?|,|and|or|to|-|–))*\s*$",
    re.IGNORECASE,
)
TARGET = re.compile(
    r"\btargets?\s*(?:is|of|:)?\s*(?:>=|<=|≥|≤|at least|at most)?\s*$", re.IGNORECASE
)
BOUND = re.compile(r"(?:>=|<=|≥|≤|\bat least|\bat most|\bwithin)\s*$", re.IGNORECASE)
# 2 hours at the reading rate the workbook's first 17,200 markdown words in 3.3 hours imply.
WORKBOOK_WORDS = 10_400
# The workbook's limit shared evenly over its ten notebooks.
NOTEBOOK_WORDS = 1_040


def cells_of(path: Path) -> list[tuple[str, str]]:
    """(cell type, source) of every cell of a notebook file."""
    return [(c["cell_type"], "".join(c["source"])) for c in json.loads(path.read_text())["cells"]]


def markdown_words(path: Path) -> int:
    """Whitespace-split words of a notebook's markdown cells (the code shown in them included)."""
    return sum(len(source.split()) for kind, source in cells_of(path) if kind == "markdown")


def code_literals(cells: list[tuple[str, str]]) -> set[float]:
    """Every number literal in the code cells (cell magics and shell lines skipped)."""
    found = set()
    for kind, source in cells:
        if kind != "code":
            continue
        source = "\n".join(
            line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))
        )
        try:
            tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        except (tokenize.TokenError, SyntaxError):
            continue
        found |= {float(t.string.replace("_", "")) for t in tokens if t.type == tokenize.NUMBER}
    return found


def allowed(sentence: str, match: re.Match, literals: set[float]) -> bool:
    before, after = sentence[: match.start()], sentence[match.end() :]
    if after.startswith("_") or re.fullmatch(r"0\d", match.group()):
        return True  # a notebook: 01_sync, 00 to 09
    if re.match(r"\s*·", after) or (not before.strip() and re.match(r"\.(\s|$)", after)):
        return True  # a section heading's number, a numbered list's marker
    if PLACE.search(before):
        return True  # notebook 08, sections 2 and 3, phases 1-3, torch 2.13
    if TARGET.search(before) or (
        BOUND.search(before) and re.search(r"\b(?:targets?|judge[sd]?)\b", sentence, re.IGNORECASE)
    ):
        return True  # a target, written as such
    return float(match.group().replace(",", "")) in literals


def sentences(markdown: str) -> list[str]:
    return [s.strip() for s in SENTENCE_END.split(FENCED.sub(" ", markdown)) if s.strip()]


def unbacked_numbers(path: Path) -> list[str]:
    """'notebook, cell N: number in: sentence' for every number the prose may not state."""
    cells = cells_of(path)
    literals = code_literals(cells)
    found = []
    for index, (kind, source) in enumerate(cells):
        if kind != "markdown":
            continue
        for sentence in sentences(source):
            for match in NUMBER.finditer(sentence):
                if not allowed(sentence, match, literals):
                    found.append(
                        f"{path.stem}, cell {index}: {match.group()} in: {' '.join(sentence.split())}"
                    )
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_number_in_the_prose_is_a_target_an_input_or_structural(path):
    found = unbacked_numbers(path)
    assert not found, "numbers the prose may not state:\n" + "\n".join(found)


def test_the_workbook_reads_in_about_two_hours():
    counts = {path.stem: markdown_words(path) for path in NOTEBOOKS}
    total = sum(counts.values())
    table = "\n".join(f"  {stem}: {words:,}" for stem, words in counts.items())
    too_long = [stem for stem, words in counts.items() if words > NOTEBOOK_WORDS]
    assert len(counts) == 10, table
    assert not too_long and total <= WORKBOOK_WORDS, (
        f"markdown words per notebook (at most {NOTEBOOK_WORDS:,} each, {WORKBOOK_WORDS:,} in all; "
        f"{total:,} now; over: {', '.join(too_long) or 'none'}):\n{table}"
    )


def claims_in(markdown: str, code: str = "") -> list[str]:
    literals = code_literals([("code", code)])
    return [
        m.group()
        for s in sentences(markdown)
        for m in NUMBER.finditer(s)
        if not allowed(s, m, literals)
    ]


def test_a_measured_figure_in_prose_is_caught():
    assert claims_in("On the H100 the window runs 2.58x faster, in 70.9 ms.") == ["2.58", "70.9"]
    assert claims_in("Launches cost about 14 µs each and the cap is 3,000 GB/s.") == ["14", "3,000"]


def test_targets_inputs_and_names_pass():
    prose = (
        "## 2 · The model\n\nThe target >= 1.2x holds on an H100 in bf16, notebook 04 and "
        "`01_sync` tell why (phases 1-3, torch 2.13). The targets: at most 20 µs a call. "
        "Each window has 64 steps."
    )
    assert claims_in(prose, code="steps = 64") == []
    assert claims_in("Each window has 64 steps.", code="steps = 32") == ["64"]


def test_a_fenced_block_is_code_not_a_claim():
    assert claims_in("Use it:\n\n```python\nclip(params, 1.0)\n```\n") == []
