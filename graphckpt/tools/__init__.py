"""Tools around the pipeline: the CLI and its reports and drawings, benchmarks against the
anchors users would otherwise reach for, peak-memory measurement, and the model zoo.

Nothing in the pipeline (:mod:`graphckpt`'s top level) imports from here.
"""
