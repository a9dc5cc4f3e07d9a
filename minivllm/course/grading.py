"""The grading harness every exercise uses: one way to fail, one way to pass, one delegation check.

A grader describes its exercise once (``Exercise(number, convention, answer, allowed)``), takes
the learner's object with ``ex.take(obj)``, compares with ``ex.compare_tensors`` / ``ex.fail`` /
``ex.hint`` and ends with ``ex.passed(...)``. ``answer`` names the package's objects that *are*
the exercise's answer; ``take`` refuses the learner's object when it is or reaches one of them:

* statically, by identity: the object under any name, a subclass, an inherited method, a function
  running the package's code or a byte-for-byte copy of it, and everything learner-written code
  refers to (globals, module and class attributes, closures, defaults, ``super()``, builtins);
* at run time (``importlib``, ``getattr`` by string, ``exec`` of the package's source, ...):
  the returned object runs the learner's code under a profile hook that refuses any call into
  the answer's code or a copy of it, Python or C, also in the threads that code starts, and
  still refuses when the learner catches that refusal and goes on.

Reading the grader's own frames or objects (``sys._getframe``, ``f_back``, ``tb_frame``,
``gc.get_objects``, ...), where a reference result may sit, is refused the same two ways. Code
in another process is out of the harness's sight.

Either way the grader raises :class:`Delegated` (a :class:`CheckFailed`) naming the route.
"""

from __future__ import annotations

import builtins
import dis
import functools
import importlib
import inspect
import os
import sys
import sysconfig
import threading
import types
from typing import Any, Callable, Iterable, NoReturn, Sequence


class CheckFailed(AssertionError):
    """The learner's component does not behave like the reference; the message says how."""


class Delegated(CheckFailed):
    """The learner's component is, or reaches, the package's own answer to the exercise."""


def fail(exercise: str, message: str) -> NoReturn:
    raise CheckFailed(f"Exercise {exercise}: {message}")


def passed(exercise: str, message: str) -> None:
    print(f"Exercise {exercise} passed: {message}")


def first_difference(got: Sequence, expected: Sequence) -> int | None:
    """The first index where ``got`` and ``expected`` differ (the shorter one's length when one
    is a prefix of the other); None when they are equal."""
    got, expected = list(got), list(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            return i
    return None if len(got) == len(expected) else min(len(got), len(expected))


def resolve(name: str) -> Any:
    """``"package.module:Qual.name"`` -> the object."""
    module, _, qual = name.partition(":")
    obj = importlib.import_module(module)
    for part in qual.split(".") if qual else ():
        obj = getattr(obj, part)
    return obj


# -- whose code is it ------------------------------------------------------------------------

def _library_roots() -> tuple[str, ...]:
    import minivllm

    paths = sysconfig.get_paths()
    roots = {os.path.dirname(os.path.abspath(minivllm.__file__)), paths["stdlib"],
             paths["platstdlib"], paths["purelib"], paths["platlib"]}
    return tuple(os.path.realpath(r) + os.sep for r in roots)


@functools.lru_cache(maxsize=None)
def _is_library_file(filename: str) -> bool:
    if filename.startswith("<frozen"):
        return True
    real = os.path.realpath(filename)
    return real.startswith(_library_roots())


def is_learner_code(obj) -> bool:
    """Was ``obj`` (a function, code object or class) written outside the installed packages:
    in a notebook cell, a script, a test?"""
    if isinstance(obj, type):
        # a package's class is defined in a library file and found there under its name; a
        # notebook's (whatever its __module__ says: __main__, builtins under exec) is not
        module = sys.modules.get(obj.__module__)
        file = getattr(module, "__file__", None)
        found = module
        for part in obj.__qualname__.split("."):
            found = getattr(found, part, None)
        if found is obj and (file is None and obj.__module__ == "builtins"):
            return False  # int, dict, ...
        return found is not obj or file is None or not _is_library_file(file)
    code = getattr(obj, "__code__", obj)
    if not isinstance(code, types.CodeType):
        return False
    return not _is_library_file(code.co_filename)


def _codes(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


# what the compiler may emit differently for the same source, depending on the rest of the
# module (a name bound by ``import`` there is loaded as an attribute, not a method)
_SAME_OP = {"LOAD_METHOD": "LOAD_ATTR"}
_NO_OP = {"CACHE", "EXTENDED_ARG", "NOP", "PRECALL", "PUSH_NULL", "RESUME"}


def _fingerprint(code: types.CodeType):
    """What a verbatim copy of the source keeps, wherever it is compiled: the docstring, the
    instructions by name and argument (not offsets, lines or file), the local names, nested
    functions'. (Without its docstring, a short function may be the only way to write it.)"""
    instructions = [i for i in dis.get_instructions(code) if i.opname not in _NO_OP]
    index = {i.offset: n for n, i in enumerate(instructions)}
    jumps = set(dis.hasjrel) | set(dis.hasjabs)
    ops = []
    for i in instructions:
        if isinstance(i.argval, types.CodeType):
            arg = _fingerprint(i.argval)
        elif i.opcode in jumps:
            arg = index.get(i.argval, i.argval)
        else:
            arg = (type(i.argval).__name__, repr(i.argval))
        ops.append((_SAME_OP.get(i.opname, i.opname), arg))
    doc = code.co_consts[0] if code.co_consts and isinstance(code.co_consts[0], str) else None
    return doc, tuple(ops), code.co_varnames, code.co_argcount


def _operator_parts(obj, shown: str) -> list[tuple[Any, str]]:
    """For a torch operator (``torch.ops.ns.name``): its overloads and the C functions that
    the operator and each overload call, which a learner can reach past the operator itself."""
    ops = sys.modules.get("torch._ops")
    if ops is None or not isinstance(obj, ops.OpOverloadPacket):
        return []
    parts = [(obj._op, shown)]
    for overload in obj.overloads():
        op = getattr(obj, overload)
        parts += [(op, f"{shown}.{overload}"), (op._op, f"{shown}.{overload}")]
    return parts


def _triton_fn(obj) -> types.FunctionType | None:
    """The Python function of a ``@triton.jit`` kernel; None for anything else."""
    jit = sys.modules.get("triton.runtime.jit")
    if jit is not None and isinstance(obj, jit.KernelInterface):
        fn = getattr(obj, "fn", None)
        return fn if isinstance(fn, types.FunctionType) else None
    return None


def _functions_of(obj) -> Iterable[Callable]:
    """The plain functions behind a function, method, static/class method, property or kernel."""
    obj = _triton_fn(obj) or obj
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        return [f for f in (obj.fget, obj.fset, obj.fdel) if f is not None]
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    out = []
    while obj is not None and obj not in out:
        if isinstance(obj, types.FunctionType):
            out.append(obj)
        obj = getattr(obj, "__wrapped__", None)
    return out


# -- peeking at the grader -------------------------------------------------------------------

# attribute and function names by which code reaches its callers' frames or every live object
PEEK_NAMES = frozenset({"f_back", "f_locals", "f_globals", "tb_frame", "_getframe", "currentframe",
                        "getouterframes", "get_objects", "get_referrers", "get_referents"})
PEEK_WHY = ("which reads the grader's own frames or objects (where its reference results are): "
            "the grade must come from what your code computes.")


@functools.lru_cache(maxsize=None)
def _peek_functions() -> dict[int, tuple[Any, str]]:
    """id -> (function, name) of the functions that hand out frames or every live object."""
    import gc

    found = {}
    for module, names in ((sys, ("_getframe",)), (gc, ("get_objects", "get_referrers",
                                                        "get_referents")),
                          (inspect, ("currentframe", "stack", "trace", "getouterframes"))):
        for name in names:
            fn = getattr(module, name, None)
            if fn is not None:
                found[id(fn)] = (fn, f"{module.__name__}.{name}")
    return found


def _learner_frame(frame) -> bool:
    return frame is not None and not _is_library_file(frame.f_code.co_filename)


@functools.lru_cache(maxsize=None)
def _peek_codes() -> dict[types.CodeType, str]:
    return {fn.__code__: name for fn, name in _peek_functions().values()
            if isinstance(fn, types.FunctionType)}


# -- results that answer for themselves ------------------------------------------------------

# methods by which a value's own class could decide how it compares with the expected one
_COMPARED = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__bool__",
             "__len__", "__iter__", "__getitem__", "__contains__", "__int__", "__index__",
             "__float__")
_SCALARS = (bool, int, float, complex, str)
_PLAIN = _SCALARS + (bytes, tuple, list, dict, set, frozenset)


def faked(value, depth: int = 0) -> str | None:
    """What in ``value`` (a learner's result, looked into down to 3 levels of tuples, lists and
    dicts) is of a class of the learner's own that could decide how it compares: a torch.Tensor
    subclass, or a subclass of a plain Python type that defines a comparison; None if nothing."""
    kind = type(value)
    if kind in _SCALARS or value is None:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return (f"{kind.__name__}, a torch.Tensor subclass of your own"
                if is_learner_code(kind) else None)
    if isinstance(value, _PLAIN) and is_learner_code(kind):
        own = [name for klass in kind.__mro__ if is_learner_code(klass) for name in _COMPARED
               if name in vars(klass)]
        if own:
            base = next(t for t in _PLAIN if isinstance(value, t)).__name__
            return f"{kind.__name__}, a subclass of {base} of your own that defines {own[0]}"
    if depth < 3 and isinstance(value, (tuple, list, dict)):
        for item in (value if not isinstance(value, dict) else
                     (x for pair in value.items() for x in pair)):
            found = faked(item, depth + 1)
            if found:
                return found
    return None


# -- the exercise ----------------------------------------------------------------------------

class Exercise:
    """One exercise: its number, its convention (said with every failure), the package objects
    that are its answer (refused), and what the learner may use instead (said when refused)."""

    def __init__(self, number: str, convention: str = "", answer: Iterable[str] = (),
                 allowed: str = "", builtin: dict[str, str] | None = None,
                 required: Iterable[str] = ()) -> None:
        self.number, self.convention, self.allowed = number, convention, allowed
        self.required = tuple(required)  # methods the learner's class must define itself
        self._answer_names = tuple(answer)
        self._builtin = dict(builtin or {})  # builtin name -> why it is refused
        self._ready = False
        self._hits: list[tuple[str, str]] = []  # (what a watched call reached, why refused)
        self._local = threading.local()
        self._active = 0  # threads inside a watched call
        self._lock = threading.Lock()

    # failing and passing
    def fail(self, message: str, hint: str | None = None) -> NoReturn:
        text = message + (f" Hint: {hint}" if hint else "")
        if self.convention and self.convention not in text:
            text += f" {self.convention}"
        fail(self.number, text)

    def passed(self, message: str) -> None:
        passed(self.number, message)

    def hint(self, got, mistakes: Iterable[tuple[Callable[[Any], bool], str]]) -> str | None:
        """The hint of the first classic mistake whose test matches ``got`` (None if none)."""
        for matches, text in mistakes:
            try:
                if matches(got):
                    return text
            except Exception:  # noqa: BLE001 - a mistake test that does not apply
                continue
        return None

    def compare_tensors(self, what: str, got, expected, atol: float, rtol: float,
                        hint: str | None = None, mistakes=()) -> None:
        """``common.compare_tensors`` with this exercise's convention; with ``mistakes`` (as
        for ``hint``), their tests run only when the values differ, for the hint."""
        from minivllm.course.checks.common import compare_tensors

        if mistakes:
            hint = functools.partial(self.hint, got, mistakes)
        compare_tensors(self.number, what, got, expected, atol, rtol, self.convention, hint)

    def compare_lists(self, what: str, got: Sequence, expected: Sequence, show=repr) -> None:
        """Fail at the first element where ``got`` and ``expected`` differ, or where one ends."""
        i = first_difference(got, expected)
        if i is None:
            return
        if i >= len(got):
            self.fail(f"{what}: yours stops after {len(got)} items, expected {len(expected)}; "
                      f"the next expected is {show(expected[i])}.")
        if i >= len(expected):
            self.fail(f"{what}: yours has {len(got)} items, expected {len(expected)}; the first "
                      f"extra one is {show(got[i])}.")
        self.fail(f"{what}: item {i} is {show(got[i])}, expected {show(expected[i])}.")

    # the package's answer
    def _prepare(self) -> None:
        if self._ready:
            return
        self._objects: dict[int, tuple[Any, str]] = {}  # id -> (object kept alive, name)
        self._classes: list[tuple[type, str]] = []
        self._code_names: dict[types.CodeType, str] = {}
        self._copies: dict[tuple, str] = {}
        for name in self._answer_names:
            obj = resolve(name)
            shown = name.replace(":", ".")
            self._objects[id(obj)] = (obj, shown)
            if isinstance(obj, type):
                self._classes.append((obj, shown))
                for attr, value in vars(obj).items():
                    fns = _functions_of(value)
                    for fn in fns:
                        self._objects.setdefault(id(fn), (fn, f"{shown}.{attr}"))
                    if fns:  # the innermost's code (a decorator's wrapper code is shared)
                        self._code_names.setdefault(fns[-1].__code__, f"{shown}.{attr}")
                continue
            for op, op_name in _operator_parts(obj, shown):  # torch.ops.X.name.overload
                self._objects.setdefault(id(op), (op, op_name))
            fns = _functions_of(obj)
            for fn in fns:
                self._objects.setdefault(id(fn), (fn, shown))
            if fns:
                self._code_names[fns[-1].__code__] = shown
                self._copies[_fingerprint(fns[-1].__code__)] = shown
        for bname in self._builtin:
            obj = getattr(builtins, bname)
            self._objects[id(obj)] = (obj, f"Python's built-in {bname}()")
        # fingerprints of code inspected or run while watched
        self._fingerprints: dict[types.CodeType, tuple] = {}
        self._ready = True

    def _refuse(self, route: str, how: str, name: str, why: str = "") -> NoReturn:
        why = why or self._builtin.get(
            name.removeprefix("Python's built-in ").removesuffix("()"), "")
        message = (f"{route} {how} {name}, " + (why or
                   "the package's own answer. The exercise is to write it: while it is graded, "
                   "the package's answer is refused however it is reached (imported, aliased, "
                   "subclassed, inherited, called)."))
        if self.allowed:
            message += f" You may use {self.allowed}."
        raise Delegated(f"Exercise {self.number}: {message}")

    def _match(self, x, route: str) -> None:
        found = self._objects.get(id(x))
        if found is not None and found[0] is x:
            self._refuse(route, "is", found[1])
        if isinstance(x, type):
            for cls, shown in self._classes:
                if cls is not x and issubclass(x, cls):
                    self._refuse(route, "subclasses", shown)
        for fn in _functions_of(x):
            if fn.__code__ in self._code_names:
                self._refuse(route, "runs the code of", self._code_names[fn.__code__])
            copied = self._copy_of(fn.__code__)
            if copied is not None:
                self._refuse(route, "is a copy of", copied)
        if not isinstance(x, (type, types.ModuleType, types.FunctionType, types.MethodType)):
            for cls, shown in self._classes:
                if isinstance(x, cls):
                    self._refuse(route, "is an instance of", shown)

    def inspect(self, obj, label: str | None = None) -> None:
        """Raise :class:`Delegated` if ``obj`` is or statically reaches the package's answer."""
        self._prepare()
        label = label or getattr(obj, "__qualname__", None) or type(obj).__name__
        self._visit(obj, f"your {label}", set(), None, 0)

    def _visit(self, x, route: str, seen: set, owner: tuple | None, depth: int) -> None:
        if id(x) in seen or depth > 12:
            return
        seen.add(id(x))
        self._match(x, route)
        if isinstance(x, functools.partial):
            self._visit(x.func, route, seen, None, depth + 1)
            for a in list(x.args) + list(x.keywords.values()):
                self._visit(a, route, seen, None, depth + 1)
            return
        if isinstance(x, types.MethodType):
            self._visit(x.__func__, route, seen, owner, depth + 1)
            self._visit(x.__self__, route, seen, None, depth + 1)
            return
        if isinstance(x, type):
            self._visit_class(x, route, seen, depth)
            return
        fns = _functions_of(x)
        if fns:
            for fn in fns:
                if is_learner_code(fn):
                    self._visit_function(fn, route, seen, owner, depth)
            return
        if not isinstance(x, types.ModuleType) and is_learner_code(type(x)):
            self._visit(type(x), route, seen, None, depth + 1)  # an instance of a learner's class

    def _visit_class(self, cls: type, route: str, seen: set, depth: int) -> None:
        required = self.required if depth <= 1 or is_learner_code(cls) else ()
        names = set(required)
        for klass in cls.__mro__:
            if is_learner_code(klass):
                names.update(vars(klass))
        for name in sorted(names):
            try:
                value = inspect.getattr_static(cls, name)
            except AttributeError:
                continue
            if name.startswith("__") and name.endswith("__") and not callable(value) and not \
                    isinstance(value, (staticmethod, classmethod, property)):
                continue
            defining = next((k for k in cls.__mro__ if name in vars(k)), cls)
            if is_learner_code(defining):
                self._visit(value, f"{route}.{name}", seen, (cls, defining), depth + 1)
            elif name in required:
                self._match(value, f"{route} does not define {name}: it inherits one that")

    def _visit_function(self, fn: types.FunctionType, route: str, seen: set,
                        owner: tuple | None, depth: int) -> None:
        """``owner``: (the class inspected, the class defining ``fn``) for a method."""
        names: list[str] = []
        imported: list[str] = []  # modules its body imports (``from X import Y`` inside it)
        for code in _codes(fn.__code__):
            names.extend(n for n in code.co_names if n not in names)
            imported.extend(i.argval for i in dis.get_instructions(code)
                            if i.opname == "IMPORT_NAME" and i.argval in sys.modules)
        peeks = sorted(PEEK_NAMES.intersection(names))
        if peeks:
            self._refuse(route, "uses", peeks[0], PEEK_WHY)
        for module in imported:
            self._visit_members(sys.modules[module], names, f"{route} -> import {module}", seen,
                                depth + 1)
        for cell, free in zip(fn.__closure__ or (), fn.__code__.co_freevars):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if free == "__class__":
                continue
            self._visit(value, f"{route} (its closure's {free!r})", seen, None, depth + 1)
        for value in list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values()):
            self._visit(value, f"{route} (a default argument)", seen, None, depth + 1)
        cls, defined_in = owner if owner is not None else (None, None)
        bases = ()
        if defined_in is not None and "super" in names:
            bases = cls.__mro__[cls.__mro__.index(defined_in) + 1:]
        g = fn.__globals__
        for name in names:
            if cls is not None:  # self.name: a method inherited from the package
                defining = next((k for k in cls.__mro__ if name in vars(k)), None)
                if defining is not None and not is_learner_code(defining):
                    self._match(vars(defining)[name], f"{route} -> self.{name}")
            if name in g:
                value = g[name]
                self._visit(value, f"{route} -> {name}", seen, None, depth + 1)
                self._visit_members(value, names, f"{route} -> {name}", seen, depth + 1)
            elif name in self._builtin and hasattr(builtins, name):
                self._match(getattr(builtins, name), f"{route} calls {name}(), which")
            for base in bases:
                if name in vars(base):
                    self._visit(vars(base)[name], f"{route} -> super().{name}", seen, None,
                                depth + 1)
                    break

    def _visit_members(self, value, names: list[str], route: str, seen: set, depth: int) -> None:
        """``module.attr`` and ``Class.attr`` for every name the function's code uses."""
        if depth > 6 or not isinstance(value, (types.ModuleType, type)):
            return
        for name in names:
            try:
                member = (getattr(value, name) if isinstance(value, types.ModuleType)
                          else inspect.getattr_static(value, name))
            except Exception:  # noqa: BLE001 - not an attribute of this one
                continue
            if id(member) in seen:
                continue
            self._visit(member, f"{route}.{name}", seen, None, depth + 1)
            if isinstance(member, types.ModuleType):
                self._visit_members(member, names, f"{route}.{name}", seen, depth + 1)

    # at run time
    def take(self, obj, label: str | None = None):
        """The learner's object, inspected (see :meth:`inspect`) and watched while it runs:
        a function comes back wrapped, a class as a subclass whose methods are wrapped."""
        self.inspect(obj, label)
        if _triton_fn(obj) is not None:
            return obj  # a kernel: its launches and calls are watched through the launcher's
        if isinstance(obj, type):
            return self._watch_class(obj)
        if callable(obj):
            return self._watch_function(obj)
        return obj

    def provide(self, fn):
        """A function of the grader's that the learner's code calls (an ``evaluate``): it runs
        unwatched, so the package code it uses is not taken for the learner's."""
        @functools.wraps(fn)
        def provided(*args, **kwargs):
            saved, saved_threads = sys.getprofile(), threading.getprofile()
            sys.setprofile(None)
            threading.setprofile(None)
            try:
                return fn(*args, **kwargs)
            finally:
                sys.setprofile(saved)
                threading.setprofile(saved_threads)
        return provided

    def check_hits(self) -> None:
        """Refuse if a watched call reached the answer (even if the learner caught the refusal)."""
        if self._hits:
            self._refuse("your code (while it ran)", "called", *self._hits[0])

    def _hook(self, frame, event, arg):
        why = ""
        if event == "call":
            code = frame.f_code
            name = self._code_names.get(code)
            if name is None and code.co_name in ("run", "__call__"):
                name = self._kernel_name(frame.f_locals.get("self"))  # a kernel launched/called
            if name is None and code in _peek_codes() and _learner_frame(frame.f_back):
                name, why = _peek_codes()[code], PEEK_WHY
            if name is None and not _is_library_file(code.co_filename):
                copied = self._copy_of(code)  # compiled at run time from the package's source
                name = copied and f"a copy of {copied}"
        elif event == "c_call":
            found = self._objects.get(id(arg))
            name = found[1] if found is not None and found[0] is arg else None
            peek = _peek_functions().get(id(arg)) if name is None else None
            if peek is not None and peek[0] is arg and _learner_frame(frame):
                name, why = peek[1], PEEK_WHY
        else:
            return
        if name is not None:
            self._hits.append((name, why))
            self._refuse("your code (while it ran)", "called", name, why)

    def _copy_of(self, code: types.CodeType) -> str | None:
        """The answer ``code`` is a byte-for-byte copy of, if any (fingerprints kept: the
        static check and the hook ask about the same code again and again)."""
        fingerprint = self._fingerprints.get(code)
        if fingerprint is None:
            fingerprint = self._fingerprints[code] = _fingerprint(code)
        return self._copies.get(fingerprint)

    def _thread_hook(self, frame, event, arg):
        """The hook of a thread started while a call was watched: the watch goes on there for
        as long as some watched call runs, then the thread runs free."""
        if not self._active:
            sys.setprofile(None)
            return
        self._hook(frame, event, arg)

    def _kernel_name(self, kernel) -> str | None:
        found = self._objects.get(id(kernel))
        if found is not None and found[0] is kernel:
            return found[1]
        fn = _triton_fn(kernel)  # a fresh triton.jit of the package's function
        return self._code_names.get(fn.__code__) if fn is not None else None

    def _enter(self):
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth == 0:
            self._local.saved = sys.getprofile()
            sys.setprofile(self._hook)
            with self._lock:  # threads started from here on are watched too
                self._active += 1
                if self._active == 1:
                    self._threads_saved = threading.getprofile()
                    threading.setprofile(self._thread_hook)

    def _exit(self) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            sys.setprofile(self._local.saved)
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    threading.setprofile(self._threads_saved)

    def _run(self, fn, args, kwargs):
        self._enter()
        try:
            result = fn(*args, **kwargs)
        except Delegated:
            raise
        except BaseException as e:
            if self._hits:
                name, why = self._hits[0]
                why = why.removesuffix(".") or "the package's own answer"
                raise Delegated(f"Exercise {self.number}: your code called {name}, {why} (and "
                                f"then failed: {e!r}).") from e
            raise
        finally:
            self._exit()
        self.check_hits()
        self.check_result(result)
        return result

    def check_result(self, result) -> None:
        """Fail if the learner's ``result`` holds a value that would answer for itself when
        compared (see :func:`faked`)."""
        found = faked(result)
        if found:
            self.fail(f"your code returned {found}: its own methods, not its values, would "
                      "decide how it compares with the expected result. Return plain tensors "
                      "and Python values.")

    def _watch_function(self, fn):
        ex = self
        if inspect.isasyncgenfunction(fn):
            @functools.wraps(fn)
            async def watched_agen(*args, **kwargs):
                agen = ex._run(fn, args, kwargs)
                while True:
                    try:
                        item = await _Stepped(ex, agen.__anext__())
                    except StopAsyncIteration:
                        return
                    yield item
            return watched_agen
        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def watched_gen(*args, **kwargs):
                gen = ex._run(fn, args, kwargs)
                while True:
                    try:
                        item = ex._run(next, (gen,), {})
                    except StopIteration:
                        return
                    yield item
            return watched_gen
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def watched_coro(*args, **kwargs):
                return await _Stepped(ex, ex._run(fn, args, kwargs))
            return watched_coro

        @functools.wraps(fn)
        def watched(*args, **kwargs):
            return ex._run(fn, args, kwargs)
        return watched

    def _watch_class(self, cls: type) -> type:
        namespace: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            if not is_learner_code(klass):
                continue
            for name, value in vars(klass).items():
                if name.startswith("__") and name not in ("__init__", "__call__"):
                    continue
                if isinstance(value, staticmethod):
                    namespace[name] = staticmethod(self._watch_function(value.__func__))
                elif isinstance(value, classmethod):
                    namespace[name] = classmethod(self._watch_function(value.__func__))
                elif isinstance(value, property):
                    namespace[name] = property(*(self._watch_function(f) if f else None for f in
                                                 (value.fget, value.fset, value.fdel)))
                elif isinstance(value, types.FunctionType):
                    namespace[name] = self._watch_function(value)
        namespace["__module__"] = cls.__module__
        namespace["__qualname__"] = cls.__qualname__
        namespace["__doc__"] = cls.__doc__
        return type(cls.__name__, (cls,), namespace)


class _Stepped:
    """Awaits ``awaitable`` with the watch on only while its own code runs (each resumption),
    not while it waits and the event loop runs other tasks."""

    def __init__(self, ex: Exercise, awaitable) -> None:
        self.ex, self.awaitable = ex, awaitable

    def __await__(self):
        it, value, error = self.awaitable.__await__(), None, None
        while True:
            self.ex._enter()
            try:
                future = it.throw(error) if error is not None else it.send(value)
            except StopIteration as stop:
                self.ex._exit()
                self.ex.check_hits()
                self.ex.check_result(stop.value)
                return stop.value
            except BaseException as e:
                self.ex._exit()
                if self.ex._hits and not isinstance(e, (Delegated, StopAsyncIteration)):
                    self.ex.check_hits()
                raise
            self.ex._exit()
            self.ex.check_hits()
            try:
                value, error = (yield future), None
            except BaseException as e:  # noqa: BLE001 - handed to the awaitable, as await does
                value, error = None, e


__all__ = ["CheckFailed", "Delegated", "Exercise", "fail", "passed", "faked", "first_difference",
           "is_learner_code", "resolve"]
