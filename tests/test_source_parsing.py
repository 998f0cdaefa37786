"""The source-reading tests' parser survives a collection whose finalizer formats a traceback."""

from __future__ import annotations

import ast

from fixtures.source import SHARED_DEPTH_COUNT, failures_amid_garbage, parse_python

SOURCE = "\n".join(f"def f{i}(a, b):\n    return [a + b for _ in range(a)] or {{b: a}}" for i in range(400))


def test_plain_ast_parse_fails_when_a_collection_formats_a_traceback_only_where_cpython_shares_the_count() -> None:
    # the fault the helper exists for, produced for real on this interpreter
    assert (failures_amid_garbage(lambda: ast.parse(SOURCE)) > 0) == SHARED_DEPTH_COUNT


def test_parse_python_survives_the_same_garbage() -> None:
    assert failures_amid_garbage(lambda: parse_python(SOURCE)) == 0
    assert isinstance(parse_python(SOURCE), ast.Module)
