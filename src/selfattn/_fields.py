"""Objects that declare what they are made of: masks and score modifiers.

A :class:`Declared` object is made of its constructor's arguments: :meth:`~Declared.fields` reads
them back (by default from the attributes of the same names) and :meth:`~Declared.from_fields`
builds the object again from them. Whoever must take a mask or a modifier apart, such as the
compiled chunked path (which hands its tensors to a custom op) or the distributed agreement
(which fingerprints it), does it through these two methods only, never through ``vars()``.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

__all__ = ["Declared"]

_MISSING = object()


def _constructor_names(cls: type) -> tuple[str, ...] | None:
    """The names of ``cls``'s constructor arguments, or None when they cannot be named (``*args``,
    ``**kwargs`` or positional-only arguments)."""
    init = getattr(cls, "__init__")  # noqa: B009 (the class's constructor, not an instance's)
    if init is object.__init__:
        return ()
    names = []
    for p in list(inspect.signature(init).parameters.values())[1:]:  # skip self
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            return None
        names.append(p.name)
    return tuple(names)


class Declared:
    """Made of its constructor's arguments (see the module docstring)."""

    _field_names: ClassVar[tuple[str, ...] | None] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._field_names = _constructor_names(cls)  # once per class, so reading them costs nothing later

    def fields(self) -> tuple[tuple[str, object], ...]:
        """(name, value) of every constructor argument, such that ``type(self).from_fields(**dict(fields))``
        builds an equal object. By default each is read from the attribute of the same name; a class
        that stores its arguments otherwise overrides this (and :meth:`from_fields` if needed)."""
        names = type(self)._field_names
        if names is None:
            raise TypeError(f"{type(self).__qualname__} takes *args, **kwargs or positional-only arguments, so "
                            "selfattn cannot read back what it is made of; define fields() and from_fields()")
        out = []
        for name in names:
            value = getattr(self, name, _MISSING)
            if value is _MISSING or getattr(value, "__self__", None) is self:  # absent, or a method of ours
                raise TypeError(f"{type(self).__qualname__}'s constructor takes {name!r} but the object has no "
                                f"attribute {name!r}: store each constructor argument under its own name, or "
                                "define fields() and from_fields()")
            out.append((name, value))
        return tuple(out)

    @classmethod
    def from_fields(cls, **fields: Any) -> Any:
        """The object made of these fields (by default, the constructor called with them)."""
        return cls(**fields)
