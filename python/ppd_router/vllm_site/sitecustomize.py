"""Loaded by the vLLM servers that ``ppd-router launch --device cpu`` starts (it is on their PYTHONPATH).

NIXL's progress thread polls UCX with no pause (``nixl_agent`` hard-codes ``pthrDelay = 0``), so
every idle server burns a core; with several servers on a few cores they starve each other and
start-up alone takes many minutes. Turning the thread off is no cure: over UCX's TCP transport a
pull from P needs P's side to progress, and an idle P never does, so transfers hang. So when
PPD_NIXL_PTHR_DELAY_US is set, the thread stays but sleeps that long between polls. The patch is
applied when NIXL's API module is imported; processes that never import NIXL pay nothing.
"""

import importlib.abc
import importlib.util
import os
import sys

_API_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


class _Bindings:
    """NIXL's bindings module, except that new agents get the configured progress-thread delay."""

    def __init__(self, real, delay_us: int) -> None:
        self._real = real
        self._delay_us = delay_us

    def nixlAgent(self, name, config):  # noqa: N802 - the bindings' own name
        config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)

    def __getattr__(self, attr):
        return getattr(self._real, attr)


class _PatchNixl(importlib.abc.MetaPathFinder):
    def __init__(self, delay_us: int) -> None:
        self.delay_us = delay_us

    def find_spec(self, name, path, target=None):
        if name not in _API_MODULES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        delay_us = self.delay_us

        def exec_and_patch(module):
            exec_module(module)
            if hasattr(module, "nixlBind"):
                module.nixlBind = _Bindings(module.nixlBind, delay_us)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]  # this loader only, on purpose
        return spec


_delay = os.environ.get("PPD_NIXL_PTHR_DELAY_US", "")
if _delay.isdigit():
    sys.meta_path.insert(0, _PatchNixl(int(_delay)))
