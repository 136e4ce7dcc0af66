"""Checkpoint-placement passes over a cost graph: pure networkx, no torch.

The contract with the torch side is the cost graph (:mod:`passes.costgraph`); each strategy
of :data:`passes.strategies.STRATEGIES` turns one into a :class:`passes.plan.Plan`, and
:func:`passes.strategies.plan_graph` picks one by name or fits a memory budget.
"""

from passes.costgraph import CostGraphError, add_value, check_cost_graph
from passes.plan import Plan
from passes.segments import PlanError, Segment, validate_plan
from passes.simulate import Simulation, simulate
from passes.strategies import STRATEGIES, Strategy, choose_plan, plan_graph

__all__ = [
    "STRATEGIES",
    "CostGraphError",
    "Plan",
    "PlanError",
    "Segment",
    "Simulation",
    "Strategy",
    "add_value",
    "check_cost_graph",
    "choose_plan",
    "plan_graph",
    "simulate",
    "validate_plan",
]
