"""A class named in a file someone shared (``"package.module:Qualname"``), found without
running code the file names.

Importing a module runs its code, so a name read from a repro bundle (its recorded Graph or
model class, a policy's ``module_types`` key) is looked up only among the modules this
process has imported already: code the user chose to run. A bundle naming a module it ships
beside itself, or one the process has not imported, is refused before anything runs; so is a
name that is not a subclass of the expected base (a bundle naming ``tempfile:mkdtemp`` as
its model class would otherwise have it called).

>>> import torch.nn as nn
>>> imported_type("torch.nn:Linear", nn.Module, "the model") is nn.Linear
True
"""

from __future__ import annotations

import operator
import sys


class NotImportedHere(ValueError):
    """A shared file names a class from a module this process has not imported."""


def imported_type(name: str, base: type, what: str) -> type:
    """The subclass of ``base`` that ``name`` (``module:qualname``) names in a module already
    imported; :class:`NotImportedHere` if the module is not, ``ValueError`` if the name is
    no such subclass. ``what`` says in errors what the name is for."""
    module_name, sep, qualname = name.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f"{what}: {name!r} is not a 'package.module:Qualname' name")
    module = sys.modules.get(module_name)
    if module is None:
        raise NotImportedHere(
            f"{what} is {name}, from module {module_name}, which this process has not "
            "imported. A name read from a shared file is never imported (importing runs the "
            f"module's code): import {module_name} yourself first if you trust it"
        )
    try:
        found = operator.attrgetter(qualname)(module)
    except AttributeError:
        raise ValueError(f"{what}: module {module_name} has no {qualname}") from None
    if not (isinstance(found, type) and issubclass(found, base)):
        raise ValueError(f"{what}: {name} is not a subclass of {base.__name__}")
    return found


__all__ = ["NotImportedHere", "imported_type"]
