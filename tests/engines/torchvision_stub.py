"""An import-only stand-in for `torchvision`, for SGLang 0.5.23 in the engine probes.

SGLang imports torchvision at module level (sglang/__init__.py -> srt/utils/hf_transformers_patches.py, and
srt/configs -> srt/multimodal/internvl_utils.py) for multimodal models only. The PyPI torchvision wheels link
libtorch_cuda and fail against the CPU torch (`operator torchvision::nms does not exist`), so the probe installs
this meta-path finder before importing sglang: every `torchvision[.x]` import gives a module whose attributes are
inert dummy classes. Nothing the EAGLE-3 drafter runs calls into it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _Dummy:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Dummy()

    def __getattr__(self, name):
        return _Dummy()

    def __mro_entries__(self, bases):
        return (object,)

    def __iter__(self):
        return iter(())


class _DummyMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Dummy()


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _DummyMeta(name, (), {"__init__": lambda self, *a, **k: None, "__getattr__": lambda self, n: _Dummy()})
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+stub"
        return module

    def exec_module(self, module):
        pass


def install(names: tuple[str, ...] = ("torchvision",)) -> None:
    """Put the stub finder first on sys.meta_path (before any real torchvision could be found)."""
    sys.meta_path.insert(0, _Finder(set(names)))
