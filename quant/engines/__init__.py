"""Engine knowledge in one place: each sglang / vLLM release's loading rules as data
(``manifests/engines/``), one matcher that decides as the engines do, and the replay built on it.
The converter's exclude list (``quant.serving``) and ``gate checkpoint`` (``quant.verify``) both use it.
"""

from quant.engines.match import Exclude, MixedShards
from quant.engines.replay import (
           Finding,
           Module,
           ReplayContext,
           draft_exclude,
           draft_name,
           engine_modules,
           excluded,
           replay,
)
from quant.engines.rules import ENGINES, RuleSet, UnknownEngine, rule_sets, select

__all__ = ["ENGINES", "Exclude", "Finding", "MixedShards", "Module", "ReplayContext", "RuleSet", "UnknownEngine",
           "draft_exclude", "draft_name", "engine_modules", "excluded", "replay", "rule_sets", "select"]
