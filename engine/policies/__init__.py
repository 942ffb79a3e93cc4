"""Eviction policies: one class each, one registry line to add one.

A policy only answers "which tokens go?" (``select``); ``engine.core.eviction`` does the evicting, compaction and
reporting. The GUI builds its controls from each policy's ``Params`` dataclass (fields with defaults and
``metadata={"min", "max", "help", "flag"}``), the CLI its flags from ``flag``.
"""

# ruff: noqa: I001 - the import order is the registry order, which is the GUI menu order
from engine.policies.base import (DEFAULT_PRIORITY, PINNED, EvictionPolicy, PolicyState, get_policy,
                                  get_policy_class, policy_flags, policy_names, registry)
from engine.policies.streaming import OverflowPolicy, StreamingPolicy  # noqa: I001  (registry order = menu order)
from engine.policies.h2o import H2OPolicy
from engine.policies.expected import ExpectedAttentionPolicy
from engine.policies.priority import PriorityPolicy

__all__ = ["EvictionPolicy", "PolicyState", "get_policy", "get_policy_class", "policy_flags", "policy_names", "registry",
           "StreamingPolicy", "OverflowPolicy", "H2OPolicy", "ExpectedAttentionPolicy", "PriorityPolicy", "PINNED", "DEFAULT_PRIORITY"]
