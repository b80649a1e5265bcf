"""``xlaunch._records``: the launch path's value classes behave like frozen dataclasses."""
from __future__ import annotations

import copy
import pickle
from typing import ClassVar, Optional

import pytest

from xlaunch._records import FrozenRecordError, factory, fields, record, replace


@record
class Point:
    """A test record."""

    x: int
    y: int = 0
    tags: list = factory(list)
    label: Optional[str] = None
    KIND: ClassVar[str] = "point"

    @property
    def norm1(self) -> int:
        return abs(self.x) + abs(self.y)


@record
class Point3(Point):
    z: int = 0


@record(frozen=False)
class Counter:
    count: int = 0


def test_init_by_position_keyword_and_default():
    assert (Point(1).x, Point(1).y, Point(1).label) == (1, 0, None)
    p = Point(1, 2, label="a")
    assert (p.x, p.y, p.label, p.norm1) == (1, 2, "a", 3)
    assert fields(Point) == ("x", "y", "tags", "label") == fields(p)
    assert Point.KIND == "point"


def test_factory_defaults_are_fresh_per_instance():
    a, b = Point(0), Point(0)
    a.tags.append(1)
    assert b.tags == [] and "tags" not in Point.__dict__


@pytest.mark.parametrize("call, message", [
    (lambda: Point(), "missing required argument 'x'"),
    (lambda: Point(1, 2, [], None, 5), "takes 4 arguments but 5 were given"),
    (lambda: Point(1, x=2), "multiple values for argument 'x'"),
    (lambda: Point(1, w=2), "unexpected keyword argument 'w'"),
])
def test_bad_calls_are_type_errors(call, message):
    with pytest.raises(TypeError, match=message):
        call()


def test_repr_eq_hash():
    assert repr(Point(1, 2)) == "Point(x=1, y=2, tags=[], label=None)"
    assert Point(1, 2) == Point(1, 2) and Point(1, 2) != Point(2, 1)
    assert Point(1) != Point3(1)    # another class is never equal, as with dataclasses
    frozen = record(type("Pair", (), {"__annotations__": {"a": "int", "b": "tuple"}}))
    assert hash(frozen(1, (2,))) == hash(frozen(1, (2,)))
    assert len({frozen(1, (2,)), frozen(1, (2,)), frozen(2, ())}) == 2


def test_frozen_fields_cannot_change():
    p = Point(1)
    with pytest.raises(FrozenRecordError, match="cannot assign to field 'x'"):
        p.x = 2
    with pytest.raises(AttributeError):   # FrozenRecordError is an AttributeError, as dataclasses'
        del p.y
    assert p.x == 1


def test_mutable_record_changes_and_is_unhashable():
    c = Counter()
    c.count += 1
    assert c == Counter(1)
    with pytest.raises(TypeError):
        hash(c)


def test_inherited_fields_come_first():
    assert fields(Point3) == ("x", "y", "tags", "label", "z")
    assert Point3(1, z=3).z == 3


def test_field_without_default_after_one_with_is_refused():
    with pytest.raises(TypeError, match="'b' without a default follows 'a'"):
        record(type("Bad", (), {"__annotations__": {"a": "int", "b": "int"}, "a": 1}))


def test_replace_copies_with_changes():
    p = Point(1, 2, label="a")
    q = replace(p, y=5)
    assert (q.x, q.y, q.label) == (1, 5, "a") and p.y == 2
    with pytest.raises(TypeError, match="no field 'w'"):
        replace(p, w=1)
    with pytest.raises(TypeError, match="not a record"):
        replace(object())


def test_post_init_runs():
    @record
    class Checked:
        n: int

        def __post_init__(self) -> None:
            if self.n < 0:
                raise ValueError("n < 0")

    assert Checked(1).n == 1
    with pytest.raises(ValueError):
        Checked(-1)


def test_pickle_and_copy_round_trip():
    p = Point(1, 2, [3], "a")
    assert pickle.loads(pickle.dumps(p)) == p
    assert copy.deepcopy(p) == p and copy.copy(p) == p



def test_methods_the_class_defines_stay() -> None:
    @record
    class Named:
        name: str
        size: int = 0

        def __repr__(self) -> str:
            return f"<{self.name}>"

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Named) and other.name == self.name

    assert repr(Named("a", 1)) == "<a>" and Named("a", 1) == Named("a", 2)
    with pytest.raises(FrozenRecordError):
        Named("a").size = 1
