"""The limits table's engine ceilings, held by a real engine
(tests/unit/test_limit_table.py checks the router's paths)."""

from __future__ import annotations

import pytest

from baton.services.common.sampling_params import SamplingParams
from baton.services.rpc.convert import sampling_params
from tests.unit.test_limit_table import ROWS, _request


@pytest.mark.parametrize("row", [r for r in ROWS if r.values[0].ceiling])
def test_each_row_with_a_ceiling_is_held_by_the_engine(row, small):
    """What a worker does with a request that reaches it directly: its sampling values
    through convert.sampling_params, the rest through the engine's add_request."""
    assert row.wire, f"{row.name}: a ceiling the engine holds needs the field's wire path"
    scope, _, name = row.wire.rpartition(".")
    engine_says = row.engine[0] if row.engine else name

    def send(n: int) -> None:
        request = _request(row, n)
        if scope == "sampling":
            sampling_params(request.sampling)
        else:
            assert scope == "", f"{row.name}: no engine path checks fields under {scope!r}"
            rid = small.engine.add_request([1, 2], SamplingParams(max_tokens=1),
                                           **{name: getattr(request, name)})
            small.engine.abort_request(rid)

    send(row.ceiling)
    with pytest.raises(ValueError) as e:
        send(row.ceiling + 1)
    assert str(e.value).startswith(f"{engine_says} may hold at most {row.ceiling} "), e.value
