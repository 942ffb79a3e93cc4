"""Reading an attention class's ``forward`` (``ast``) to learn where it applies RoPE and to which cached tensor.

``engine.kv.store.rope`` asks ``site(cls)``: the one statement ``q, k = <rotary fn>(q, k, ...)`` (at the top of
``forward``, or directly under one ``if``/``else``, each branch with its own function, as DeepSeek V3 chooses
the interleaved one by ``self.config.rope_interleave``), and which slot of ``cache.update(a, b, ...)`` holds the
rotated key:

* ``a`` (role "k"): the usual case, the cached key is the rotated key;
* ``a`` rebuilt as ``torch.cat((key, rest))`` from ``key = a[..., :self.X]`` (phi, stablelm, persimmon rotate
  only the first ``rotary_ndims`` channels in the attention);
* ``b`` (role "v"): multi-head latent attention (DeepSeek V2/V3 and kin) caches the position-free latent
  ``kv_nope`` as its "key" and the small shared rotary key ``k_rot`` / ``k_pe`` as its "value": only that part
  carries a position, so only that part is re-rotated.

Anything else is a one-line reason, never a guess.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

# the functions transformers' attentions rotate with: llama's and most others', DeepSeek V3's interleaved
# variant, DeepSeek V2's complex-number one (freqs_cis instead of cos/sin)
ROTARY_FNS = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave", "apply_rotary_emb")
APPLY = ROTARY_FNS[0]

_SAFE_NODES = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.Compare, ast.Is,
               ast.IsNot, ast.Eq, ast.NotEq, ast.Name, ast.Attribute, ast.Constant, ast.Load)


@dataclass(frozen=True)
class Site:
    """Where an attention class applies RoPE, read from its ``forward``."""

    fns: tuple[Callable | None, Callable | None]  # the rotary fn when ``condition`` holds (or always), and not
    condition: ast.expr | None  # RoPE chosen by ``if <condition>`` (on ``self``); None: always fns[0]
    slice_attr: str | None  # keys rotated as ``key[..., :self.<slice_attr>]`` (phi-style); None: whole tensor
    role: str = "k"  # the cache slot holding the rotated key: "k", or "v" (MLA's rotary key)


_sites: dict[type, Site | str] = {}


def site(cls: type) -> Site | str:
    if cls not in _sites:
        try:
            _sites[cls] = _read_site(cls)
        except (OSError, TypeError, SyntaxError, IndexError) as e:
            _sites[cls] = f"the source of {cls.__name__}.forward cannot be read ({type(e).__name__})"
    return _sites[cls]


def _rotary_call(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ROTARY_FNS


def _has_call(stmt) -> bool:
    return any(_rotary_call(n) for n in ast.walk(stmt))


def _found(body: list) -> list[tuple]:
    """(statement, condition, branch) of each statement calling a rotary fn: at the top, or one level under
    an ``if`` (branch 0: its body, 1: its ``else``)."""
    found = []
    for stmt in body:
        if not _has_call(stmt):
            continue
        if isinstance(stmt, ast.If):
            for branch, part in enumerate((stmt.body, stmt.orelse)):
                found += [(s, stmt.test, branch) for s in part if _has_call(s)]
        else:
            found.append((stmt, None, 0))
    return found


def _rotated_key(stmt) -> str | None:
    """``k`` of ``q, k = fn(q, k, ...)``; None for any other shape."""
    if not (isinstance(stmt, ast.Assign) and _rotary_call(stmt.value) and len(stmt.value.args) >= 3
            and isinstance(stmt.value.args[1], ast.Name) and isinstance(stmt.targets[0], ast.Tuple)
            and len(stmt.targets[0].elts) == 2 and ast.unparse(stmt.targets[0].elts[1]) == stmt.value.args[1].id):
        return None
    return stmt.value.args[1].id


def _read_site(cls: type) -> Site | str:
    owner = next(c for c in cls.__mro__ if "forward" in vars(c))
    fn = inspect.unwrap(vars(owner)["forward"])
    body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
    where = f"{cls.__name__}.forward"
    found = _found(body)
    n_calls = sum(_rotary_call(n) for n in ast.walk(ast.Module(body=body, type_ignores=[])))
    conds = {id(c) for _, c, _ in found}
    branches = [b for _, _, b in found]
    if not found or n_calls != len(found) or len(conds) != 1 or len(set(branches)) != len(branches):
        return f"{where} calls {APPLY} {n_calls} times, or not in a plain statement"
    keys = {_rotated_key(s) for s, _, _ in found}
    if None in keys or len(keys) != 1:
        return f"{where} does not call {APPLY} as `q, k = {APPLY}(q, k, cos, sin)`"
    key = keys.pop()
    fns: list[Callable | None] = [None, None]
    for stmt, _, branch in found:
        fns[branch] = fn.__globals__.get(stmt.value.func.id)
        if not callable(fns[branch]):
            return f"{where}: {stmt.value.func.id} is not a module-level function"
    cond = found[0][1]
    if cond is None:
        fns[1] = fns[0]
    updates = [n.args for n in ast.walk(ast.Module(body=body, type_ignores=[]))
               if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "update"
               and len(n.args) >= 2 and all(isinstance(a, ast.Name) for a in n.args[:2])]
    if len({(a[0].id, a[1].id) for a in updates}) != 1:
        return f"{where}: KV Scope cannot find which keys go into the cache"
    cached_k, cached_v = updates[0][0].id, updates[0][1].id
    if key == cached_v:  # MLA: the latent is the "key", the rotary key the "value"
        return Site((fns[0], fns[1]), cond, None, "v")
    slice_attr = None if key == cached_k else _first_channels(body, key, cached_k)
    if key != cached_k and slice_attr is None:
        return f"{where} rotates `{key}`, which is not the cached key nor its first channels"
    return Site((fns[0], fns[1]), cond, slice_attr)


def _pairs(body: list) -> list[tuple]:
    """(target, value) of every single-target assignment, tuple assignments unpacked."""
    pairs = []
    for n in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(n, ast.Assign) and len(n.targets) == 1:
            t, v = n.targets[0], n.value
            if isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple) and len(t.elts) == len(v.elts):
                pairs += list(zip(t.elts, v.elts))
            else:
                pairs.append((t, v))
    return pairs


def _first_channels(body: list, key: str, cached: str) -> str | None:
    """X when ``key = cached[..., : self.X]`` and later ``cached = torch.cat((key, rest), dim=-1)`` (phi,
    stablelm, persimmon rotate only the first ``rotary_ndims`` channels, in the attention)."""
    pairs = _pairs(body)
    attr = None
    for t, v in pairs:
        if ast.unparse(t) == key and isinstance(v, ast.Subscript) and ast.unparse(v.value) == cached:
            s = v.slice
            if (isinstance(s, ast.Tuple) and len(s.elts) == 2 and ast.unparse(s.elts[0]) == "..."
                    and isinstance(s.elts[1], ast.Slice) and s.elts[1].lower is None and s.elts[1].step is None
                    and ast.unparse(s.elts[1].upper or ast.Constant(None)).startswith("self.")):
                attr = ast.unparse(s.elts[1].upper)[len("self."):]
    rebuilt = any(ast.unparse(t) == cached and isinstance(v, ast.Call) and ast.unparse(v.func).endswith("cat")
                  and v.args and isinstance(v.args[0], (ast.Tuple, ast.List)) and v.args[0].elts
                  and ast.unparse(v.args[0].elts[0]) == key for t, v in pairs)
    return attr if rebuilt and attr is not None and attr.isidentifier() else None


def eval_condition(expr: ast.expr, attn) -> bool | None:
    """Evaluate an ``if`` test that reads only attributes of ``self`` (the attention module) and compares them
    (``self.use_rope``, ``self.sliding_window is not None or self.force_rope``, ``self.config.rope_interleave``);
    None for anything else."""
    tree = ast.Expression(body=expr)
    for n in ast.walk(tree):
        if not isinstance(n, _SAFE_NODES) or (isinstance(n, ast.Name) and n.id != "self"):
            return None
    code = compile(tree, "<rope condition>", "eval")  # only `self.<attr>` reads and comparisons, checked above
    try:
        return bool(eval(code, {"__builtins__": {}}, {"self": attn}))
    except Exception:  # noqa: BLE001 - a missing attribute: cannot tell
        return None
