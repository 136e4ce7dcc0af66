"""graphckpt: automatic gradient checkpointing as an fx graph rewrite.

    gm = graphckpt.rewrite(model, example_inputs=(x,))   # same outputs and gradients,
    loss = loss_fn(gm(x)); loss.backward()               # less activation memory

    graphckpt.enable(model, (x,), budget=0.5)            # or in place: blocks checkpointed,
    loss = loss_fn(model(x)); loss.backward()            # the model keeps its class and hooks

Pipeline: capture (fx / export) -> costs -> pass (``passes``) -> simulate -> codegen.
"""

from graphckpt.api import analyze, plan, rewrite
from graphckpt.backend import backend
from graphckpt.capture import CaptureError
from graphckpt.codegen import RewrittenModule
from graphckpt.enable import disable, enable
from passes.plan import Plan
from passes.segments import PlanError

__all__ = ["CaptureError", "Plan", "PlanError", "RewrittenModule", "analyze", "backend", "disable", "enable", "plan",
           "rewrite"]
__version__ = "0.1.0"
