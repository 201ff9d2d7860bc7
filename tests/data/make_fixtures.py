"""Regenerate the trace fixtures in this folder from the hand-built scenarios of tests/test_analyzers_formats.py.

Run from the repository root: ``python tests/data/make_fixtures.py``. The expected numbers live beside the
scenarios (``EAGER_EXPECTED``, ``GRAPH_EXPECTED``); ``cupti_graph.kprof`` also pins the .kprof version-1 layout.
"""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

from test_analyzers_formats import eager, graph, write_kineto, write_kprof, write_nsys  # noqa: E402

if __name__ == "__main__":
    write_kineto(eager(), HERE / "kineto_eager.json")
    (HERE / "nsys_graph.sqlite").unlink(missing_ok=True)
    write_nsys(graph(), HERE / "nsys_graph.sqlite")
    write_kprof(graph(), HERE / "cupti_graph.kprof")
