"""drf-spectacular: DRF views served through :class:`~._views.Idempotency` declare, in the
schema it generates, their key header, replay headers and problem answers.

A single-step view method declares itself; a method that calls ``run`` says so with
``@idempotency.phased()``. This module's view extension, registered with drf-spectacular
when both are installed, gives each such method a schema class that adds the declaration
(:func:`~recoverypoint.integrations._openapi.declare`) to whatever the view's own schema
class, ``@extend_schema`` included, generates.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from drf_spectacular.extensions import OpenApiViewExtension
from drf_spectacular.plumbing import ComponentRegistry, ResolvedComponent, get_class

from .._openapi import PROBLEM_COMPONENT, PROBLEM_SCHEMA, declaration_of, declare

__all__ = ["IdempotentViews"]


class _Declaring:
    """Mixed into a view method's schema class: its operation gets the declaration."""

    view: Any

    def get_operation(
        self, path: str, path_regex: str, path_prefix: str, method: str, registry: ComponentRegistry
    ) -> Any:
        operation = super().get_operation(  # type: ignore[misc]
            path, path_regex, path_prefix, method, registry
        )
        handler = getattr(self.view, getattr(self.view, "action", None) or method.lower())
        declaration = declaration_of(handler)
        if operation is not None and declaration is not None:
            registry.register_on_missing(
                ResolvedComponent(  # type: ignore[no-untyped-call]
                    name=PROBLEM_COMPONENT,
                    type=ResolvedComponent.SCHEMA,
                    object=PROBLEM_COMPONENT,
                    schema=copy.deepcopy(PROBLEM_SCHEMA),
                )
            )
            declare(operation, declaration, f"#/components/schemas/{PROBLEM_COMPONENT}")
        return operation


def _declared_methods(view: type) -> list[str]:
    return sorted(
        {
            name
            for klass in view.__mro__
            for name, value in vars(klass).items()
            if declaration_of(value) is not None
        }
    )


class IdempotentViews(OpenApiViewExtension):  # type: ignore[no-untyped-call]
    """Every DRF view with a declared method, replaced (for the schema only) by a subclass
    whose declared methods carry a declaring schema class. On the method, not the view:
    drf-spectacular lets a method's schema (``@extend_schema``) replace the view's."""

    target_class = "rest_framework.views.APIView"
    match_subclasses = True

    @classmethod
    def _matches(cls, target: Any) -> bool:
        return bool(super()._matches(target)) and bool(_declared_methods(get_class(target)))

    def view_replacement(self) -> type:
        view: type = self.target
        methods = {name: _declaring(getattr(view, name), view) for name in _declared_methods(view)}
        return type(view.__name__, (view,), methods)


def _declaring(handler: Any, view: type) -> Any:
    """A copy of ``handler`` whose schema class (its own, else the view's) declares."""
    own = getattr(handler, "kwargs", None) or {}
    base = get_class(own.get("schema") or view.schema)  # type: ignore[attr-defined]

    @functools.wraps(handler)
    def copied(*args: Any, **kwargs: Any) -> Any:
        return handler(*args, **kwargs)

    schema = type(f"Idempotent{base.__name__}", (_Declaring, base), {})
    copied.kwargs = {**own, "schema": schema}  # type: ignore[attr-defined]
    return copied
