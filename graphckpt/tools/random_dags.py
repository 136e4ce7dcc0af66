"""A family of random cost graphs: the DAGs the planner is measured and property-tested on.

Pure networkx (no torch): ``scripts/planner_gap.py`` plans them against the exact MILP, and
the planner's tests draw them by seed, so "random DAG 11 of seed 0" names the same graph in
a test, a benchmark table and a note.

    >>> import random
    >>> graph = random_cost_graph(random.Random(0), 16)
    >>> sum(1 for _, kind in graph.nodes(data="kind") if kind == "op")
    16
"""

from __future__ import annotations

import random

import networkx as nx

from passes.costgraph import add_value


def random_cost_graph(rng: random.Random, ops: int) -> nx.DiGraph:
    """A random DAG: each op reads the previous one and sometimes an earlier value (skips).
    Marked ``measured``, as a model's graph costed from example inputs is: no op draws
    random numbers, so selective segments may run by saved-tensor hooks."""
    graph = nx.DiGraph(measured=True)
    add_value(graph, "x", kind="input", order=0, bytes=64, requires_grad=False)
    names = ["x"]
    for index in range(ops):
        reads = {names[-1]}
        if index > 1 and rng.random() < 0.3:
            reads.add(rng.choice(names[:-1]))
        name = f"op{index}"
        flops = rng.choice([1, 10, 100])
        add_value(graph, name, kind="op", order=index + 1, bytes=rng.choice([64, 128, 256]),
                  reads=sorted(reads), flops=flops, saved=tuple(sorted(reads)),
                  expensive=flops == 100)  # the "matmuls": what selective segments keep
        names.append(name)
    readers = {u for u, _ in graph.edges}
    add_value(graph, "output", kind="output", order=ops + 1, bytes=0,
              reads=[n for n in names[1:] if n not in readers])
    return graph
