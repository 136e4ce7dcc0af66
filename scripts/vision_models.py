"""Vision models nobody here wrote (timm, torchvision): every promise checked, one row per model.

    python scripts/vision_models.py --out docs/vision_models.md        # every model (about 20 min, 2 cores)
    python scripts/vision_models.py --models timm:resnet18,tv:swin_t   # a subset, printed

Needs ``timm`` and ``torchvision`` (not dependencies of graphckpt: ``pip install timm
torchvision``, with the torchvision built for the installed torch). For each model, random
weights, 10 classes, a batch of 8 images (64 pixels a side where the model takes other sizes,
its own size otherwise), train mode, ``output.pow(2).mean()`` as the loss:

* ``rewrite`` with ``sqrt`` and at 0.5 of eager's simulated peak, and ``enable`` on every
  block and at 0.7: two steps against a deep copy of the untouched model (outputs, every
  gradient, every buffer: BatchNorm statistics and batch counts), or the error a user gets;
* eager's measured peak over its simulated one; a plan at 0.5 of eager (at the floor, the
  smallest peak a plan reaches, where 0.5 is below it): its measured peak over its simulated
  one and over the budget (the promise: at most 1.00).

This sweep found timm's ``BatchNormAct2d`` batch counts off by one and HRNet's blocks trained
with wrong gradients under ``enable`` (2026-12-03).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import sys
import types
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/ is not installed with the package

import torch  # noqa: E402
from torch import nn  # noqa: E402

import graphckpt  # noqa: E402
from graphckpt.api import analyze, generate_rewrite  # noqa: E402
from graphckpt.tools.bench import measured_peak  # noqa: E402
from graphckpt.tools.bench_report import machine_line  # noqa: E402
from passes.budget import BudgetError  # noqa: E402
from passes.segments import PlanError  # noqa: E402
from passes.simulate import eager_peak  # noqa: E402
from tests.equivalence import assert_trains_like  # noqa: E402

TIMM = ["resnet18", "efficientnet_b0", "mobilenetv3_small_050", "convnext_atto", "regnetx_002", "vit_tiny_patch16_224",
        "deit_tiny_patch16_224", "mixer_s32_224", "levit_128s", "coatnet_nano_rw_224", "poolformer_s12",
        "edgenext_xx_small", "ghostnet_050", "cspresnet50", "dla34", "rexnet_100", "hrnet_w18_small",
        "xcit_nano_12_p16_224", "pit_ti_224", "cait_xxs24_224", "eva02_tiny_patch14_224", "fastvit_t8", "repvit_m1",
        "mobilevitv2_050", "nfnet_l0", "res2net50_14w_8s", "selecsls42b", "tresnet_m", "densenet121", "dpn68",
        "volo_d1_224", "tnt_s_patch16_224", "twins_svt_small", "gcvit_xxtiny", "sequencer2d_s"]
TORCHVISION = ["resnet18", "mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny", "regnet_y_400mf",
               "shufflenet_v2_x0_5", "squeezenet1_1", "densenet121", "mnasnet0_5", "swin_t", "swin_v2_t",
               "efficientnet_v2_s", "vgg11_bn"]
MODES = ("rewrite sqrt", "rewrite 0.5", "enable", "enable 0.7")


def import_vision_libraries() -> tuple[types.ModuleType, types.ModuleType]:
    """``(timm, torchvision)``. A torchvision built for another torch (a CUDA wheel beside a CPU
    torch) fails registering its C++ operators; its models are Python and run without them,
    so the registrations are skipped then, with a warning."""
    try:
        import torchvision
    except RuntimeError as error:  # "operator torchvision::nms does not exist"
        warnings.warn(f"torchvision's operators did not load ({error}); its models run without them", stacklevel=1)
        for name in [n for n in sys.modules if n.startswith("torchvision")]:
            del sys.modules[name]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
        import torchvision
    import timm
    return timm, torchvision


def build(spec: str) -> tuple[nn.Module, torch.Tensor]:
    """The model ``spec`` names (``timm:<name>`` or ``tv:<name>``) and a batch of images for it."""
    timm, torchvision = import_vision_libraries()
    library, name = spec.split(":")
    torch.manual_seed(0)
    size = 224 if name.endswith(("_224", "_240")) else 64
    if library == "tv":
        model = getattr(torchvision.models, name)(num_classes=10)
    else:
        try:
            model = timm.create_model(name, num_classes=10, img_size=64)
            size = 64
        except TypeError:  # no img_size: convolutional
            model = timm.create_model(name, num_classes=10)
    return model, torch.randn(8, 3, size, size, generator=torch.Generator().manual_seed(1))


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def trains_like_eager(spec: str, mode: str) -> str:
    """``ok`` when two steps of ``mode`` on ``spec`` match eager's, ``refused: ...`` when graphckpt
    says it cannot (a budget, no blocks), else what failed."""
    model, images = build(spec)
    reference = copy.deepcopy(model)
    try:
        if mode.startswith("enable"):
            budget = float(mode.split()[1]) if " " in mode else None
            rewritten = graphckpt.enable(model, (images,), budget=budget)
        elif mode == "rewrite sqrt":
            rewritten = graphckpt.rewrite(model, (images,), strategy="sqrt")
        else:
            rewritten = graphckpt.rewrite(model, (images,), budget=float(mode.split()[1]))
    except BudgetError as error:
        return f"refused: floor {error.smallest_peak_bytes / error.eager_peak_bytes:.2f}x eager"
    except PlanError as error:
        return f"refused: {str(error).split(':')[0]}"
    try:
        for _ in range(2):
            assert_trains_like(reference, model, rewritten, (images,), loss_fn=_loss, rtol=1e-4, atol=1e-5)
    except AssertionError as error:
        return f"**differs**: {str(error).splitlines()[0][:90]}"
    return "ok"


def peaks(spec: str, budget: float = 0.5) -> str:
    """Eager's measured over simulated peak; the budget plan's measured over simulated and over
    the budget (at the floor, its smallest simulated peak, where 0.5 is below it)."""
    model, images = build(spec)
    cost_graph = analyze(model, (images,), strategy="sqrt").cost_graph
    simulated_eager = eager_peak(cost_graph)
    eager = measured_peak(model, (images,), _loss) / simulated_eager
    budget_bytes = int(budget * simulated_eager)
    try:
        analysis = analyze(model, (images,), budget=budget_bytes)
    except BudgetError as error:
        budget_bytes = error.smallest_peak_bytes
        analysis = analyze(model, (images,), budget=budget_bytes)
    measured = measured_peak(generate_rewrite(model, analysis), (images,), _loss)
    return (f"{eager:.3f} | {budget_bytes / simulated_eager:.2f} | {measured / analysis.plan.peak_bytes:.4f} "
            f"| {measured / budget_bytes:.4f}")


def row(spec: str, capture: Callable[[nn.Module, torch.Tensor], str]) -> str:
    model, images = build(spec)
    cells = [spec, capture(model, images), *(_guarded(trains_like_eager, spec, mode) for mode in MODES),
             _guarded(peaks, spec)]
    return "| " + " | ".join(cells) + " |"


def _guarded(check: Callable[..., str], *args: str) -> str:
    try:
        return check(*args)
    except Exception as error:  # a report row, not a crash: the error is the finding
        return f"**error** {type(error).__name__}: {str(error).splitlines()[0][:90]}"


def _capture_method(model: nn.Module, images: torch.Tensor) -> str:
    try:
        header = graphckpt.rewrite(model, (images,), strategy="sqrt").code.splitlines()[0]
        return header.split("captured with ")[1].split(";")[0]
    except Exception as error:
        return f"**error** {type(error).__name__}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated timm:<name> / tv:<name> (default: all)")
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    options = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    specs = (options.models.split(",") if options.models
             else [f"timm:{n}" for n in TIMM] + [f"tv:{n}" for n in TORCHVISION])
    header = ("| model | capture | " + " | ".join(MODES) + " | eager measured / simulated | budget (x eager) "
              "| measured / simulated | measured / budget |\n|---|---|" + "---|" * len(MODES) + "---:|---:|---:|---:|")
    lines = []
    for spec in specs:
        lines.append(row(spec, _capture_method))
        print(lines[-1], flush=True)
    if options.out:
        timm, torchvision = import_vision_libraries()
        intro = (f"{__doc__.split(chr(10) + chr(10), 2)[2].strip()}\n\nMade with:\n\n    python scripts/vision_models.py "
                 f"--out {options.out}\n\n{datetime.date.today()}, {machine_line()}, "
                 f"timm {timm.__version__}, torchvision {torchvision.__version__}.\n")
        options.out.write_text(f"# Vision models (timm, torchvision)\n\n{intro}\n{header}\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
