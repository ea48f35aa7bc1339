"""A simulated vLLM engine: continuous batching on a roofline cost model, behind vLLM's API.

Entry points: `build_engine_app` (one engine as an ASGI app), `serve_engines` (several engines
in the running event loop), the ``inference-gateway sim`` command (`cli.register`) and the
``inference-gateway demo`` command, the gateway and two engines in one process (`demo.register`).
"""

from __future__ import annotations

from loadtests.sim.profiles import SIM_MODEL_NAME, get_profile, profile_names
from loadtests.sim.serve import serve_engines
from loadtests.sim.server import EngineApp, build_engine_app

__all__ = ["SIM_MODEL_NAME", "EngineApp", "build_engine_app", "get_profile", "profile_names", "serve_engines"]
