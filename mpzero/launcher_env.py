"""The environment a launcher (torchrun, a Slurm or MPI wrapper) sets, checked like flags, before anything reads it:
a value of the wrong type, empty, out of range, or a rank outside its world is one ConfigError line naming the
variable, where it used to be a ValueError or ZeroDivisionError traceback, or (RANK 3 of a world of 1) a wait
for peers that never come and a dead peer blamed.

Every read of these variables goes through `launcher_env()` (tests/test_launcher_env.py fails on any other read
in mpzero/, tools/ or pretrain_gpt.py); `VARIABLES` is the one table of their types and ranges. (Checked here,
not with mpzero/cli's types: the library below the command line reads them, and never imports it.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mpzero.errors import ConfigError, excerpt

VARIABLES = {  # name: (lowest, highest) allowed integer, or None for a non-empty text
    "WORLD_SIZE": (1, 2 ** 31), "RANK": (0, 2 ** 31), "LOCAL_WORLD_SIZE": (1, 2 ** 31), "LOCAL_RANK": (0, 2 ** 31),
    "GROUP_RANK": (0, 2 ** 31), "MASTER_PORT": (1, 65535), "MASTER_ADDR": None,
}
NEEDED_WITH_WORLD_SIZE = ("RANK", "MASTER_ADDR", "MASTER_PORT")  # what torch's env:// rendezvous reads


@dataclass(frozen=True)
class LauncherEnv:
    world_size: int = 1
    rank: int = 0
    local_world_size: int = 1
    local_rank: int = 0
    group_rank: int | None = None  # torchrun's node rank
    launched: bool = False  # WORLD_SIZE is set: torch.distributed joins the launcher's world (env://)


def launcher_env(environ=None) -> LauncherEnv:
    """The launcher's variables, each typed and ranged, and consistent with each other; unset ones take a single
    process's values."""
    environ = os.environ if environ is None else environ
    values = {name: _value(name, environ[name]) for name in VARIABLES if name in environ}
    launched = "WORLD_SIZE" in values
    if launched:
        missing = [name for name in NEEDED_WITH_WORLD_SIZE if name not in values]
        if missing:
            raise ConfigError(f"environment variable WORLD_SIZE={values['WORLD_SIZE']} is set but {missing[0]} is not: "
                              f"launch with torchrun (which sets both), or unset WORLD_SIZE to run as one process")
    env = LauncherEnv(values.get("WORLD_SIZE", 1), values.get("RANK", 0), values.get("LOCAL_WORLD_SIZE", 1),
                      values.get("LOCAL_RANK", 0), values.get("GROUP_RANK"), launched)
    for name, value, bound, bound_name in (("RANK", env.rank, env.world_size, "WORLD_SIZE"),
                                           ("LOCAL_RANK", env.local_rank, env.local_world_size, "LOCAL_WORLD_SIZE"),
                                           ("LOCAL_WORLD_SIZE", env.local_world_size - 1, env.world_size,
                                            "WORLD_SIZE")):
        if value >= bound:
            shown = value + 1 if name == "LOCAL_WORLD_SIZE" else value
            relation = "exceeds" if name == "LOCAL_WORLD_SIZE" else "is outside"
            raise ConfigError(f"environment variable {name}={shown} {relation} {bound_name}={bound}: the launcher's "
                              f"variables disagree; launch with torchrun, or unset them to run as one process")
    return env


def _value(name: str, text: str):
    bounds = VARIABLES[name]
    if bounds is None:
        if not text.strip():
            raise _refused(name, text, "is empty")
        return text
    if not (text.strip().isascii() and text.strip().isdigit()):  # int() would take "٢", "+1", " 1_0 "
        raise _refused(name, text, "is not a non-negative integer")
    value = int(text.strip()) if len(text.strip()) <= 20 else None
    if value is None or not bounds[0] <= value <= bounds[1]:
        raise _refused(name, text, f"is out of range: it must be >= {bounds[0]} and <= {bounds[1]}")
    return value


def _refused(name: str, text: str, reason: str) -> ConfigError:
    return ConfigError(f"environment variable {name}={excerpt(text)} {reason} (the launcher sets it; unset it to run "
                       f"as one process)")
