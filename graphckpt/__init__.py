"""graphckpt: automatic gradient checkpointing as an fx graph rewrite.

    gm = graphckpt.rewrite(model, example_inputs=(x,))   # same outputs and gradients,
    loss = loss_fn(gm(x)); loss.backward()               # less activation memory

Pipeline: capture (fx / export) -> costs -> pass (``passes``) -> simulate -> codegen.
"""

from graphckpt.api import analyze, plan, rewrite
from graphckpt.backend import backend
from graphckpt.capture import CaptureError
from graphckpt.codegen import RewrittenModule
from passes.plan import Plan
from passes.segments import PlanError

__all__ = ["CaptureError", "Plan", "PlanError", "RewrittenModule", "analyze", "backend", "plan", "rewrite"]
__version__ = "0.1.0"
