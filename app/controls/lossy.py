"""Which cache settings lose information, and what they were measured to cost on a model (Qt-free).

Lossy: keys or values below 8 bits (int4, every TurboQuant kind) and any eviction policy. Such a setting is never
applied as a side effect of another change (``CacheControls._fit`` brings back only lossless choices), and choosing
one says first what the fidelity check measured it to cost on the loaded model — top-1 agreement with the full
cache and KL divergence per token — or that it was not measured yet (``Measured``, saved per model in the settings
after every check: Memory ▸ Check fidelity, Compare's grid).
"""

from __future__ import annotations

import json
import time
from typing import Any

from app.ground.glossary import KV_DTYPES, POLICIES

BITS = {"auto": 16, "int8": 8, "int4": 4, "tq4": 4, "tq3": 3, "tq2": 2, "tq4-qjl": 4, "tq3-qjl": 3, "tq2-qjl": 2}
KEPT_MODELS = 16  # models whose measurements are kept (the least recently measured go)
KEPT_ROWS = 64  # settings kept per model


def low_bits(dtype: str) -> bool:
    """Below 8 bits a number: what the issue of lossy precision is about (int8 is near-exact)."""
    return BITS.get(dtype, 16) < 8


def lossy_parts(cfg: Any) -> list[str]:
    """What in ``cfg`` loses information, in the controls' words ("keys 2-bit rotated (tq2)", "Heavy hitters (H2O)")."""
    out = []
    if cfg.mode == "paged":
        for role, dtype in (("keys", cfg.k_dtype), ("values", cfg.v_dtype)):
            if low_bits(dtype):
                out.append(f"{role} {KV_DTYPES[dtype].name}" if dtype in KV_DTYPES else f"{role} {dtype}")
    if cfg.mode != "off" and cfg.policy != "none":
        out.append(POLICIES[cfg.policy].name if cfg.policy in POLICIES else cfg.policy)
    return out


def added(old: Any, new: Any) -> list[str]:
    """The lossy parts ``new`` has that ``old`` did not: fewer bits for keys or values than before (tq2 → tq4 loses
    less, and is not asked about), or an eviction policy switched on or changed."""
    out = []
    if new.mode == "paged":
        for role, name in (("keys", "k_dtype"), ("values", "v_dtype")):
            dtype = getattr(new, name)
            was = getattr(old, name) if old is not None and old.mode == "paged" else "auto"
            if low_bits(dtype) and (BITS.get(dtype, 16) < BITS.get(was, 16) or (dtype != was and not low_bits(was))):
                out.append(f"{role} {KV_DTYPES[dtype].name}" if dtype in KV_DTYPES else f"{role} {dtype}")
    changed_policy = old is None or old.mode == "off" or (old.policy, old.policy_params) != (new.policy,
                                                                                           new.policy_params)
    if new.mode != "off" and new.policy != "none" and changed_policy:
        out.append(POLICIES[new.policy].name if new.policy in POLICIES else new.policy)
    return out


def setting_key(k_dtype: str, v_dtype: str, policy: str, params: dict) -> str:
    return f"{k_dtype}|{v_dtype}|{policy}|{json.dumps(params or {}, sort_keys=True)}"


class Measured:
    """The fidelity check's results per model and setting, kept in the settings (``fidelity/measured``)."""

    def __init__(self, settings) -> None:
        self.settings = settings

    def _all(self) -> dict:
        found = self.settings.get("fidelity/measured")
        return found if isinstance(found, dict) else {}

    def record(self, model: str, rows: list[dict]) -> None:
        """A check's rows (``FidelityRow.as_dict``) for ``model``; rows that failed are not kept."""
        if not model:
            return
        every = self._all()
        mine = dict(every.pop(model, {}))
        now = time.time()
        for row in rows:
            if row.get("error") or not row.get("tokens"):
                continue
            key = setting_key(row.get("k_dtype", "auto"), row.get("v_dtype", "auto"), row.get("policy", "none"),
                              row.get("params") or {})
            mine.pop(key, None)
            mine[key] = {"top1": float(row.get("top1_agreement", 1.0)), "kl": float(row.get("mean_kl", 0.0)),
                         "tokens": int(row["tokens"]), "when": now}
        every[model] = dict(list(mine.items())[-KEPT_ROWS:])
        self.settings.set("fidelity/measured", dict(list(every.items())[-KEPT_MODELS:]))

    def cost(self, model: str, cfg: Any) -> list[tuple[str, dict]]:
        """What was measured for ``cfg`` on ``model``: the setting itself, else its precision and its policy apart
        (each as (what, measurement)); [] when nothing was."""
        mine = self._all().get(model, {})
        exact = mine.get(setting_key(cfg.k_dtype, cfg.v_dtype, cfg.policy, cfg.policy_params))
        if exact is not None:
            return [(", ".join(lossy_parts(cfg)) or "this setting", exact)]
        out = []
        precision = mine.get(setting_key(cfg.k_dtype, cfg.v_dtype, "none", {}))
        if precision is not None and (low_bits(cfg.k_dtype) or low_bits(cfg.v_dtype)):
            out.append((", ".join(p for p in lossy_parts(cfg.replace(policy="none"))), precision))
        policy = mine.get(setting_key("auto", "auto", cfg.policy, cfg.policy_params))
        if policy is not None and cfg.policy != "none":
            out.append((POLICIES[cfg.policy].name if cfg.policy in POLICIES else cfg.policy, policy))
        return out


def cost_words(model_name: str, found: list[tuple[str, dict]]) -> str:
    """'On stories260K the fidelity check measured keys 2-bit rotated (tq2): top-1 agreement 20.3%, KL 1.312 nats a
    token (64 tokens)', or that it was not measured yet."""
    if not found:
        return (f"Not measured on {model_name} yet: run Memory ▸ Check fidelity (or Tools ▸ Compare) to see what it "
                "costs here.")
    parts = [f"{what}: top-1 agreement {100 * m['top1']:.1f}%, KL {m['kl']:.3f} nats a token ({m['tokens']:,} tokens)"
             for what, m in found]
    return f"On {model_name} the fidelity check measured " + "; ".join(parts) + "."
