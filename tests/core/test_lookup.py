"""Name lookups (halludetect/core/lookup.py), shared by every registry: an unknown name is a user error
(and a KeyError) that suggests the closest name, when one is close, and lists every valid one."""

import pytest

from halludetect.core.errors import UserError
from halludetect.core.lookup import UnknownName, lookup


def test_an_unknown_name_suggests_the_closest_and_lists_all_sorted():
    table = {"openai": 2, "match": 1}
    assert lookup("judge", "match", table) == 1
    with pytest.raises(UnknownName) as e:
        lookup("judge", "mach", table)
    assert str(e.value) == "unknown judge 'mach'; did you mean 'match'? valid: match, openai"
    assert isinstance(e.value, UserError) and isinstance(e.value, KeyError)  # a stage prints it in one line
    with pytest.raises(KeyError, match=r"^unknown judge 'zzz'; valid: match, openai$"):  # nothing close: no guess
        lookup("judge", "zzz", table)
