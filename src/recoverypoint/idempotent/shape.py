"""What :func:`~recoverypoint.idempotent` reads from a function's signature: the params
type its arguments are validated and fingerprinted with, and how its return value is stored
and rebuilt. Everything here is decided when the function is decorated.

A return value is stored in one of two forms, both rebuilt exactly as the annotation says:

- as its JSON value (readable in the console, and the form of every value stored before
  the second one existed), when plain JSON carries it: no bytes that are not UTF-8, no
  NaN or infinity, no float jsonb gives back as another value (1e16 or more in
  magnitude, read back as an integer; -0.0, stored as 0), no NUL;
- else as the text of its JSON (:data:`JSON_TEXT`), bytes in base64, NaN and the
  infinities as JSON's common extensions, NUL escaped: jsonb stores that text as a string.

A value neither form carries (a lone surrogate, a pydantic model whose own config cannot
dump its bytes, a value its annotation does not describe) is refused by
:meth:`Shape.stored_return`, after the function ran: the caller stores the refusal as the
key's answer, so that the function is never run again for the key.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Collection, Mapping
from types import MappingProxyType
from typing import Any, cast

from pydantic import ConfigDict, PydanticSchemaGenerationError, TypeAdapter
from typing_extensions import TypedDict

from ..errors import InvalidKey, InvalidParams
from ..keys import MAX_JSON_DEPTH, canonical_json

JSON_TEXT = "json"
"""The state's name for a return value stored as the text of its JSON; ``value`` names
one stored as its JSON value."""
VALUE = "value"

# The exact form's serialisation: in a 1-tuple, so that the config reaches a dataclass or
# TypedDict too (pydantic takes no config for those themselves; a model keeps its own).
_EXACT = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64", ser_json_inf_nan="constants")

ArgumentRule = str | Callable[[Mapping[str, Any]], object]
"""The name of one of the function's arguments, or a callable given all of them by name
(defaults applied) that returns the value."""


class Shape:
    """A decorated function's signature, as recoverypoint stores its calls."""

    def __init__(self, fn: Callable[..., Any], exclude: Collection[str]) -> None:
        self.qualname = fn.__qualname__
        self.signature = inspect.signature(fn)
        parameters = self.signature.parameters
        unknown = sorted(set(exclude) - set(parameters))
        if unknown:
            raise TypeError(f"{self.qualname} has no argument {unknown[0]!r} to exclude")
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            # Calling one runs none of its body: there is no call to make once per key.
            raise TypeError(
                f"@idempotent: {self.qualname} is a generator function, whose call does none "
                "of its work; decorate a function that does the work and returns its result"
            )
        self.exclude = frozenset(exclude)
        # Where every argument may be passed by position (no *args, **kwargs or keyword-only
        # ones), their names in order: a call passing them all so, the commonest, is bound
        # without Signature.bind, which cost a tenth of a replay's client CPU.
        by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self._positional: tuple[str, ...] | None = (
            tuple(parameters)
            if all(parameter.kind in by_position for parameter in parameters.values())
            else None
        )
        hints = _annotations(fn, [*(set(parameters) - self.exclude), "return"])
        fields = {
            name: _field_type(parameter, hints.get(name, Any))
            for name, parameter in parameters.items()
            if name not in self.exclude
        }
        for name, annotation in fields.items():
            _check_storable(annotation, f"argument {name!r} of {self.qualname}", name)
        # A TypedDict, not a model: an argument may be called anything, `json` or `copy`
        # included, which a model's field names may not shadow.
        self.params: type[Any] = _typed_dict(f"{self.qualname}_params", fields)
        # Unannotated, the value is stored as pydantic dumps Any (a datetime as its ISO
        # text...) and comes back as that JSON.
        returns = hints.get("return", Any)
        self.returns = _check_storable(returns, f"the return type of {self.qualname}", None)
        self.exact: TypeAdapter[Any] = TypeAdapter(tuple[returns], config=_EXACT)  # type: ignore[valid-type]

    def rule(self, rule: ArgumentRule, what: str) -> Callable[[Mapping[str, Any]], object]:
        """``rule`` as a function of the arguments; an argument's name is checked now."""
        if callable(rule):
            return rule
        if rule not in self.signature.parameters:
            raise TypeError(f"{self.qualname} has no argument {rule!r} to take the {what} from")
        return lambda arguments: arguments[rule]

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Mapping[str, Any]:
        """Every argument of a call by name, defaults applied; a TypeError for a call the
        function itself would refuse."""
        names = self._positional
        if names is not None and not kwargs and len(args) == len(names):
            return MappingProxyType(dict(zip(names, args, strict=True)))
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return MappingProxyType(bound.arguments)

    def params_of(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        params = {name: value for name, value in arguments.items() if name not in self.exclude}
        if _holds_float(params, _non_finite):
            raise InvalidParams(
                f"the arguments of {self.qualname} hold NaN or an infinity: {_NO_NAN}"
            )
        return params

    def stored_return(self, value: object) -> dict[str, Any]:
        """``value`` as the state stores it, under :data:`VALUE` or :data:`JSON_TEXT`;
        a :class:`ReturnNotStored` when neither form can carry it."""
        try:
            return {VALUE: self._plain(value)}
        except ValueError:
            pass
        try:
            text = json.dumps(self.exact.dump_python((value,), mode="json", warnings="error")[0])
            self.load_return(JSON_TEXT, text)  # exactly: what cannot come back is refused
        except Exception as exc:  # whatever pydantic or the type raises
            raise ReturnNotStored(
                f"{self.qualname} returned a value that cannot be stored "
                f"({type(exc).__name__}: {exc}"[:1000]
                + "): annotate its return type with "
                "what it returns (a pydantic model, a dataclass...) and return JSON-able data"
            ) from exc
        return {JSON_TEXT: text}

    def _plain(self, value: object) -> Any:
        """``value`` as its JSON value, or a ValueError if that form would not carry it."""
        # pydantic would dump one where the annotation is Any as null
        if _holds_float(value, _non_finite):
            raise ValueError("NaN or an infinity")
        try:
            dumped = self.returns.dump_python(value, mode="json", warnings="error")
            canonical_json(dumped)
            self.load_return(VALUE, dumped)
        except Exception as exc:  # the exact form is tried next
            raise ValueError(str(exc)) from exc
        # jsonb gives some floats back as other values (see _changed_by_jsonb), in a model's
        # field as well as at the top; the dump is acyclic (canonical_json took it), so the
        # walk goes as deep as it nests.
        if _holds_float(dumped, _changed_by_jsonb, depth_limit=math.inf):
            raise ValueError("a float jsonb gives back as another value")
        return dumped

    def load_return(self, form: str, stored: Any) -> Any:
        """The value a call returns, rebuilt from what was stored in ``form`` (the first
        call's too, so that it equals every replay)."""
        if form == JSON_TEXT:
            return self.exact.validate_json(f"[{stored}]")[0]
        return self.returns.validate_python(stored)


class ReturnNotStored(TypeError):
    """A return value neither storage form can carry."""


def as_key_text(value: object, what: str, qualname: str) -> str:
    """A key or scope from an argument: a str, or an int (an order number)."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    got = type(value).__name__
    message = f"the {what} of a call to {qualname} must be a str or an int, got {got}"
    if what == "key":
        raise InvalidKey(message)
    raise ValueError(message)


# Built at run time from a signature, which the checker cannot follow.
_typed_dict = cast(Callable[[str, dict[str, Any]], type[Any]], TypedDict)


def _annotations(fn: Callable[..., Any], names: list[str]) -> dict[str, Any]:
    """The annotations of ``names``, evaluated where postponed: only these, so that an
    excluded argument may be annotated with a type the module cannot see."""
    found = inspect.get_annotations(fn)
    hints: dict[str, Any] = {}
    for name in names:
        if name not in found:
            continue
        annotation = found[name]
        if isinstance(annotation, str):
            try:
                annotation = eval(annotation, getattr(fn, "__globals__", {}))
            except NameError as exc:
                raise TypeError(
                    f"@idempotent cannot resolve the annotation {annotation!r} of "
                    f"{fn.__qualname__} ({exc}): define the type at module level, or "
                    "exclude the argument"
                ) from None
        hints[name] = annotation
    return hints


_NO_NAN = "JSON cannot carry them"


_CONTAINERS = (dict, list, tuple, set, frozenset)


def _non_finite(number: float) -> bool:
    return not math.isfinite(number)


def _changed_by_jsonb(number: float) -> bool:
    """Whether jsonb gives ``number`` back as another value: one Python prints with a
    positive exponent (1e16 and more, in magnitude), which jsonb's numeric prints as an
    integer, read back as an int (1.0727769301088266e17 as 107277693010882660, not even
    equal); and -0.0, which it stores as 0."""
    return abs(number) >= 1e16 or (number == 0 and math.copysign(1.0, number) < 0)


def _holds_float(
    value: object, unfit: Callable[[float], bool], depth_limit: float = MAX_JSON_DEPTH
) -> bool:
    """Whether ``value`` is, or holds in its lists, tuples, sets and dicts, a float that is
    ``unfit``. Iterative, and by default no deeper than params may nest (a deeper or cyclic
    value is refused by the depth check that follows); only containers go on the stack, as
    in :func:`~recoverypoint.keys.check_depth`."""
    if isinstance(value, float):
        return unfit(value)
    if not isinstance(value, _CONTAINERS):
        return False
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        node, depth = pending.pop()
        if depth > depth_limit:
            continue
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, float):
                if unfit(child):
                    return True
            elif isinstance(child, _CONTAINERS):
                pending.append((child, depth + 1))
    return False


def _field_type(parameter: inspect.Parameter, annotation: Any) -> Any:
    if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
        return tuple[annotation, ...]
    if parameter.kind is inspect.Parameter.VAR_KEYWORD:
        return dict[str, annotation]
    return annotation


def _check_storable(annotation: Any, what: str, argument: str | None) -> TypeAdapter[Any]:
    try:
        return TypeAdapter(annotation)
    except PydanticSchemaGenerationError:
        hint = f"; leave it out with exclude=({argument!r},)" if argument else ""
        raise TypeError(
            f"{what} is {annotation!r}, which recoverypoint cannot store as JSON{hint}"
        ) from None
