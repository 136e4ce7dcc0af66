"""Plans are a function of the cost graph: a refactor of the passes must not change one.

The stored cost graphs of the zoo are planned again with every strategy and budget and
compared with the plans stored when the snapshot was written (:mod:`tests.plan_snapshot`).
"""

import json

import pytest

from tests.plan_snapshot import SNAPSHOT, graph_from_data, plans_of

ENTRIES = json.loads(SNAPSHOT.read_text())


@pytest.mark.full_solver_time  # ResNet's `optimal` is an exact schedule: a shorter solve may not find it
@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_zoo_plans_unchanged(name):
    entry = ENTRIES[name]
    graph = graph_from_data(entry["graph"])
    assert plans_of(graph) == entry["plans"], (
        f"{name}: a plan changed; if that is meant, rewrite the snapshot with "
        "`python -m tests.plan_snapshot` and say why in the commit")
