"""The sdk's public surface is what ``sdk/__init__.py`` lists in ``__all__``, no more and no
less, and each of its names calls itself ``sdk.<name>``: the modules that define them are
private (``sdk._client``...) and may move."""

import types

import pytest

import sdk


def public_names() -> set[str]:
    return {
        name
        for name, value in vars(sdk).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }


def test_all_lists_exactly_the_public_names() -> None:
    assert len(sdk.__all__) == len(set(sdk.__all__)), "a name listed twice"
    assert set(sdk.__all__) == public_names()


def test_every_module_of_the_sdk_is_private() -> None:
    modules = [name for name, value in vars(sdk).items() if isinstance(value, types.ModuleType)]
    assert modules and all(name.startswith("_") for name in modules)


@pytest.mark.parametrize("name", sdk.__all__)
def test_each_export_names_the_sdk_as_its_module(name: str) -> None:
    member = getattr(sdk, name)
    assert isinstance(member, type | types.FunctionType), f"{name} is {member!r}"
    assert member.__module__ == "sdk"
    assert member.__qualname__ == name
