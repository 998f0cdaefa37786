"""The source-reading tests' parser survives a collection whose finalizer formats a traceback."""

from __future__ import annotations

import ast
import gc
import sys
import traceback
from collections.abc import Callable

from fixtures.source import parse_python

SOURCE = "\n".join(f"def f{i}(a, b):\n    return [a + b for _ in range(a)] or {{b: a}}" for i in range(400))


class _LogsATracebackWhenCollected:
    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        try:
            [0][1] + [0][1]
        except IndexError:
            traceback.format_exc()  # 3.11 parses the failing line to place its carets


def _parse_amid_garbage(parse: Callable[[str], ast.Module]) -> int:
    failures = 0
    threshold = gc.get_threshold()
    gc.set_threshold(50)
    try:
        for _ in range(20):
            for _ in range(100):
                _LogsATracebackWhenCollected()
            try:
                parse(SOURCE)
            except SystemError:
                failures += 1
    finally:
        gc.set_threshold(*threshold)
        gc.collect()
    return failures


#: fixed in 3.11.8 and 3.12.2 (python/cpython#113476, #113472)
SHARED_DEPTH_COUNT = (3, 11) <= sys.version_info[:3] < (3, 11, 8) or (3, 12) <= sys.version_info[:3] < (3, 12, 2)


def test_plain_ast_parse_fails_when_a_collection_formats_a_traceback_only_where_cpython_shares_the_count() -> None:
    # the fault the helper exists for, produced for real on this interpreter
    assert (_parse_amid_garbage(ast.parse) > 0) == SHARED_DEPTH_COUNT


def test_parse_python_survives_the_same_garbage() -> None:
    assert _parse_amid_garbage(parse_python) == 0
    assert isinstance(parse_python(SOURCE), ast.Module)
