"""Options of the hybrid backend, as given to ``torch.compile(model, backend="hybrid", options={...})``."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from passes import PASS_NAMES


@dataclass
class Options:
    #: per-pass switches, e.g. ``{"moe": False}``; also accepted as top-level keys (``options={"moe": False}``)
    passes: dict[str, bool] = field(default_factory=dict)
    #: check every rewritten region against the original graph on the example inputs; a region that
    #: disagrees is left to Inductor and the reason is logged and reported
    verify: bool = False
    #: hand the rewritten graph to Inductor (False: run it eagerly, for debugging and for `explain`)
    inductor: bool = True
    #: extra Inductor config patches (e.g. ``{"max_autotune": True}``)
    inductor_config: dict = field(default_factory=dict)
    #: emit the run-time twins of the ops whose launch configs depend on the token count (MoE blocks, MLA
    #: attention): opaque calls that pick their configs per call, so a graph with a dynamic batch compiles
    #: once instead of once per token bucket (see hybrid_kernels/library.py: define_twin; the engine sets it)
    run_time_configs: bool = False

    @classmethod
    def parse(cls, options: dict | None) -> "Options":
        opts = cls()
        known = {f.name for f in fields(cls)}
        for key, value in (options or {}).items():
            if key in PASS_NAMES:
                opts.passes[key] = _switch(key, value)
            elif key == "disable":
                names = [value] if isinstance(value, str) else list(value)
                for name in names:
                    _check_pass(name)
                    opts.passes[name] = False
            elif key == "passes":
                if not isinstance(value, dict):
                    raise ValueError(f"hybrid option 'passes' takes a dict of pass name -> True / False, got "
                                     f"{type(value).__name__} {value!r}")
                for name, on in value.items():
                    _check_pass(name)
                    opts.passes[name] = _switch(f"passes[{name!r}]", on)
            elif key in known:
                want = type(getattr(opts, key))
                if want is bool:
                    value = _switch(key, value)
                elif not isinstance(value, want):
                    raise ValueError(f"hybrid option {key!r} takes a {want.__name__}, got {type(value).__name__} "
                                     f"{value!r}")
                setattr(opts, key, value)
            else:
                raise ValueError(
                    f"unknown hybrid option {key!r}. Known options: {', '.join(sorted(known | {'disable'}))}, "
                    f"and one switch per pass: {', '.join(PASS_NAMES)} (e.g. options={{'moe': False}})")
        return opts


def _switch(key: str, value) -> bool:
    """A switch's value: True or False (also 0 / 1), never a string that ``bool`` would read as True."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"hybrid option {key!r} is a switch and takes True or False, got {type(value).__name__} {value!r}")


def _check_pass(name: str) -> None:
    if name not in PASS_NAMES:
        raise ValueError(f"unknown hybrid pass {name!r}; passes are: {', '.join(PASS_NAMES)}")
