"""``distmm bench``'s study files (``distmm.cli.study``): what a study measures, and a study
that would measure less than it lists refused before anything runs."""
from __future__ import annotations

import pytest

from distmm.cli.study import parse_study


def _dask(chunk=None, **change) -> dict:
    series = {"kind": "strong", "engines": ["dask"], "counts": [1, 2], "sizes": [96], **change}
    if chunk is not None:
        series["chunk"] = chunk
    return series


def test_one_dask_configuration_at_two_chunks_is_refused():
    """Two series of one Dask configuration at different chunks: before, the second
    series was dropped without a word (a configuration is measured once, at the first
    series' chunk), and its records could not have said which chunk they ran."""
    data = {"references": ["dask.array"], "series": [_dask(32), _dask(48)]}
    with pytest.raises(ValueError) as err:
        parse_study(data, where="s.toml")
    assert str(err.value) == (
        "s.toml: series[1].chunk: 48, but series[0] measures distmm-dask@1workers float64 "
        "96x96x96 at chunk 32 (a configuration is measured once, and its variant names no "
        "chunk): give chunk 48 a study of its own")
    # another backend is another distmm configuration, but dask.array is the same one
    data["series"][1] = _dask(48, backends=["numba"])
    with pytest.raises(ValueError, match=r"series\[1\]\.chunk: 48, but series\[0\] measures "
                                         r"dask\.array@1workers float64 96x96x96 at chunk 32"):
        parse_study(data, where="s.toml")


@pytest.mark.parametrize("second", [
    _dask(),                                # the default chunk at 96: 96, the same as given
    _dask(48, counts=[4]),                  # another count: another configuration
    _dask(48, sizes=[100]),                 # another size
    _dask(48, dtypes=["float32"]),          # another dtype
])
def test_a_chunk_only_one_series_measures_is_taken(second):
    study = parse_study({"references": ["dask.array"], "series": [_dask(96), second]})
    chunks = {(c.variant, c.dtype, c.m, c.chunk) for c in study.configurations()}
    assert len(chunks) == len({key[:3] for key in chunks})  # one chunk per configuration
    assert {c for *_, c in chunks} == ({96} if second.get("chunk") is None else {96, 48})
