"""docs/reliability.md's bad-input table cannot drift: each case's test checks its own row
(bad_input_table.record), and here every row must still belong to a test that records it."""

from __future__ import annotations

import re

from bad_input_table import CASE_ID, DOC, HEADER, REPO, rows, size_line, table_lines


def test_every_row_is_recorded_by_a_test():
    text = DOC.read_text()
    lines = table_lines(text)
    assert lines[: len(HEADER)] == HEADER
    found = rows(text)
    assert len(found) == len([x for x in lines if x.startswith("|")]) - len(HEADER), "a case has two rows"
    assert list(found) == sorted(found), "rows out of order: regenerate them (tests/bad_input_table.py)"
    sources = "\n".join(p.read_text() for p in (REPO / "tests").rglob("*.py"))

    def recorded(case: str) -> bool:  # the whole id, or its name when a test builds the id (f"data/{name}")
        return any(re.search(rf"[\"']{re.escape(c)}[\"']", sources) for c in (case, case.split("/")[1]))

    orphans = [case for case in found if not CASE_ID.fullmatch(case) or not recorded(case)]
    assert not orphans, f"rows no test records (remove them from {DOC.name}): {orphans}"


def test_the_doc_states_the_table_size():
    text = DOC.read_text()
    assert table_lines(text)[-1] == size_line(len(rows(text)))
