"""kiln.registry: names map to one object each, a lazily registered name imports its module on first lookup,
and every way a lookup can fail is one sentence (the valid names, a missing module, a module that does not
register the name) while a dependency missing inside a module is not disguised as an unknown name."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from kiln.registry import Registry, UnknownNameError


def test_a_name_maps_to_one_object_case_blind():
    registry: Registry[object] = Registry("widget", "widget.name")
    first, other = object(), object()
    registry.register("Alpha", "a")(first)
    registry.add("ALPHA", first)  # the same object again: nothing to refuse
    assert registry.get("alpha") is first and registry.get("A") is first
    with pytest.raises(ValueError, match=r"^widget name 'alpha' is registered twice$"):
        registry.add("alpha", other)
    assert registry.get("alpha") is first


def test_an_unknown_name_lists_the_valid_ones_and_the_closest():
    registry: Registry[object] = Registry("widget", "widget.name")
    for name in ("spanner", "hammer"):
        registry.add(name, object())
    with pytest.raises(UnknownNameError, match=r"Unknown widget 'hamer' in `widget.name`\. Did you mean 'hammer'\?"):
        registry.get("hamer")
    with pytest.raises(
        UnknownNameError, match=r"Unknown widget 'x' in `widget.name`\. Valid names: hammer, spanner\.$"
    ):
        registry.check("x")


def test_a_lazy_name_imports_its_module_and_each_failure_is_one_sentence(tmp_path, monkeypatch):
    registry: Registry[object] = Registry("widget", "widget.name")
    # the module registers into this test's registry, handed over through sys.modules
    monkeypatch.setitem(sys.modules, "kiln_test_widgets", SimpleNamespace(REGISTRY=registry))
    (tmp_path / "kiln_test_widget.py").write_text(
        "import sys\nsys.modules['kiln_test_widgets'].REGISTRY.add('lazy', 'registered')\n"
    )
    (tmp_path / "kiln_test_broken_widget.py").write_text("import kiln_test_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("kiln_test_widget", "kiln_test_broken_widget"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    registry.add_lazy("lazy", "kiln_test_widget")
    assert registry.get("lazy") == "registered"
    registry.add_lazy("gone", "kiln_test_no_such_widget")
    with pytest.raises(UnknownNameError, match=r"^The widget 'gone' is not implemented in this version of kiln"):
        registry.get("gone")
    registry.add_lazy("silent", "json")  # a module that imports but registers nothing under the name
    with pytest.raises(UnknownNameError, match=r"^json did not register the widget 'silent'\.$"):
        registry.get("silent")
    registry.add_lazy("broken", "kiln_test_broken_widget")  # its own import fails: that error, as it is
    with pytest.raises(ModuleNotFoundError, match="kiln_test_no_such_dependency"):
        registry.get("broken")
