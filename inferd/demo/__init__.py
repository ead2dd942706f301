"""Demo models built locally for ``inferd serve`` (see :mod:`inferd.demo.build`)."""

from inferd.demo.build import DemoModel, build_demo_models

__all__ = ["DemoModel", "build_demo_models"]
