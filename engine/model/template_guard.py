"""Chat templates rendered within bounds: a model file's template is code its author wrote, run at every prompt.

transformers renders a template in Jinja's immutable sandbox, which stops attribute tricks but not work: two
nested ``range(100000)`` loops ran 10^10 steps, ``'x' * 2000000000`` allocated 2 GB and ``range(10**9)`` raised an
``OverflowError`` (5.2 GB and 50 s before ``MemoryError`` here). ``install()`` makes transformers compile every
template in ``BoundedEnvironment`` instead — the same sandbox, extensions, filters and globals — where:

- every value a template can build is measured before it is built: ``*``, ``**``, ``+`` and ``%``, the filters
  and method calls that take a width or count, a namespace assignment, an output expression, a comparison
  (a list nested in itself 40 times holds 2^40 items for ``==`` to walk);
- ``range`` holds at most ``RANGE`` numbers and all loops over ranges at most ``ITERATIONS`` steps;
- the output is at most ``OUTPUT`` characters, and a render at most ``SECONDS`` — it runs on a thread of its own,
  stopped past that by an exception raised into it (a loop over a string has no hook to check the clock).

Past any bound a render raises ``TemplateLimitError`` naming which one; the engine says it in one line naming the
model, at load (``trial``) and per request. The limits sit far above any real template: the largest in use (tool
schemas, reasoning blocks) render a 100-message chat in ~10 ms and a few hundred KB.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import math
import operator
import re
import threading
import time
from typing import Any, Callable

OUTPUT = 16 << 20  # characters a render may write (a 128k-token prompt is ~0.5 M)
VALUE = 16 << 20  # characters or items one value may hold; widths and counts past it are refused
RANGE = 100_000  # numbers in one range() (Jinja's own sandbox limit)
ITERATIONS = 1_000_000  # steps of all the range() loops of one render
SECONDS = 2.0  # wall time of one render
_BITS = 256  # an integer result of at most this many bits (10 ** 10 ** 9 would take minutes)
_DIGITS = re.compile(r"\d+")
_COMPARE = {"eq": operator.eq, "ne": operator.ne, "gt": operator.gt, "gteq": operator.ge, "lt": operator.lt,
            "lteq": operator.le, "in": lambda a, b: a in b, "notin": lambda a, b: a not in b}


class TemplateLimitError(Exception):
    """A chat template went past one of the render's bounds (the message says which)."""


class _Stop(BaseException):
    """Raised into a render's thread past its time (a BaseException: a template cannot catch it)."""


_local = threading.local()  # the budget of the render running on this thread


class _Budget:
    def __init__(self) -> None:
        self.deadline = time.monotonic() + SECONDS
        self.steps = ITERATIONS

    def tick(self, n: int = 1) -> None:
        self.steps -= n
        if self.steps < 0:
            raise TemplateLimitError(f"its loops ran more than {ITERATIONS:,} steps")
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"it ran longer than {SECONDS:g} s")


def _budget() -> _Budget:  # outside a render (Jinja folds constants as it compiles): a budget for this one check
    b = getattr(_local, "budget", None)
    return _Budget() if b is None else b


def _size(value: Any, limit: int = VALUE) -> int:
    """Characters and items in ``value``, each shared part counted every time it appears (as ``str`` or ``==``
    would walk it); ``TemplateLimitError`` once past ``limit``, having looked at no more than that."""
    from jinja2.utils import Namespace

    total, stack, seen = 0, [value], set()
    while stack:
        v = stack.pop()
        if isinstance(v, (str, bytes)):
            total += len(v)
        elif isinstance(v, dict):
            total += len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += len(v)
            stack.extend(v)
        elif isinstance(v, Namespace):
            if id(v) not in seen:  # a namespace can hold itself: the only cycle a template can make
                seen.add(id(v))
                stack.append(dict(v._Namespace__attrs))  # type: ignore[attr-defined]
        else:
            total += 1
        if total > limit:
            raise TemplateLimitError(f"it built a value of more than {limit:,} characters or items")
    return total


def _int_ok(v: Any) -> None:  # a width or a count
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > VALUE:
        raise TemplateLimitError(f"it asked for a width or count of {v:,} (at most {VALUE:,})")


def _format_ok(fmt: Any) -> None:
    """A ``%`` / ``format`` pattern whose widths and precisions are within bounds."""
    if isinstance(fmt, str):
        for m in _DIGITS.finditer(fmt):
            if len(m.group()) > 9 or int(m.group()) > VALUE:
                raise TemplateLimitError(f"its format pattern asks for a width of {m.group()}")


def _binop(op: str, left: Any, right: Any) -> None:
    """Refuse ``left op right`` before Python computes it, when the result would be past the bounds."""
    ints = isinstance(left, int) and isinstance(right, int)
    if op == "**" and ints and abs(left) > 1 and right > 0:
        if right * math.log2(abs(left)) > _BITS:
            raise TemplateLimitError(f"it computes {left} ** {right}, a number of more than {_BITS} bits")
    elif op == "*" and ints:
        if left.bit_length() + right.bit_length() > _BITS:
            raise TemplateLimitError(f"it computes a product of more than {_BITS} bits")
    elif op == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(n, int) and hasattr(seq, "__len__") and n > 0 and _size(seq) * n > VALUE:
            raise TemplateLimitError(f"it repeats a value {n:,} times: more than {VALUE:,} characters or items")
    elif op == "+" and not ints and hasattr(left, "__len__") and hasattr(right, "__len__"):
        _size((left, right))
    elif op == "%" and isinstance(left, str):
        _format_ok(left)
        _size(right)


def _bounded_range(*args: int) -> Any:
    r = range(*args)
    if len(r) > RANGE:
        raise TemplateLimitError(f"it asked for range({', '.join(map(str, args))}): {len(r):,} numbers "
                                 f"(at most {RANGE:,})")
    budget = _budget()
    for i in r:
        budget.tick()
        yield i


def _filter(f: Callable[..., Any]) -> Callable[..., Any]:
    """A filter whose widths and counts are checked before it runs and whose inputs are measured (``join``,
    ``tojson``, ``string`` of a value nested in itself would walk it all in C)."""

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _budget().tick(0)
        for a in (*args, *kwargs.values()):
            _int_ok(a)
            if not isinstance(a, (str, int, float, bool, type(None))) and not callable(a):
                _size(a)
        if f.__name__ == "do_replace":
            strs = [a for a in args if isinstance(a, str)]
            if len(strs) >= 3 and strs[-2]:
                s, old, new = strs[-3:]
                if len(s) + s.count(old) * len(new) > VALUE:
                    raise TemplateLimitError(f"its replace filter would write more than {VALUE:,} characters")
        if f.__name__ == "do_format":
            _format_ok(next((a for a in args if isinstance(a, str)), None))
        out = f(*args, **kwargs)
        if isinstance(out, str) and len(out) > VALUE:
            raise TemplateLimitError(f"a filter wrote more than {VALUE:,} characters")
        return out

    return bounded


def _bounded_concat(parts: Any) -> str:
    budget, total, out = _budget(), 0, []
    for p in parts:
        total += len(p)
        if total > OUTPUT:
            raise TemplateLimitError(f"it wrote more than {OUTPUT:,} characters")
        budget.tick(0)
        out.append(p)
    return "".join(out)


def _finalize(value: Any) -> Any:  # what ``{{ value }}`` writes: str() of a list walks all of it in C
    if not isinstance(value, str):
        _size(value)
    return value


def _environment_class():
    """``BoundedEnvironment``: Jinja's immutable sandbox with every hook above, comparisons included (its code
    generator writes them as calls)."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generator(CodeGenerator):
        def visit_Compare(self, node, frame) -> None:  # (a == b) -> environment.compare(a, 'eq', b)
            self.write("environment.compare(")
            self.visit(node.expr, frame)
            for op in node.ops:
                self.write(f", {op.op!r}, ")
                self.visit(op.expr, frame)
            self.write(")")

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = _Generator
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
            _binop(op, left, right)
            return super().call_binop(context, op, left, right)

        def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's signature
            _budget().tick(0)
            if __obj is not _bounded_range:  # a range says its own length
                for a in (*args, *kwargs.values()):
                    _int_ok(a)
            name, owner = getattr(__obj, "__name__", ""), getattr(__obj, "__self__", None)
            if isinstance(owner, str) and name in ("format", "format_map"):
                _format_ok(owner)
            if isinstance(owner, str) and name == "replace" and len(args) >= 2 and args[0]:
                if len(owner) + owner.count(str(args[0])) * len(str(args[1])) > VALUE:
                    raise TemplateLimitError(f"its replace would write more than {VALUE:,} characters")
            if isinstance(owner, str) and name == "join":
                _size(args[0] if args else ())
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj: Any, attribute: str) -> Any:
            _budget().tick(0)
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            _budget().tick(0)
            return super().getitem(obj, argument)

        @staticmethod
        def compare(left: Any, *rest: Any) -> bool:
            for v in (left, *rest[1::2]):
                if not isinstance(v, (str, int, float, type(None))):
                    _size(v)
            for op, right in zip(rest[::2], rest[1::2]):
                if not _COMPARE[op](left, right):
                    return False
                left = right
            return True

    return BoundedEnvironment


class _Renderer:
    """One daemon thread that runs renders, one at a time (``run`` holds the lock), each under a ``_Budget``; a
    render past its time is stopped by ``_Stop`` raised into the thread (delivered between two bytecodes)."""

    def __init__(self) -> None:
        self.jobs: list = []
        self.ready = threading.Condition()
        self.active = False
        self.thread = threading.Thread(target=self._loop, name="kvscope-chat-template", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            try:
                with self.ready:
                    while not self.jobs:
                        self.ready.wait()
                    fn, box, done = self.jobs.pop()
                    self.active = True
                self._one(fn, box, done)
            except _Stop:  # arrived just after a render ended: nothing left to stop
                continue

    def _one(self, fn: Callable[[], Any], box: list, done: threading.Event) -> None:
        try:
            _local.budget = _Budget()
            box.append((True, fn()))
        except _Stop:
            box.append((False, TemplateLimitError(f"it ran longer than {SECONDS:g} s")))
        except RecursionError:
            box.append((False, TemplateLimitError("it calls itself without end (recursion too deep)")))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread as it is
            box.append((False, e))
        finally:
            _local.budget = None
            with self.ready:
                self.active = False
            done.set()

    def stop(self) -> None:  # called past the render's time, from the waiting thread
        with self.ready:
            if self.active and self.thread.ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread.ident), ctypes.py_object(_Stop))

    def submit(self, fn: Callable[[], Any]) -> tuple[list, threading.Event]:
        box: list = []
        done = threading.Event()
        with self.ready:
            self.jobs.append((fn, box, done))
            self.ready.notify()
        return box, done


_lock = threading.Lock()
_renderer: _Renderer | None = None


def run(fn: Callable[[], Any]) -> Any:
    """``fn()`` (a render) on the template thread within the bounds; ``TemplateLimitError`` past them."""
    global _renderer
    if getattr(_local, "budget", None) is not None:  # already inside a bounded render on this thread
        return fn()
    with _lock:
        if _renderer is None or not _renderer.thread.is_alive():
            _renderer = _Renderer()
        box, done = _renderer.submit(fn)
        if not done.wait(SECONDS + 0.25):
            _renderer.stop()
            if not done.wait(1.0):  # inside one long C call: left to finish alone, a new thread for the next
                _renderer = None
                raise TemplateLimitError(f"it ran longer than {SECONDS:g} s")
    ok, value = box[0]
    if ok:
        return value
    raise value


@functools.lru_cache(maxsize=1)
def _environment():
    """The bounded environment, set up as transformers sets up its own (its extensions, filters and globals:
    ``tojson``, ``raise_exception``, ``strftime_now``, ``dict``, ``namespace``), with the bounds above."""
    import jinja2
    from transformers.utils import chat_template_utils as ctu

    base = ctu._cached_compile_jinja_template("").environment
    env = _environment_class()(trim_blocks=base.trim_blocks, lstrip_blocks=base.lstrip_blocks,
                               extensions=[type(x) for x in base.extensions.values()])
    env.globals.update(base.globals)
    env.filters.update(base.filters)
    env.filters.update({k: _filter(f) for k, f in env.filters.items()})
    env.globals["range"] = _bounded_range
    env.finalize = _finalize
    env.concat = _bounded_concat
    namespace = env.globals.get("namespace") or jinja2.utils.Namespace

    class BoundedNamespace(namespace):  # type: ignore[misc, valid-type]
        def __setitem__(self, name: str, value: Any) -> None:
            _size(value)
            _budget().tick(0)
            super().__setitem__(name, value)

    env.globals["namespace"] = BoundedNamespace

    class BoundedTemplate(jinja2.Template):
        def render(self, *args: Any, **kwargs: Any) -> str:
            return run(lambda: jinja2.Template.render(self, *args, **kwargs))

    env.template_class = BoundedTemplate
    return env


def compile_template(text: str):
    """``text`` compiled in the bounded environment (a syntax error raises as Jinja raises it)."""
    return _environment().from_string(text)


@functools.lru_cache(maxsize=1)
def install() -> None:
    """Make transformers compile (and so render) every chat template within the bounds. Idempotent."""
    from transformers.utils import chat_template_utils as ctu

    ctu._compile_jinja_template = functools.lru_cache(maxsize=64)(compile_template)
    for helper in ("_get_template_variables", "_get_template_literal_text"):
        cached = getattr(ctu, helper, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


_TRIAL = ([{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hello"},
           {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "How are you?"}],
          [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
           {"role": "user", "content": "How are you?"}])


def trial(tokenizer, name: str) -> None:
    """Render a short chat with ``tokenizer``'s template before the model is used: ``ModelFormatError`` naming
    ``name`` when it goes past the bounds (a template that refuses a system message is tried without one)."""
    from engine.errors import ModelFormatError

    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        return
    install()
    for messages in _TRIAL:
        try:
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return
        except TemplateLimitError as e:
            raise ModelFormatError(f"{name}: its chat template cannot be used: {e} (a render is held to "
                                   f"{OUTPUT >> 20} MiB of text, {ITERATIONS:,} loop steps and {SECONDS:g} s)") from None
        except Exception:  # noqa: BLE001 - the template refuses this chat (a system message, say): the next one
            continue
