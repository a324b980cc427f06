"""Every exception class dynamo_flexkv defines derives from FlexKVError, and still from the
built-in base it had (callers that catch ValueError, RuntimeError, OSError, ... keep working)."""

import ast
import builtins
import importlib
from pathlib import Path

import pytest

import dynamo_flexkv
from dynamo_flexkv.core.errors import FlexKVError

PACKAGE = Path(dynamo_flexkv.__file__).resolve().parent
BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def _exception_classes():
    """(module, class, bases) of every class in the package's source whose bases name a built-in
    exception or FlexKVError directly; subclasses of those are checked when imported."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                if module != "dynamo_flexkv.core.errors" and any(
                    b in BUILTIN_EXCEPTIONS or b == "FlexKVError" for b in bases
                ):
                    out.append((module, node.name, bases))
    return out


CLASSES = _exception_classes()


def test_the_base_is_exported_and_light():
    assert dynamo_flexkv.FlexKVError is FlexKVError
    assert issubclass(FlexKVError, Exception)
    assert len(CLASSES) >= 23  # the scan finds the package's classes


@pytest.mark.parametrize("module,name,bases", CLASSES, ids=[f"{m}.{n}" for m, n, _ in CLASSES])
def test_every_exception_class_derives_from_flexkv_error(module, name, bases):
    # In the source: a class on a built-in exception also names FlexKVError (no import needed, so
    # modules that need torch, vLLM or Dynamo are covered too).
    assert "FlexKVError" in bases, f"{module}.{name}({', '.join(bases)}) does not derive from FlexKVError"
    try:
        mod = importlib.import_module(module)
    except ImportError as e:  # torch / vllm / dynamo / nixl absent: the source check above stands
        pytest.skip(f"{module} does not import here: {e}")
    cls = getattr(mod, name)
    assert issubclass(cls, FlexKVError)
    for base in bases:
        if base in BUILTIN_EXCEPTIONS:
            assert issubclass(cls, getattr(builtins, base)), f"{name} lost its base {base}"


def test_subclasses_defined_in_the_package_derive_from_it_too():
    """Classes deriving from one of ours (RemoteUnavailableError(RemoteError), ...)."""
    seen = 0
    for module in sorted({m for m, _, _ in CLASSES}):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        for value in vars(mod).values():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == module:
                assert issubclass(value, FlexKVError), f"{module}.{value.__name__}"
                seen += 1
    assert seen >= len(CLASSES)
