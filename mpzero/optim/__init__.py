"""Update rules as values (`UpdateRule`): AdamW and SGD with momentum, by their `--optimizer` names.

Adding a rule: a module here with a frozen-dataclass `UpdateRule` (state names, validate, step over a flat slice,
its flags), one entry in `RULES`, and its test. ZeRO's master stores, the offload tiers, checkpoints, the
memory accounting, the planner and the command line all read the rule; none of them names one."""

from mpzero.optim.adamw import AdamW
from mpzero.optim.rule import BLOCK, UpdateRule, canonical_windows
from mpzero.optim.sgd import SGD, sgd_reference

RULES: dict[str, type[UpdateRule]] = {rule.name: rule for rule in (AdamW, SGD)}
STATE_NAMES = tuple(dict.fromkeys(name for rule in RULES.values() for name in rule.state_names))

__all__ = ["AdamW", "BLOCK", "RULES", "SGD", "STATE_NAMES", "UpdateRule", "canonical_windows", "sgd_reference"]
