"""``@record``: the small value classes of the launch path, built without compiling code.

A record gets what ``@dataclass(frozen=True)`` would give it -- an ``__init__`` taking the
annotated fields in order (positionally or by name, with defaults and :func:`factory` defaults),
``__repr__``, ``__eq__``, ``__hash__`` and read-only fields -- plus :func:`fields` and
:func:`replace`. ``@record(frozen=False)`` gives a mutable one (equal by fields, unhashable).

Why not dataclasses: on Python 3.11 each frozen dataclass compiles six methods through ``exec``
(about 1 ms a class) and ``import dataclasses`` brings ``inspect`` with it; the launcher defines
some twenty such classes before it starts a program (docs/launcher.md, "Start-up cost"). Here the
methods are ordinary functions shared by every record, reading the class's field list.
"""
from __future__ import annotations

_FIELDS = "__record_fields__"
_DEFAULTS = "__record_defaults__"
_MISSING = object()


class FrozenRecordError(AttributeError):
    """Assigning to (or deleting) a field of a frozen record."""


class factory:  # noqa: N801 - reads as a function at the use site: ``x: dict = factory(dict)``
    """A default made fresh for each instance, like ``dataclasses.field(default_factory=...)``."""

    __slots__ = ("make",)

    def __init__(self, make) -> None:
        self.make = make


def record(cls=None, *, frozen: bool = True):
    """Class decorator: make ``cls`` a record of its annotated fields (``ClassVar`` ones excepted).

    Usable bare (``@record``) or with ``frozen=False``.
    """
    def build(cls):
        names: list[str] = []
        defaults: dict[str, object] = {}
        for base in reversed(cls.__mro__[1:]):   # inherited fields first, as dataclasses order them
            names.extend(n for n in getattr(base, _FIELDS, ()) if n not in names)
            defaults.update(getattr(base, _DEFAULTS, {}))
        for name, annotation in cls.__dict__.get("__annotations__", {}).items():
            if "ClassVar" in str(annotation):
                continue
            if name not in names:
                names.append(name)
            if name in cls.__dict__:
                defaults[name] = cls.__dict__[name]
                if isinstance(defaults[name], factory):
                    delattr(cls, name)   # the instance always has its own value
        seen_default = None
        for name in names:
            if name in defaults:
                seen_default = name
            elif seen_default is not None:
                raise TypeError(f"{cls.__name__}: field {name!r} without a default follows {seen_default!r}")
        setattr(cls, _FIELDS, tuple(names))
        setattr(cls, _DEFAULTS, defaults)
        own = cls.__dict__
        # a class's own __hash__ counts, not the None Python sets when it defines __eq__ only
        explicit_hash = own.get("__hash__", None) is not None
        methods = {"__init__": _init, "__repr__": _repr, "__eq__": _eq}
        if frozen:
            methods.update(__setattr__=_refuse_set, __delattr__=_refuse_delete)
        for name, method in methods.items():
            if name not in own:          # what the class defines itself stays, as with dataclasses
                setattr(cls, name, method)
        if not explicit_hash:
            cls.__hash__ = _hash if frozen else None
        return cls

    return build if cls is None else build(cls)


def fields(obj) -> tuple[str, ...]:
    """The field names of a record (class or instance), in order."""
    try:
        return getattr(obj, _FIELDS)
    except AttributeError:
        raise TypeError(f"{obj!r} is not a record") from None


def replace(obj, **changes):
    """A copy of the record ``obj`` with ``changes`` (each must name a field)."""
    values = {name: getattr(obj, name) for name in fields(obj)}
    for name in changes:
        if name not in values:
            raise TypeError(f"{type(obj).__name__} has no field {name!r}")
    values.update(changes)
    return type(obj)(**values)


def _init(self, *args, **kwargs) -> None:
    cls = type(self)
    names = getattr(cls, _FIELDS)
    if len(args) > len(names):
        raise TypeError(f"{cls.__name__}() takes {len(names)} arguments but {len(args)} were given")
    values = dict(zip(names, args))
    for name, value in kwargs.items():
        if name not in names:
            raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {name!r}")
        if name in values:
            raise TypeError(f"{cls.__name__}() got multiple values for argument {name!r}")
        values[name] = value
    defaults = getattr(cls, _DEFAULTS)
    for name in names:
        if name in values:
            value = values[name]
        else:
            value = defaults.get(name, _MISSING)
            if value is _MISSING:
                raise TypeError(f"{cls.__name__}() missing required argument {name!r}")
            if isinstance(value, factory):
                value = value.make()
        object.__setattr__(self, name, value)
    post_init = getattr(self, "__post_init__", None)
    if post_init is not None:
        post_init()


def _values(obj) -> tuple:
    return tuple(getattr(obj, name) for name in getattr(type(obj), _FIELDS))


def _repr(self) -> str:
    shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in getattr(type(self), _FIELDS))
    return f"{type(self).__qualname__}({shown})"


def _eq(self, other):
    if other.__class__ is not self.__class__:
        return NotImplemented
    return _values(self) == _values(other)


def _hash(self) -> int:
    return hash(_values(self))


def _refuse_set(self, name: str, value) -> None:
    raise FrozenRecordError(f"cannot assign to field {name!r} of a frozen {type(self).__name__}")


def _refuse_delete(self, name: str) -> None:
    raise FrozenRecordError(f"cannot delete field {name!r} of a frozen {type(self).__name__}")
