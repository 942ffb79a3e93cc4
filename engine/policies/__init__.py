"""Eviction policies: one class each, one registry line to add one.

A policy only answers "which tokens go?" (``select``); the session does the evicting, compaction and
reporting. The GUI builds its controls from each policy's ``Params`` dataclass (fields with defaults and
``metadata={"min", "max", "help"}``).
"""

# ruff: noqa: I001 - the import order is the registry order, which is the GUI menu order
from engine.policies.base import EvictionPolicy, PolicyState, get_policy, policy_names, registry
from engine.policies.streaming import StreamingPolicy  # noqa: I001  (registry order = menu order)
from engine.policies.h2o import H2OPolicy
from engine.policies.priority import PriorityPolicy

__all__ = ["EvictionPolicy", "PolicyState", "get_policy", "policy_names", "registry", "StreamingPolicy",
           "H2OPolicy", "PriorityPolicy"]
