"""Builds written before each strategy had its home in runtime/parallel/ still run: their rank scripts
import from runtime.spatial, runtime.subgraph and runtime.tensor_parallel (what codegen wrote then,
found by generating builds of every strategy at the previous commit), and those paths give the very
objects new builds import from the strategies' homes."""

import importlib

import pytest

# old path -> (home, names rank scripts of that time import from it)
OLD_PATHS = {
    "runtime.spatial": ("runtime.parallel.spatial.tiles", ("SpatialContext", "conv_windows", "pool_windows")),
    "runtime.subgraph": ("runtime.parallel.subgraph.regions", ("SubgraphContext",)),
    "runtime.tensor_parallel": ("runtime.parallel.tensor.layers",
                                ("scatter_to_group", "copy_to_group", "gather_sequence", "gather_whole",
                                 "FeatureSplit")),
}


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_path_gives_the_homes_objects(old):
    home, names = OLD_PATHS[old]
    before, now = importlib.import_module(old), importlib.import_module(home)
    for name in names:
        assert getattr(before, name) is getattr(now, name), name
    namespace: dict = {}
    exec(f"from {old} import {names[0]} as imported", namespace)   # the form a rank script uses
    assert namespace["imported"] is getattr(now, names[0])
    with pytest.raises(AttributeError):
        getattr(before, "no_such_name")
