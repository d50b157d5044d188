"""Every public name of ``lightning_gpipe`` and ``zoo`` is in the API reference (``docs/reference/``), with a docstring.

The reference is rendered by mkdocstrings from ``::: identifier`` directives. A name counts as documented when a
directive names it, or names its package or defining module without a ``members:`` list that leaves it out. The
docstrings checked are the ones mkdocstrings shows: a class's or function's own ``__doc__``, and for constants and
type aliases the string literal after the assignment (read statically with griffe, as mkdocstrings reads it).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pathlib
import pkgutil
import re
from types import ModuleType
from typing import Any

import griffe
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "reference"
PACKAGES = ("lightning_gpipe", "zoo")
_DIRECTIVE = re.compile(r"^:::\s*(?P<identifier>[\w.]+)\s*$")
_MEMBER = re.compile(r"^\s+-\s*(?P<name>\w+)\s*$")


def directives(reference: pathlib.Path = REFERENCE) -> dict[str, list[str] | None]:
    """Each ``::: identifier`` of the reference pages, with its ``members:`` list (``None``: every public member).

    An identifier named by several directives shows the union of their members.
    """
    found: dict[str, list[str] | None] = {}
    for page in sorted(reference.glob("*.md")):
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            match = _DIRECTIVE.match(line)
            if match is None:
                continue
            members: list[str] | None = None
            j = i + 1
            while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
                if lines[j].strip() == "members:":
                    members = []
                elif members is not None and (member := _MEMBER.match(lines[j])):
                    members.append(member["name"])
                j += 1
            identifier = match["identifier"]
            if identifier not in found:
                found[identifier] = members
            elif found[identifier] is None or members is None:
                found[identifier] = None  # one directive without a members list renders every public member
            else:
                found[identifier] = [*found[identifier], *members]
    return found


def _shows(directive: str, name: str, found: dict[str, list[str] | None]) -> bool:
    return directive in found and (found[directive] is None or name in found[directive])  # type: ignore[operator]


def is_documented(package: str, name: str, obj: Any, found: dict[str, list[str] | None]) -> bool:
    """True when the reference renders ``package.name``: by itself, through its package or its defining module."""
    home = getattr(obj, "__module__", None)
    return (
        f"{package}.{name}" in found or _shows(package, name, found) or (home is not None and _shows(home, name, found))
    )


@functools.cache
def _static(package: str) -> griffe.Object:
    return griffe.load(package, search_paths=[str(REPO)])


def docstring(module: str, name: str, obj: Any) -> str:
    """The docstring mkdocstrings shows for ``module.name``: a class's own, a routine's, or an attribute's literal."""
    if inspect.isclass(obj):
        return (vars(obj).get("__doc__") or "").strip()
    if inspect.isroutine(obj):
        return (obj.__doc__ or "").strip()
    package, _, rest = module.partition(".")
    member = _static(package)[f"{rest}.{name}" if rest else name]
    return member.docstring.value.strip() if member.docstring is not None else ""


def _member_docstring(cls: type, name: str) -> str | None:
    """The docstring of a method or property defined by ``cls``; ``None`` for what is not a method or property."""
    attribute = vars(cls)[name]
    if isinstance(attribute, property):
        attribute = attribute.fget
    elif isinstance(attribute, (classmethod, staticmethod)):
        attribute = attribute.__func__
    if not inspect.isfunction(attribute):
        return None
    return (attribute.__doc__ or "").strip()


def _overrides(cls: type, name: str) -> bool:
    # An override of a base class's method (a Lightning hook) keeps the base's documented contract.
    return any(name in vars(base) for base in cls.__mro__[1:])


def _public_modules(package: ModuleType) -> list[str]:
    # lightning_gpipe's layers (engine/, profile/, partition/, plan/) document every module; the zoo documents its
    # subpackages whole. The deprecated alias lightning_gpipe.build is not walked (importing it warns).
    walk = pkgutil.walk_packages if package.__name__ == "lightning_gpipe" else pkgutil.iter_modules
    return [
        info.name
        for info in walk(package.__path__, prefix=f"{package.__name__}.")
        if not any(part.startswith("_") for part in info.name.split(".")) and not _deprecated(info.name)
    ]


def _deprecated(name: str) -> bool:
    return name == "lightning_gpipe.build" or name.startswith("lightning_gpipe.build.")


def _param(key: str, *values: Any) -> Any:
    return pytest.param(*values, id=key)


FOUND = directives()
EXPORTED = [(package, name) for package in PACKAGES for name in importlib.import_module(package).__all__]


def _import_or_none(identifier: str) -> ModuleType | None:
    try:
        return importlib.import_module(identifier)
    except ImportError:
        return None


DOCUMENTED_MODULES = [identifier for identifier in FOUND if _import_or_none(identifier) is not None]
MODULE_NAMES = [
    (module, name)
    for module in DOCUMENTED_MODULES
    if module not in PACKAGES
    for name in importlib.import_module(module).__all__
    if _shows(module, name, FOUND)
]
CLASSES = {
    f"{obj.__module__}.{obj.__qualname__}": obj
    for module, names in [(package, importlib.import_module(package).__all__) for package in PACKAGES]
    + [(module, [n for m, n in MODULE_NAMES if m == module]) for module in DOCUMENTED_MODULES if module not in PACKAGES]
    for name in names
    if inspect.isclass(obj := getattr(importlib.import_module(module), name))
}
METHODS = [
    (f"{key}.{name}", cls, name)
    for key, cls in sorted(CLASSES.items())
    if cls.__module__.split(".")[0] in PACKAGES
    for name in vars(cls)
    if not name.startswith("_") and not _overrides(cls, name) and _member_docstring(cls, name) is not None
]


def test_the_reference_pages_are_parsed() -> None:
    assert {"lightning_gpipe.GPipeStrategy", "zoo", "lightning_gpipe.strategy", "zoo.data"} <= set(FOUND)
    assert "AmoebaNetD" in (FOUND["zoo"] or [])
    assert FOUND["lightning_gpipe.strategy"] is None
    assert FOUND["zoo.backbone"] == ["read_checkpoint", "load_backbone"]


def test_directives_merge_their_members_and_a_directive_without_members_shows_all(tmp_path: pathlib.Path) -> None:
    (tmp_path / "a.md").write_text(
        "::: pkg\n    options:\n      members:\n        - one\n\n::: pkg.module\n    options:\n      heading_level: 3\n"
    )
    (tmp_path / "b.md").write_text("::: pkg\n    options:\n      members:\n        - two\n\n::: pkg.module\n")
    assert directives(tmp_path) == {"pkg": ["one", "two"], "pkg.module": None}
    assert is_documented("pkg", "two", None, directives(tmp_path))
    assert not is_documented("pkg", "three", None, directives(tmp_path))


@pytest.mark.parametrize(("package", "name"), [_param(f"{p}.{n}", p, n) for p, n in EXPORTED])
def test_every_exported_name_is_in_the_reference_with_a_docstring(package: str, name: str) -> None:
    obj = getattr(importlib.import_module(package), name)
    assert is_documented(package, name, obj, FOUND), (
        f"{package}.{name} is in {package}.__all__ but no '::: ' directive of docs/reference/*.md renders it: "
        f"add it to the members of '::: {package}' or document its module"
    )
    assert docstring(package, name, obj), f"{package}.{name} has no docstring"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_module_is_in_the_reference(package: str) -> None:
    exported = set(importlib.import_module(package).__all__)
    missing = [
        module
        for module in _public_modules(importlib.import_module(package))
        if module not in FOUND
        and module != f"{package}.__main__"
        # A module whose public names the package itself exports is documented through the package.
        and not set(getattr(importlib.import_module(module), "__all__", ["?"])) <= exported
    ]
    assert not missing, f"modules missing from docs/reference/*.md: {missing}; add a '::: module' directive"


@pytest.mark.parametrize("module", DOCUMENTED_MODULES)
def test_every_documented_module_has_a_docstring_and_all(module: str) -> None:
    imported = importlib.import_module(module)
    assert (imported.__doc__ or "").strip(), f"{module} has no module docstring"
    assert isinstance(getattr(imported, "__all__", None), list), f"{module} has no __all__"


@pytest.mark.parametrize(("module", "name"), [_param(f"{m}.{n}", m, n) for m, n in MODULE_NAMES])
def test_every_name_a_documented_module_shows_has_a_docstring(module: str, name: str) -> None:
    assert docstring(module, name, getattr(importlib.import_module(module), name)), f"{module}.{name}: no docstring"


@pytest.mark.parametrize(("cls", "name"), [_param(key, cls, name) for key, cls, name in METHODS])
def test_every_public_method_of_a_public_class_has_a_docstring(cls: type, name: str) -> None:
    assert _member_docstring(cls, name), f"{cls.__qualname__}.{name} has no docstring"
