"""Planning time of each strategy, and of the optimal pass at a budget, on 1k and 10k nodes.

    python scripts/plan_time.py [--sizes 1000 10000]

Graphs are transformer-like: a residual stream where every block reads the stream, makes a
few values and adds back into it, so there are articulation points and skip edges.
"""

from __future__ import annotations

import argparse
import time

import networkx as nx

from passes.budget import fit_budget
from passes.costgraph import add_value
from passes.simulate import eager_peak
from passes.strategies import STRATEGIES


def residual_graph(nodes: int, block: int = 6) -> nx.DiGraph:
    """A residual chain of about ``nodes`` values, blocks of ``block`` ops each."""
    graph = nx.DiGraph()
    add_value(graph, "x", kind="input", order=0, bytes=4096, requires_grad=False)
    stream, order = "x", 1
    while order < nodes - 1:
        previous = stream
        for index in range(block - 1):
            name = f"v{order}"
            add_value(graph, name, kind="op", order=order, bytes=4096 * (1 + index % 3),
                      reads=[previous], flops=1000 * (1 + index % 2), saved=(previous,))
            previous, order = name, order + 1
        name = f"v{order}"
        add_value(graph, name, kind="op", order=order, bytes=4096, reads=[previous, stream], flops=10)
        stream, order = name, order + 1
    add_value(graph, "output", kind="output", order=order, bytes=0, reads=[stream])
    return graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    options = parser.parse_args()
    print("| nodes | " + " | ".join(STRATEGIES) + " | optimal, budget 0.25 |")
    print("|---:|" + "---:|" * (len(STRATEGIES) + 1))
    for size in options.sizes:
        graph = residual_graph(size)
        cells = []
        for strategy in STRATEGIES.values():
            start = time.perf_counter()
            strategy(graph)
            cells.append(f"{time.perf_counter() - start:.2f} s")
        start = time.perf_counter()
        fit_budget(graph, int(0.25 * eager_peak(graph)))
        cells.append(f"{time.perf_counter() - start:.2f} s")
        print(f"| {graph.number_of_nodes()} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
