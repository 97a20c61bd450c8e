"""Table loading, validation errors and round trips through the Python API."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppd_router import Table, TableError

from ..conftest import TABLES


def base_doc():
    return json.loads((TABLES / "h100-llama3.1-8b-2P2pD.json").read_text())


def load(doc, name="bad.json"):
    return Table.from_json(json.dumps(doc), name)


def test_round_trip_keeps_every_cell(tmp_path):
    t = Table.load(TABLES / "h100-llama3.1-8b-2P2pD.json")
    out = tmp_path / "copy.json"
    t.save(out)
    again = Table.load(out)
    assert again.cells == t.cells
    assert again.deployment == t.deployment


@pytest.mark.parametrize(
    "mutate, location, field",
    [
        (lambda d: d["cells"][3]["x0"].update(ttft_ms=-1), "cells[3]", "x0.ttft_ms"),
        (lambda d: d["cells"][3]["x1"].update(tpot_ms=float("nan")), "cells[3]", "x1.tpot_ms"),
        (lambda d: d["cells"][5]["x1"].update(n=0), "cells[5]", "x1.n"),
        (lambda d: d["cells"][7].update(workload="enormous"), "cells[7]", "workload"),
        (lambda d: d["cells"][7].update(context="medium"), "cells[7]", "context"),
        (lambda d: d["cells"][2].update(qps=3.5), "cells[2]", "qps"),
        (lambda d: d["cells"][2]["x0"].update(ttft_ms="slow"), "cells[2]", "x0.ttft_ms"),
        (lambda d: d["cells"][2]["x0"].pop("n"), "cells[2]", "x0"),
        (lambda d: d.update(schema="ppd-table/2"), "", "schema"),
        (lambda d: d["axes"].update(qps=[4, 2]), "axes", "qps"),
    ],
)
def test_errors_name_file_cell_and_field(mutate, location, field):
    doc = base_doc()
    mutate(doc)
    with pytest.raises(TableError) as e:
        load(doc)
    msg = str(e.value)
    assert msg.startswith("table bad.json")
    assert location in msg
    assert field in msg


def test_nan_and_text_that_is_not_json_are_rejected():
    with pytest.raises(TableError, match="bad.json"):
        Table.from_json("{not json", "bad.json")
    with pytest.raises(TableError):
        Table.from_json('{"schema": "ppd-table/1", "axes": {}, "cells": []}', "bad.json")


def test_missing_file_is_a_table_error(tmp_path):
    with pytest.raises(TableError, match="cannot read"):
        Table.load(tmp_path / "absent.json")


def test_duplicate_cells_are_rejected():
    doc = base_doc()
    doc["cells"].append(doc["cells"][0])
    with pytest.raises(TableError, match="duplicates"):
        load(doc)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=400))
def test_arbitrary_bytes_never_crash_the_loader(data):
    text = data.decode("utf-8", errors="replace")
    with pytest.raises(TableError):
        Table.from_json(text, "fuzz.json")


@settings(max_examples=50, deadline=None)
@given(index=st.integers(0, 179), key=st.sampled_from(["ttft_ms", "tpot_ms"]),
       value=st.one_of(st.floats(max_value=0), st.just(float("inf")), st.text(max_size=3), st.none()))
def test_any_bad_measurement_is_named(index, key, value):
    doc = base_doc()
    doc["cells"][index]["x0"][key] = value
    with pytest.raises(TableError) as e:
        load(doc)
    assert f"cells[{index}]" in str(e.value)
    assert f"x0.{key}" in str(e.value)
