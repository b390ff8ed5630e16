"""One plan cache shared by the preset sweeps: planning a shipped preset takes up to seconds (a fine-tuning
preset's thousands of candidates), and three sweeps plan every preset or some of them: the preset check of
tests/test_config_surface.py, the engine check of tests/test_engine_agreement.py and the golden snapshots of
tests/test_preset_equivalence.py (tests/preset_snapshot.py). ``plan(preset, *overrides)`` composes the preset
with the overrides as the CLI does (``hp_tool.cli.compose``, ``to_app_config``) and plans it
(``make_plan``, analytic memory, nothing written); each distinct plan is made once a test session.

Requests that mean the same plan share it: each request's command line is composed once (``composed``), and
the plan is keyed by the composed config less what ``make_plan`` never reads (``NOT_PLANNED``): the cluster
group (``cluster=bcm cluster.slurm.partition=batch``: where and how trials are launched; no planner module reads
``app.cluster``) and ``memory_check`` (it picks the tracer the CLI passes to ``make_plan``; without one the
plan is analytic whatever it says). So the same preset asked for with another cluster preset or memory
check, or with an override that sets what the preset already says (its own ``gpus_per_node``), is planned
once, and each request still composes and validates its own command line.
(Checked when this cache was written: every plan of ten presets, fine-tuning ones among them, equal field
by field across cluster=auto, local, bcm, ray and in_process and memory_check=analytic.)

``make_plan`` writes nothing (the CLI writes the plan afterwards, ``plan_output.write_plan``); the folder it
is given only names each trial spec's ``run.output_dir``, which neither the fingerprint nor anything a sweep
compares reads. It is one fixed folder (``RESULTS_DIR``) so that a plan does not depend on the session, and
``plan`` checks it is still absent after planning. Planning refusals (``ConfigError``: nothing valid or
nothing fits) are cached and raised again to every caller.

A plan is shared: read it, never change it (copy a spec with ``dataclasses.replace`` first).

This module is imported by tests/preset_snapshot.py when it runs as a script (tests/ is then the script's
folder on sys.path); it uses only the CLI's composition and ``make_plan``, so it plans with whichever
``hp_tool`` is imported (a pristine checkout's, for the golden file).
"""

from __future__ import annotations

import dataclasses
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(tempfile.gettempdir()) / "hp_tool_plan_cache_never_written" / "results"

NOT_PLANNED = ("cluster", "memory_check")  # AppConfig fields make_plan never reads (see the module docstring)

# finetune/custom names no model: the user gives it on the command line (any shipped HF config will do)
CUSTOM_MODEL = ("search_config.model.hf_config=llama2_7b",)


def preset_overrides(preset: str, *overrides: str) -> tuple[str, ...]:
    """The command line that plans ``preset`` with ``overrides``: finetune/custom gets a model."""
    return (f"search_config={preset}", *(CUSTOM_MODEL if preset == "finetune/custom" else ()), *overrides)


def planning_key(app, search: str) -> tuple[str, str]:
    """What the plan of the composed config depends on: the search name and every field but ``NOT_PLANNED``'s."""
    return search, repr({f.name: getattr(app, f.name) for f in dataclasses.fields(app) if f.name not in NOT_PLANNED})


@lru_cache(maxsize=None)
def composed(overrides: tuple[str, ...]) -> tuple[Any, str]:
    """(AppConfig, search_config name) of the command-line overrides, as ``main.py`` composes and validates
    them; shared, so never change it."""
    from hp_tool.cli import compose
    from hp_tool.config import to_app_config

    cfg, name = compose(list(overrides))
    return to_app_config(cfg), name


_BY_CONFIG: dict[tuple[str, str], Any] = {}  # planning_key -> Plan or ConfigError


@lru_cache(maxsize=None)
def _plan_of(overrides: tuple[str, ...]) -> Any:
    from hp_tool.errors import ConfigError
    from hp_tool.planner import make_plan

    app, search = composed(overrides)
    key = planning_key(app, search)
    if key not in _BY_CONFIG:
        existed = RESULTS_DIR.exists()
        try:
            _BY_CONFIG[key] = make_plan(app, search, RESULTS_DIR / search)
        except ConfigError as exc:  # the planner's refusal, raised to every caller
            _BY_CONFIG[key] = exc
        assert existed or not RESULTS_DIR.exists(), f"make_plan wrote under {RESULTS_DIR}: planning writes nothing"
    return _BY_CONFIG[key]


def plan(preset: str, *overrides: str):
    """The plan of the shipped search config ``preset`` with ``overrides`` (Hydra's command-line syntax), made
    once a session (see the module docstring for which requests share one); raises the planner's ConfigError
    where it refuses."""
    out = _plan_of(preset_overrides(preset, *overrides))
    if isinstance(out, Exception):
        raise out.with_traceback(None)  # not this raise's frames piling up on the cached one
    return out


def planned_configs() -> int:
    """How many distinct configs were planned so far (refusals included)."""
    return len(_BY_CONFIG)
