"""Checkpoint-placement passes over a cost graph: pure networkx, no torch.

The contract with the torch side is the cost graph (:mod:`passes.costgraph`); each strategy
turns one into a :class:`passes.plan.Plan`.
"""

from passes.costgraph import CostGraphError, add_value, check_cost_graph, unit_cost_graph
from passes.plan import Plan, PlanError, Segment, validate_plan
from passes.simulate import Simulation, simulate
from passes.strategies import STRATEGIES, choose_plan

__all__ = [
    "STRATEGIES",
    "CostGraphError",
    "Plan",
    "PlanError",
    "Segment",
    "Simulation",
    "add_value",
    "check_cost_graph",
    "choose_plan",
    "simulate",
    "unit_cost_graph",
    "validate_plan",
]
