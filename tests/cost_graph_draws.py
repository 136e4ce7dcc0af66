"""Random cost graphs for property tests: ``cost_graphs`` draws DAG cost graphs that obey the
node-attribute contract of :mod:`passes.costgraph`, printed, when an example fails, as the
``add_value`` calls that rebuild them."""

from __future__ import annotations

import networkx as nx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from passes.costgraph import DEFAULTS, add_value, check_cost_graph
from passes.graph_facts import storage_root
from tests.thorough import examples


class CostGraph(nx.DiGraph):
    """A cost graph that prints as the ``add_value`` calls rebuilding it (for failing examples)."""

    def __repr__(self) -> str:
        lines = ["graph = nx.DiGraph(measured=True)"]
        for name, attributes in sorted(self.nodes(data=True), key=lambda item: item[1]["order"]):
            extra = {k: v for k, v in attributes.items()
                     if k not in ("kind", "order", "bytes", "label") and DEFAULTS.get(k, object()) != v}
            args = "".join(f", {k}={v!r}" for k, v in extra.items())
            reads = sorted(self.predecessors(name), key=lambda n: self.nodes[n]["order"])
            lines.append(f"add_value(graph, {name!r}, kind={attributes['kind']!r}, "
                         f"order={attributes['order']}, bytes={attributes['bytes']}, reads={reads!r}{args})")
        return "\n".join(lines)


SETTINGS = settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _mostly_true(draw, one_in: int) -> bool:
    """``False`` about once in ``one_in`` draws; shrinks towards ``True``."""
    return draw(st.integers(0, one_in - 1)) != one_in - 1


@st.composite
def cost_graphs(draw, max_ops: int = 30, inputs: tuple[int, int] = (1, 2), max_reads: int = 3) -> nx.DiGraph:
    """A random cost graph obeying the contract of :mod:`passes.costgraph`.

    ``inputs`` then ``params`` and ``op`` s interleaved, each op reading 1-3 earlier values;
    some ops are views (0 bytes, ``alias_of`` the storage root of the value they read),
    a few are not recomputable or not cuttable; one ``output`` sink reads every op
    nobody else reads, plus maybe others.
    """
    graph = CostGraph(measured=True)  # bytes, not node counts
    order = 0
    readable: list[str] = []
    for index in range(draw(st.integers(*inputs))):
        name = f"x{index}"
        add_value(graph, name, kind="input", order=order, bytes=draw(st.integers(0, 64)),
                  requires_grad=draw(st.booleans()))
        readable.append(name)
        order += 1
    n_ops = draw(st.integers(1, max_ops))
    n_params = draw(st.integers(0, 2))
    param_slots = sorted(draw(st.lists(st.integers(0, n_ops - 1), min_size=n_params, max_size=n_params)))
    params = 0
    for index in range(n_ops):
        while param_slots and param_slots[0] == index:
            param_slots.pop(0)
            name = f"p{params}"
            params += 1
            add_value(graph, name, kind="param", order=order, bytes=0)
            readable.append(name)
            order += 1
        reads = draw(st.lists(st.sampled_from(readable), min_size=1, max_size=max_reads, unique=True))
        base = reads[0]
        view = graph.nodes[base]["kind"] in ("op", "input") and draw(st.integers(0, 4)) == 0
        if view:
            nbytes, alias_of = 0, storage_root(graph, base)
        else:
            nbytes, alias_of = draw(st.one_of(st.just(0), st.integers(1, 100))), None
        name = f"op{index}"
        savable = [r for r in reads if graph.nodes[r]["kind"] != "param"] + [name]
        saved = tuple(v for v in savable if draw(st.booleans()))
        add_value(
            graph, name, kind="op", order=order, bytes=nbytes, reads=reads,
            alias_of=alias_of,
            flops=draw(st.integers(0, 1000)),
            recomputable=_mostly_true(draw, 8),
            cuttable=_mostly_true(draw, 10),
            saved=saved,
            saved_extra_bytes=draw(st.one_of(st.just(0), st.integers(1, 50))),
            requires_grad=_mostly_true(draw, 6),
            ordered=not _mostly_true(draw, 6),
        )
        readable.append(name)
        order += 1
    ops = [n for n in readable if graph.nodes[n]["kind"] == "op"]
    unread = [n for n in ops if graph.out_degree(n) == 0]
    others = draw(st.lists(st.sampled_from(readable), max_size=3, unique=True))
    add_value(graph, "output", kind="output", order=order, bytes=0,
              reads=list(dict.fromkeys([*unread, *others])))
    check_cost_graph(graph)
    return graph
