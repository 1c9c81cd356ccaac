"""Passes: named, pure ``Program -> Program`` values that compose, run under a PassContext."""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import gc
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, overload

from jaxq._program import Program


class Pass:
    """A named, pure ``Program -> Program`` transformation.

    Subclasses implement :meth:`transform`. Calling a pass runs it under the current
    :class:`PassContext`: it is skipped when its ``opt_level`` is above the context's or its name is
    disabled (unless ``required``), and the context's instruments see it run.
    """

    name: str = "pass"
    opt_level: int = 0
    required: bool = False

    def transform(self, program: Program) -> Program:
        """The transformation itself; call the pass instead, which runs this under the current
        :class:`PassContext`."""
        raise NotImplementedError

    def __call__(self, program: Program) -> Program:
        if not isinstance(program, Program):
            raise TypeError(
                f"pass {self.name!r} expects a jaxq.Program; got {type(program).__name__}. "
                "Make one with jaxq.trace(f, *example_args)."
            )
        ctx = PassContext.current()
        if not ctx.should_run(self):
            return program
        return ctx.run(self, program)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, opt_level={self.opt_level})"


class FunctionPass(Pass):
    """A pass made from a function by :func:`program_pass`."""

    def __init__(
        self,
        fn: Callable[[Program], Program],
        name: str,
        opt_level: int = 0,
        required: bool = False,
    ) -> None:
        self.fn, self.name, self.opt_level, self.required = fn, name, opt_level, required

    def transform(self, program: Program) -> Program:
        out = self.fn(program)
        if not isinstance(out, Program):
            raise TypeError(f"pass {self.name!r} returned {type(out).__name__}, not a jaxq.Program")
        return out


@overload
def program_pass(fn: Callable[[Program], Program]) -> FunctionPass: ...
@overload
def program_pass(
    fn: None = None, *, name: str | None = None, opt_level: int = 0, required: bool = False
) -> Callable[[Callable[[Program], Program]], FunctionPass]: ...


def program_pass(
    fn: Callable[[Program], Program] | None = None,
    *,
    name: str | None = None,
    opt_level: int = 0,
    required: bool = False,
) -> Any:
    """Turn ``fn: Program -> Program`` into a :class:`Pass`; usable bare or with options as a
    decorator."""

    def wrap(f: Callable[[Program], Program]) -> FunctionPass:
        if not callable(f):
            raise TypeError(f"program_pass: expected a function; got {type(f).__name__}")
        return FunctionPass(f, name or str(getattr(f, "__name__", "pass")), opt_level, required)

    return wrap if fn is None else wrap(fn)


def _makes_passes(f: Callable[..., Any]) -> bool:
    """Whether ``f`` is a pass factory (``name_expressions``, not ``name_expressions()``): its
    return annotation names a Pass."""
    ret = getattr(f, "__annotations__", {}).get("return")
    return (
        isinstance(ret, str)
        and ret.split(".")[-1] in ("Pass", "Sequential")
        or (isinstance(ret, type) and issubclass(ret, Pass))
    )


class Sequential(Pass):
    """Passes run in order; itself a pass. Supports ``len``, iteration and slicing (a slice is a
    Sequential), so a pipeline can be bisected: ``seq[:3](program)``."""

    def __init__(
        self,
        passes: Iterable[Pass],
        name: str | None = None,
        opt_level: int = 0,
        required: bool = False,
    ) -> None:
        passes = tuple(passes)
        for i, p in enumerate(passes):
            if not isinstance(p, Pass):
                hint = (
                    f" (a pass factory? call it: {getattr(p, '__name__', 'f')}(...))"
                    if callable(p) and _makes_passes(p)
                    else " (a function? wrap it with jaxq.transform.program_pass)"
                    if callable(p)
                    else ""
                )
                raise TypeError(
                    f"Sequential: item {i} is {p!r} of type {type(p).__name__}, not a Pass{hint}"
                )
        self.passes = passes
        self.name = name or "sequential"
        self.opt_level, self.required = opt_level, required

    def transform(self, program: Program) -> Program:
        for p in self.passes:
            program = p(program)
        return program

    def __len__(self) -> int:
        return len(self.passes)

    def __iter__(self) -> Iterator[Pass]:
        return iter(self.passes)

    @overload
    def __getitem__(self, i: int) -> Pass: ...
    @overload
    def __getitem__(self, i: slice) -> Sequential: ...
    def __getitem__(self, i: int | slice) -> Pass | Sequential:
        if isinstance(i, slice):
            parts = [("" if v is None else str(v)) for v in (i.start, i.stop, i.step)]
            span = ":".join(parts if i.step is not None else parts[:2])
            return Sequential(self.passes[i], name=f"{self.name}[{span}]")
        return self.passes[i]

    def __repr__(self) -> str:
        inner = ", ".join(p.name for p in self.passes)
        return f"Sequential({self.name!r}, [{inner}])"


_CONFIGS: dict[str, tuple[tuple[type, ...], str]] = {}


def register_config(name: str, type_: Any, doc: str) -> None:
    """Declare a ``PassContext(config=...)`` option that a pass reads: its name, the type its
    values must have (a type, a union such as ``int | None``, or a tuple of types; an int is
    taken where a float is asked), and one line on what it does. ``PassContext`` refuses names
    nobody declared (a misspelled option would otherwise be ignored in silence) and values of
    another type, when the context is made rather than when a pass reads them. Declare a
    pass's options where the pass is defined (module import time); declaring a name again with
    the same type replaces its line, with another type is an error (two passes would read one
    option differently)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_config: name must be a non-empty str; got {name!r}")
    kinds = _types(type_)
    if not kinds or not all(isinstance(t, type) for t in kinds):
        raise TypeError(
            f"register_config: type_ must be a type, a union of types or a tuple of types; "
            f"got {type_!r}"
        )
    if name in _CONFIGS and _CONFIGS[name][0] != kinds:
        raise ValueError(
            f"register_config: {name!r} is declared already, taking {_type_names(_CONFIGS[name][0])}"
            f" ({_CONFIGS[name][1]}); give your option a name of its own"
        )
    _CONFIGS[name] = (kinds, doc)


def _types(type_: Any) -> tuple[Any, ...]:
    if isinstance(type_, types.UnionType):
        return typing.get_args(type_)
    parts = type_ if isinstance(type_, tuple) else (type_,)
    return tuple(type(None) if t is None else t for t in parts)


def _type_names(kinds: tuple[type, ...]) -> str:
    return " | ".join("None" if t is type(None) else t.__name__ for t in kinds)


def _check_config(config: Mapping[str, Any]) -> None:
    for key, value in config.items():
        if key not in _CONFIGS:
            near = difflib.get_close_matches(str(key), list(_CONFIGS), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(
                f"PassContext: unknown config option {key!r}; {hint}the options are "
                f"{', '.join(sorted(_CONFIGS))} (PassContext.list_configs() says what each does; "
                "a pass of your own declares its options with jaxq.transform.register_config)"
            )
        kinds, _ = _CONFIGS[key]
        taken = (*kinds, int) if float in kinds else kinds  # (an int where a float is asked)
        if not isinstance(value, taken) or (isinstance(value, bool) and bool not in kinds):
            raise TypeError(
                f"PassContext: config option {key!r} takes a value of type "
                f"{_type_names(kinds)}; got {type(value).__name__} {value!r}"
            )


_CURRENT: contextvars.ContextVar[PassContext | None] = contextvars.ContextVar(
    "jaxq_pass_context", default=None
)


class PassContext:
    """Options and instruments for the passes run inside it. A scoped context manager that nests
    (the innermost wins); outside any ``with`` a default context (opt_level=2) applies.

    Args:
      opt_level: passes with a higher ``opt_level`` are skipped.
      disabled: names of passes to skip.
      config: pass options, e.g. ``{"quantize.calibrate.method": "percentile"}``: names
        declared with :func:`register_config` (:meth:`list_configs` lists them), each value of
        its declared type.
      instruments: objects with any of the hooks ``enter_pass_ctx()``, ``exit_pass_ctx()``,
        ``run_before_pass(pass_, program)``, ``run_after_pass(pass_, before, after)``.
    """

    def __init__(
        self,
        opt_level: int = 2,
        disabled: Iterable[str] = (),
        config: Mapping[str, Any] | None = None,
        instruments: Iterable[Any] = (),
    ) -> None:
        if isinstance(opt_level, bool) or not isinstance(opt_level, int):
            raise TypeError(f"PassContext: opt_level must be an int; got {opt_level!r}")
        names = () if isinstance(disabled, str) else tuple(disabled)  # (a generator: read once)
        if isinstance(disabled, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(
                f"PassContext: disabled must be a sequence of pass names; got {disabled!r}"
            )
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(
                f"PassContext: config must be a mapping of option names to values (e.g. "
                f"{{'quantize.tuning': ...}}); got {config!r}"
            )
        if isinstance(instruments, (str, type)) or any(
            callable(getattr(instruments, h, None)) for h in _HOOKS
        ):
            raise TypeError(
                f"PassContext: instruments must be a sequence of instruments; got {instruments!r} "
                "(pass instruments=[...])"
            )
        self.opt_level = opt_level
        self.disabled = frozenset(names)
        self.config: Mapping[str, Any] = dict(config or {})
        _check_config(self.config)
        self.instruments = tuple(instruments)
        for inst in self.instruments:
            if isinstance(inst, type):
                raise TypeError(
                    f"PassContext: instruments are instances; got the class {inst.__name__} "
                    f"(pass {inst.__name__}(...))"
                )
            if not any(callable(getattr(inst, h, None)) for h in _HOOKS):
                raise TypeError(
                    f"PassContext: instrument {inst!r} has none of the hooks {', '.join(_HOOKS)}"
                )
        self._tokens: list[contextvars.Token[PassContext | None]] = []
        self._seen: set[str] = set()  # the passes considered inside, to find misspelled names

    @staticmethod
    def list_configs() -> dict[str, str]:
        """The declared config options: name -> ``"<type>: <what it does>"``."""
        return {name: f"{_type_names(t)}: {doc}" for name, (t, doc) in sorted(_CONFIGS.items())}

    @staticmethod
    def current() -> PassContext:
        """The innermost active context, or the default one (opt_level=2, no instruments)."""
        ctx = _CURRENT.get()
        return _DEFAULT if ctx is None else ctx

    def __enter__(self) -> PassContext:
        self._tokens.append(_CURRENT.set(self))
        for inst in self.instruments:
            _hook(inst, "enter_pass_ctx")
        return self

    def __exit__(self, *exc: Any) -> None:
        for inst in self.instruments:
            _hook(inst, "exit_pass_ctx")
        _CURRENT.reset(self._tokens.pop())
        unknown = sorted(self.disabled - self._seen)
        if unknown and self._seen and exc[0] is None and not self._tokens:
            warnings.warn(
                f"PassContext(disabled=...): no pass named {', '.join(map(repr, unknown))} ran "
                f"in this context (passes that did: {', '.join(sorted(self._seen))}); check "
                "the spelling",
                UserWarning,
                stacklevel=2,
            )

    def should_run(self, p: Pass) -> bool:
        self._seen.add(p.name)
        if p.name in self.disabled:
            if p.required:
                raise ValueError(
                    f"pass {p.name!r} is required and cannot be disabled; remove it from "
                    "PassContext(disabled=...)"
                )
            return False
        return p.required or p.opt_level <= self.opt_level

    def run(self, p: Pass, program: Program) -> Program:
        leaf = not isinstance(p, Sequential)
        if leaf:
            for inst in self.instruments:
                _hook(inst, "run_before_pass", p, program)
        with _paused_gc():
            try:
                out = p.transform(program)
            except Exception as e:
                if leaf:  # name the pass once, innermost (the exception keeps its type)
                    e.add_note(f"(raised by jaxq pass {p.name!r})")
                raise
        if leaf:
            for inst in self.instruments:
                _hook(inst, "run_after_pass", p, program, out)
        return out


@contextlib.contextmanager
def _paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a pass runs.

    A pass allocates O(equations) new, acyclic objects (equations, variables, tracers); with the
    collector on, each burst triggers full collections that walk the whole heap, which makes passes
    look superlinear on programs of 10k+ equations. Reference counting still frees memory while
    paused; cycles are collected after the pass.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


_HOOKS = ("enter_pass_ctx", "exit_pass_ctx", "run_before_pass", "run_after_pass")


def _hook(inst: Any, name: str, *args: Any) -> None:
    fn = getattr(inst, name, None)
    if fn is not None:
        fn(*args)


_DEFAULT = PassContext()
