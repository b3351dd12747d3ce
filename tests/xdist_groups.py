"""How pytest-xdist shares the tests out (`--dist loadgroup`, the Makefile's).

Each module runs whole on one process (its module-scoped engines and topologies are built
once); the modules that share the session's topology run on one process, and so do those
that share the default model's services (`smollm`), those that share
transformers' reference model (`hf_model`, 30 s to build) and those whose TP ranks fork
from one fork server (`forked_ranks`, its imports 4 s of CPU; taken as an argument or
through `pytest.mark.usefixtures`). xdist's own
`xdist_group` marks do not reach its scheduler under the locked pytest (it renames a node
attribute the scheduler no longer reads), so this scheduler groups by module, from the
nodeid, reading which shared fixture a module's tests take. It overrides
`LoadScopeScheduling._split_scope`, which is xdist's own but not public: the lock pins
xdist, and tests/integration/test_xdist_groups.py checks the grouping under the pinned version."""

from __future__ import annotations

import functools
import re
from pathlib import Path

SHARED = ("topology", "smollm", "hf_model", "forked_ranks")


@functools.cache  # one read of each module, however many of its tests are scheduled
def group(rootpath: Path, module: str) -> str:
    try:
        text = (rootpath / module).read_text()
    except OSError:
        text = ""
    takes = {name for name in SHARED
             if re.search(rf"def test_\w*\([^)]*\b{name}\b|usefixtures\(\"{name}\"", text)}
    return next((name for name in SHARED if name in takes), module)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`, grouped as said above."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group(config.rootpath, nodeid.split("::")[0])

    return ByModule(config, log)
